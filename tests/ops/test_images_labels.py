"""The image contract without an engine: labels (validation and the to/from round trip), pull
references, and the checks ``verify`` runs on the image it is inside (baked manifest + artifacts
on a real directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import image_info
from hypothesis import given, settings
from hypothesis import strategies as st

from monodecode.services.artifacts import ArtifactStore
from monodecode_ops.bases import parse_reference
from monodecode_ops.commands.build import redact_url
from monodecode_ops.engine import pull_ref
from monodecode_ops.image_checks import baked_checks
from monodecode_ops.labels import ImageError, ImageLabels

KEY_A, KEY_B = "a" * 64, "b" * 64
GOOD = {
    "io.monodecode.arch": "gfx942",
    "io.monodecode.version": "0.1.0",
    "io.monodecode.profiles": "tiny,llama3-8b",
    "io.monodecode.backends": "flydsl,reference",
    "io.monodecode.build-keys": f"{KEY_A},{KEY_B}",
    "io.monodecode.manifest-digest": "sha256:" + "c" * 64,
    "io.monodecode.artifact-dir": "/opt/monodecode/artifacts",
    "io.monodecode.compilers": "flydsl=0.5.0",
}


def test_labels_round_trip():
    """What build writes (to_labels) is what inspect/verify read back (from_labels), field by field."""
    lab = ImageLabels(
        arch="gfx950",
        version="0.1.0",
        profiles=("tiny", "llama3-8b"),
        backends=("flydsl", "reference"),
        build_keys=(KEY_A, KEY_B),
        manifest_digest="sha256:" + "c" * 64,
        compilers=("flydsl=0.5.0",),
        vllm_version="0.33.0",
        torch_version="2.9.1",
        base_name="vllm/vllm-openai-rocm:v0.33.0",
        base_digest="sha256:" + "d" * 64,
        revision="abc123",
        created="2026-12-01T00:00:00Z",
        source="https://example.invalid/monodecode",
    )
    written = lab.to_labels()
    assert ImageLabels.from_labels("img", written) == lab
    assert written["org.opencontainers.image.base.digest"] == "sha256:" + "d" * 64
    assert written["io.monodecode.vllm-version"] == "0.33.0"
    assert ImageLabels.from_labels("img", GOOD).to_labels().items() >= GOOD.items()


def test_good_labels():
    lab = ImageLabels.from_labels("img", GOOD)
    assert lab.arch == "gfx942" and lab.build_keys == (KEY_A, KEY_B)
    assert lab.profiles == ("tiny", "llama3-8b") and lab.compilers == ("flydsl=0.5.0",)
    assert ImageLabels.from_labels("img", {**GOOD, "io.monodecode.build-keys": ""}).build_keys == ()


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("io.monodecode.arch", "gfx1100", "label io.monodecode.arch is 'gfx1100'; expected one of gfx942, gfx950"),
        ("io.monodecode.arch", None, "label io.monodecode.arch is missing or empty"),
        ("io.monodecode.version", " ", "label io.monodecode.version is missing or empty"),
        ("io.monodecode.manifest-digest", "md5:1234", "label io.monodecode.manifest-digest is 'md5:1234'"),
        ("io.monodecode.build-keys", f"{KEY_A},{KEY_A}", "lists a build key twice"),
        ("io.monodecode.build-keys", "A" * 64, "not a 64-digit lowercase sha256 hex key"),
        ("io.monodecode.profiles", "tiny,Llama 8B", "malformed profile name 'Llama 8B'"),
        ("io.monodecode.backends", "flydsl,<x>", "malformed backend name '<x>'"),
        ("io.monodecode.artifact-dir", "artifacts", "expected an absolute path"),
        ("io.monodecode.artifact-dir", "/opt/../etc", "expected an absolute path"),
    ],
)
def test_bad_labels_name_the_label(key, value, expected):
    labels = dict(GOOD)
    if value is None:
        del labels[key]
    else:
        labels[key] = value
    with pytest.raises(ImageError) as e:
        ImageLabels.from_labels("repo/img:tag", labels)
    assert str(e.value).startswith("repo/img:tag: ") and expected in str(e.value)
    assert "\n" not in str(e.value)


def test_image_without_our_labels():
    with pytest.raises(ImageError, match="not a monodecode image"):
        ImageLabels.from_labels("debian:12", {"org.opencontainers.image.title": "debian"})


def test_pull_ref_drops_the_documenting_tag():
    digest = "sha256:" + "d" * 64
    assert pull_ref(f"rocm/vllm:rocm7.12.0_gfx94X@{digest}") == f"rocm/vllm@{digest}"
    assert pull_ref(f"registry.local:5000/ns/img:v1@{digest}") == f"registry.local:5000/ns/img@{digest}"
    assert pull_ref("registry.local:5000/ns/img:v1") == "registry.local:5000/ns/img:v1"


# ---- baked_checks: what verify reports inside an image ----------------------------------------


@pytest.fixture
def baked(tmp_path, monkeypatch):
    """An image's /opt/monodecode layout on disk, with image.json written by the real pyenv.py."""
    store = ArtifactStore(tmp_path / "artifacts")
    store.add(
        build_key=KEY_A,
        backend="flydsl",
        arch="gfx950",
        dims_digest="e" * 64,
        widths=[1, 2, 4, 8],
        files={"a/k1_w1.hsaco": b"\x7fELF" + bytes(range(200)), "a/k2_w1.hsaco": b"\x7fELF" * 50},
        compiler={"name": "flydsl", "version": "0.5.0"},
        profile="tiny",
    )
    info = tmp_path / "image.json"
    image_info(store.root, info)
    monkeypatch.setenv("MONODECODE_IMAGE_INFO", str(info))
    monkeypatch.setenv("MONODECODE_ARTIFACT_DIR", str(store.root))
    monkeypatch.delenv("MONODECODE_FAULT", raising=False)
    return store


def by_name(checks):
    return {c.name: c for c in checks}


def test_baked_checks_pass_on_an_intact_image(baked):
    checks = by_name(baked_checks())
    assert [c.status for c in checks.values()] == ["pass", "pass", "pass"]
    assert "1 artifact(s), 2 file(s)" in checks["baked artifacts"].detail


def test_baked_checks_outside_an_image(tmp_path, monkeypatch):
    monkeypatch.setenv("MONODECODE_IMAGE_INFO", str(tmp_path / "nothing.json"))
    assert baked_checks() == []


def test_flipped_byte_is_a_checksum_failure(baked):
    f = baked.root / "a" / "k1_w1.hsaco"
    data = bytearray(f.read_bytes())
    data[10] ^= 0x01
    f.write_bytes(bytes(data))
    checks = by_name(baked_checks())
    assert checks["baked manifest"].status == "pass"
    assert checks["baked artifacts"].status == "fail" and checks["baked artifacts"].required
    assert "checksum mismatch for a/k1_w1.hsaco" in checks["baked artifacts"].detail


def test_missing_file_and_rewritten_manifest(baked):
    (baked.root / "a" / "k2_w1.hsaco").unlink()
    assert "is missing" in by_name(baked_checks())["baked artifacts"].detail
    manifest = json.loads(baked.manifest_path.read_text())
    manifest["artifacts"][0]["widths"] = [1]
    baked.manifest_path.write_text(json.dumps(manifest))
    checks = by_name(baked_checks())
    assert checks["baked manifest"].status == "fail"
    assert "the manifest was changed after the build" in checks["baked manifest"].detail


def test_manifest_entry_for_another_arch(baked):
    info_path = Path(os.environ["MONODECODE_IMAGE_INFO"])
    info = json.loads(info_path.read_text())
    info["arch"] = "gfx942"
    info_path.write_text(json.dumps(info))
    detail = by_name(baked_checks())["baked artifacts"].detail
    assert "compiled for gfx950, the image is labelled gfx942" in detail


@pytest.mark.parametrize(
    "content,fragment",
    [
        (b"{not json", "not valid JSON"),
        (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
        (b'{"arch": ' + b"1" * 5000 + b"}", "too many digits"),
        (b'{"arch": 1e999}', "not a finite number"),
        (b"\xff\xfe{", "not UTF-8"),
        (b"[1, 2]", "unreadable or incomplete"),
        (b'{"arch": "gfx950"}', "unreadable or incomplete"),
        ("directory", "not a regular file"),
        ("fifo", "not a regular file"),
    ],
)
def test_unreadable_image_info_is_a_failed_check(baked, content, fragment):
    path = Path(os.environ["MONODECODE_IMAGE_INFO"])
    path.unlink()
    if content == "directory":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)  # a read would block forever
    else:
        path.write_bytes(content)
    (check,) = baked_checks()
    assert check.status == "fail" and fragment in check.detail, check.detail
    assert "\n" not in check.detail


# ---- the image's vLLM against the plugin's range -----------------------------------------------


@pytest.mark.parametrize(
    "version,status",
    [
        ("0.33.0", "pass"),
        ("0.33.0+rocm7.1", "pass"),
        ("0.32.0", "pass"),
        ("0.31.0", "fail"),
        ("0.34.0", "fail"),
        ("0.16.0", "fail"),
        ("not-a-version", "fail"),
        ("", "skip"),
    ],
)
def test_vllm_label_against_the_supported_range(version, status):
    from monodecode_ops.base_vllm import supported_vllm
    from monodecode_ops.image_checks import vllm_check

    lab = ImageLabels.from_labels("img", {**GOOD, "io.monodecode.vllm-version": version})
    check = vllm_check(lab)
    assert check.status == status, check
    if status == "fail":
        assert version in check.detail and supported_vllm() in check.detail  # names both


def _fake_vllm_site(tmp_path: Path, version: str) -> Path:
    """A site directory holding only vLLM's distribution metadata (what importlib.metadata reads)."""
    site = tmp_path / f"site-{version}"
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return site


@pytest.mark.parametrize("version,ok", [("0.31.0", False), ("0.33.0", True)])
def test_runtime_stage_check_of_the_base_vllm(tmp_path, version, ok):
    """What the image's runtime stage runs (python3 -m monodecode_ops.base_vllm) on a base whose
    vLLM has ``version``: outside the range it fails, naming both versions."""
    from monodecode_ops.base_vllm import supported_vllm

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_fake_vllm_site(tmp_path, version)), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "monodecode_ops.base_vllm"], capture_output=True, text=True, env=env)
    if ok:
        assert proc.returncode == 0 and f"vLLM {version} is one the plugin supports" in proc.stdout, proc.stderr
    else:
        assert proc.returncode == 1, proc.stdout
        assert (
            f"the base image has vLLM {version}; the monodecode plugin supports vLLM {supported_vllm()}" in proc.stderr
        )


# ---- any input: a value or one error line ------------------------------------------------------

_label_values = st.one_of(st.text(max_size=80), st.sampled_from(list(GOOD.values())), st.just(""))


@settings(max_examples=300, deadline=None)
@given(
    changes=st.dictionaries(st.sampled_from(sorted(GOOD)), _label_values, max_size=4),
    drop=st.sets(st.sampled_from(sorted(GOOD))),
)
def test_any_labels_give_labels_or_one_error_line(changes, drop):
    labels = {k: v for k, v in {**GOOD, **changes}.items() if k not in drop}
    try:
        lab = ImageLabels.from_labels("img", labels)
    except ImageError as e:
        assert "\n" not in str(e) and str(e).startswith("img: ")
        return
    assert ImageLabels.from_labels("img", lab.to_labels()) == lab


@settings(max_examples=500, deadline=None)
@given(text=st.one_of(st.text(max_size=40), st.from_regex(r"[a-z0-9./:@-]{1,40}", fullmatch=True)))
def test_any_text_is_a_reference_or_one_error_line(text):
    try:
        ref = parse_reference(text)
    except ImageError as e:
        assert "\n" not in str(e) and len(str(e)) < 200
        return
    assert not any(c.isspace() for c in text) and ref.name and (ref.digest is None or ref.digest.startswith("sha256:"))


@settings(max_examples=300, deadline=None)
@given(
    user=st.text(alphabet="abcXYZ09_-", min_size=1, max_size=8),
    # no character of the user's alphabet (nor a run of the host's or port's), so a redacted URL
    # can only contain the secret where it leaked, not inside the user name ("cccc" did)
    secret=st.text(alphabet="s3r3tQ!$%", min_size=4, max_size=12),
)
def test_redacted_urls_never_carry_the_password(user, secret):
    from urllib.parse import quote

    url = f"https://{user}:{quote(secret, safe='')}@pypi.example:8443/simple"
    shown = redact_url(url)
    assert quote(secret, safe="") not in shown and shown == f"https://{user}:***@pypi.example:8443/simple"
    token_only = redact_url(f"https://{quote(secret, safe='')}@pypi.example/simple")
    assert token_only == "https://***@pypi.example/simple"
