"""Artifact store: verified before use, malformed or tampered manifests refused, writes atomic."""

import hashlib
import json
import threading

import pytest

from monodecode.errors import ArtifactError
from monodecode.services.artifacts import ArtifactStore, parse_manifest

KEY = "a" * 64
KEY2 = "b" * 64


def add(store, key=KEY, files=None, **kw):
    return store.add(
        build_key=key,
        backend="flydsl",
        arch="gfx942",
        dims_digest="d" * 64,
        widths=(1, 2),
        files=files or {"k1.hsaco": b"\x7fELF-k1", "sub/k2.hsaco": b"\x7fELF-k2"},
        compiler={"name": "flydsl", "version": "0.5.0"},
        profile="tiny",
        **kw,
    )


def test_add_then_lookup_verifies(tmp_path):
    store = ArtifactStore(tmp_path / "art")
    entry = add(store)
    assert (tmp_path / "art/sub/k2.hsaco").read_bytes() == b"\x7fELF-k2"
    found = store.lookup(KEY)
    assert found is not None and found.build_key == KEY and found.widths == (1, 2)
    assert found.path_of("k1.hsaco").read_bytes() == b"\x7fELF-k1"
    f = {x.path: x for x in entry.files}["k1.hsaco"]
    assert f.sha256 == hashlib.sha256(b"\x7fELF-k1").hexdigest() and f.bytes == 7
    assert store.lookup(KEY2) is None
    manifest = json.loads((tmp_path / "art/manifest.json").read_text())
    assert manifest["schema"] == 1 and manifest["artifacts"][0]["compiler"] == {"name": "flydsl", "version": "0.5.0"}


def test_missing_manifest_means_no_artifact(tmp_path):
    assert ArtifactStore(tmp_path).lookup(KEY) is None
    assert ArtifactStore(tmp_path).entries() == []


def test_adding_same_key_replaces_and_other_keys_survive(tmp_path):
    store = ArtifactStore(tmp_path)
    add(store)
    add(store, KEY2)
    add(store, KEY, files={"k1.hsaco": b"new"})
    keys = [e.build_key for e in store.entries()]
    assert sorted(keys) == [KEY, KEY2]
    assert store.lookup(KEY).files[0].bytes == 3


def test_tampered_file_is_a_checksum_refusal(tmp_path):
    store = ArtifactStore(tmp_path)
    add(store)
    p = tmp_path / "k1.hsaco"
    p.write_bytes(b"\x7fELF-k9")  # same size, different content
    with pytest.raises(ArtifactError, match=r"checksum mismatch for k1.hsaco \(sha256 .* manifest says"):
        store.lookup(KEY)
    p.write_bytes(b"short")
    with pytest.raises(ArtifactError, match=r"checksum mismatch for k1.hsaco \(size 5 bytes, manifest says 7\)"):
        store.lookup(KEY)
    p.unlink()
    with pytest.raises(ArtifactError, match="file k1.hsaco is missing"):
        store.lookup(KEY)
    problems = dict((e.build_key, why) for e, why in store.verify_all())
    assert "missing" in problems[KEY]


def test_corrupt_artifact_fault_changes_nothing_on_disk(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path)
    add(store)
    before = (tmp_path / "k1.hsaco").read_bytes()
    monkeypatch.setenv("MONODECODE_FAULT", "corrupt_artifact")
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        store.lookup(KEY)
    assert (tmp_path / "k1.hsaco").read_bytes() == before
    monkeypatch.delenv("MONODECODE_FAULT")
    assert store.lookup(KEY) is not None


GOOD = {
    "build_key": KEY,
    "backend": "flydsl",
    "arch": "gfx942",
    "dims_digest": "d",
    "widths": [1],
    "files": [{"path": "a", "sha256": "0" * 64, "bytes": 1}],
    "compiler": {"name": "f", "version": "1"},
}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[]", "must hold a JSON object"),
        ('{"schema": 2, "artifacts": []}', "unsupported schema 2"),
        ('{"schema": 1}', "'artifacts' must be a list"),
        (json.dumps({"schema": 1, "artifacts": [{**GOOD, "build_key": "xyz"}]}), "64-digit"),
        (
            json.dumps({"schema": 1, "artifacts": [{k: v for k, v in GOOD.items() if k != "arch"}]}),
            "missing field 'arch'",
        ),
        (json.dumps({"schema": 1, "artifacts": [{**GOOD, "widths": []}]}), "'widths' must be a non-empty list"),
        (json.dumps({"schema": 1, "artifacts": [{**GOOD, "widths": [0]}]}), "'widths' must be a non-empty list"),
        (json.dumps({"schema": 1, "artifacts": [{**GOOD, "files": []}]}), "'files' is empty"),
        (
            json.dumps(
                {
                    "schema": 1,
                    "artifacts": [{**GOOD, "files": [{"path": "../etc/passwd", "sha256": "0" * 64, "bytes": 1}]}],
                }
            ),
            "leaves the artifact directory",
        ),
        (
            json.dumps(
                {"schema": 1, "artifacts": [{**GOOD, "files": [{"path": "/abs", "sha256": "0" * 64, "bytes": 1}]}]}
            ),
            "leaves the artifact directory",
        ),
        (
            json.dumps({"schema": 1, "artifacts": [{**GOOD, "files": [{"path": "a", "sha256": "XYZ", "bytes": 1}]}]}),
            "'sha256' must be",
        ),
        (
            json.dumps(
                {"schema": 1, "artifacts": [{**GOOD, "files": [{"path": "a", "sha256": "0" * 64, "bytes": -1}]}]}
            ),
            "'bytes' must be",
        ),
        (json.dumps({"schema": 1, "artifacts": [{**GOOD, "compiler": {"name": "f"}}]}), "'compiler' needs"),
        (json.dumps({"schema": 1, "artifacts": [GOOD, GOOD]}), "listed twice"),
    ],
)
def test_malformed_manifests_are_one_line_errors(text, fragment):
    with pytest.raises(ArtifactError) as e:
        parse_manifest(text)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_malformed_manifest_on_disk_is_never_loaded(tmp_path):
    (tmp_path / "manifest.json").write_text('{"schema": 1, "artifacts": [{"build_key": 1}]}')
    with pytest.raises(ArtifactError, match=r"manifest.json: artifacts\[0\]: field 'build_key' must be a str"):
        ArtifactStore(tmp_path).lookup(KEY)


def test_unwritable_dir_as_root_via_a_file_in_the_way(tmp_path):
    # root ignores permissions, so make the store path impossible: a regular file
    blocker = tmp_path / "art"
    blocker.write_text("not a directory")
    with pytest.raises(ArtifactError, match="is not writable"):
        add(ArtifactStore(blocker))
    assert blocker.read_text() == "not a directory"


def test_bad_entry_rejected_before_anything_is_written(tmp_path):
    store = ArtifactStore(tmp_path / "s")
    with pytest.raises(ArtifactError, match="leaves the artifact directory"):
        add(store, files={"../escape": b"x"})
    with pytest.raises(ArtifactError, match="64-digit"):
        add(store, key="short")
    assert not (tmp_path / "escape").exists()
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_concurrent_adds_keep_every_entry(tmp_path):
    store = ArtifactStore(tmp_path)
    keys = [f"{i:064x}" for i in range(8)]
    threads = [
        threading.Thread(target=add, args=(ArtifactStore(tmp_path), k, {f"{k[-2:]}.bin": k.encode()})) for k in keys
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(e.build_key for e in store.entries()) == keys
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ---- the store is trusted code: no symlinks inside, no shared writes (issue 29) ------------------


def test_written_files_are_readable_by_the_server_user(tmp_path):
    """precompile's output is read by a server running as another user: files 0644, dirs 0755."""
    store = ArtifactStore(tmp_path / "art")
    add(store)
    for rel in ("manifest.json", "k1.hsaco", "sub/k2.hsaco"):
        assert (tmp_path / "art" / rel).stat().st_mode & 0o777 == 0o644, rel
    assert (tmp_path / "art" / "sub").stat().st_mode & 0o777 == 0o755


def test_a_symlinked_subdirectory_is_refused_for_reads_and_writes(tmp_path):
    store = ArtifactStore(tmp_path / "art")
    add(store)
    outside = tmp_path / "outside"
    (tmp_path / "art" / "sub").rename(outside)
    (tmp_path / "art" / "sub").symlink_to(outside)
    with pytest.raises(ArtifactError, match=r"goes through the symbolic link .*/art/sub; the store holds plain files"):
        store.lookup(KEY)
    with pytest.raises(ArtifactError, match="goes through the symbolic link"):
        add(store, KEY2, files={"sub/new.hsaco": b"x"})
    assert not (outside / "new.hsaco").exists()


def test_a_symlinked_file_or_manifest_is_refused(tmp_path):
    store = ArtifactStore(tmp_path / "art")
    add(store)
    k1 = tmp_path / "art" / "k1.hsaco"
    k1.rename(tmp_path / "k1-outside")
    k1.symlink_to(tmp_path / "k1-outside")
    with pytest.raises(ArtifactError, match="k1.hsaco is a symbolic link"):
        store.lookup(KEY)
    manifest = tmp_path / "art" / "manifest.json"
    manifest.rename(tmp_path / "manifest-outside")
    manifest.symlink_to(tmp_path / "manifest-outside")
    with pytest.raises(ArtifactError, match="manifest.json is a symbolic link"):
        store.entries()


@pytest.mark.parametrize("where, mode", [("", 0o775), ("", 0o777), ("sub", 0o757), ("k1.hsaco", 0o664)])
def test_what_others_may_write_is_refused(tmp_path, where, mode):
    store = ArtifactStore(tmp_path / "art")
    add(store)
    (tmp_path / "art" / where).chmod(mode)
    with pytest.raises(ArtifactError, match=rf"is writable by its group or others \(mode {mode:04o}\)"):
        store.lookup(KEY)
    with pytest.raises(ArtifactError):
        store.verify_entry(store.entries()[0]) if where else store.entries()


def test_the_store_itself_may_be_named_through_a_symlink(tmp_path):
    store = ArtifactStore(tmp_path / "art")
    add(store)
    (tmp_path / "link").symlink_to(tmp_path / "art")
    assert ArtifactStore(tmp_path / "link").lookup(KEY) is not None
