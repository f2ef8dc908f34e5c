"""The build's two manifest checks against the real Docker engine, on small scratch images:

- ``read_build_outputs``: the precompile stage's ``image.json`` (whose digest and build keys become
  the labels) must describe the ``manifest.json`` beside it;
- ``check_final_manifest``: the final image must carry the manifest its labels were computed from
  (a kernel rebuild between the two build passes would label other files); a mismatch removes
  the tag and fails the build.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import pytest

pytestmark = pytest.mark.docker

KEY = "ab" * 32
TAG = f"monodecode-test/outputs:t{os.getpid()}"


def manifest_text(root, build_key: str = KEY) -> str:
    """The manifest ``ArtifactStore`` writes for one artifact under ``build_key``."""
    from monodecode.services.artifacts import ArtifactStore

    store = ArtifactStore(root)
    store.add(
        build_key=build_key,
        backend="flydsl",
        arch="gfx942",
        dims_digest="cd" * 32,
        widths=(1, 2),
        files={"k1.hsaco": b"\x7fELF k1"},
        compiler={"name": "flydsl", "version": "0.5.0"},
        profile="tiny",
    )
    return store.manifest_path.read_text()


def digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def scratch_image(client, tag: str, files: dict[str, str]) -> str:
    """A ``FROM scratch`` image holding ``files`` (absolute path -> text), built offline."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        lines = ["FROM scratch"]
        for i, (path, text) in enumerate(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"f{i}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            lines.append(f"COPY f{i} {path}")
        dockerfile = ("\n".join(lines) + "\n").encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
    buf.seek(0)
    client.images.build(fileobj=buf, custom_context=True, tag=tag, network_mode="none", rm=True, forcerm=True)
    return tag


@pytest.fixture(scope="module")
def client():
    from monodecode_ops.engine import connect
    from monodecode_ops.labels import ImageError

    try:
        c = connect()
    except ImageError as e:  # make test starts the engine; running pytest alone needs it too
        pytest.fail(str(e), pytrace=False)
    yield c
    for image in c.images.list("monodecode-test/outputs"):
        for tag in image.tags:
            if tag.endswith(f":t{os.getpid()}") or f":t{os.getpid()}-" in tag:
                c.images.remove(tag, force=True)


def _outputs(client, suffix: str, info: dict, manifest: str | None) -> str:
    files = {"/out/image.json": json.dumps(info)}
    if manifest is not None:
        files["/out/artifacts/manifest.json"] = manifest
    return scratch_image(client, f"{TAG}-{suffix}", files)


def test_image_json_matching_its_manifest_is_read(client, tmp_path):
    from monodecode_ops.commands.build import read_build_outputs

    text = manifest_text(tmp_path)
    info = {"backends": ["flydsl"], "build_keys": [KEY], "manifest_digest": digest(text)}
    assert read_build_outputs(client, _outputs(client, "ok", info, text)) == info


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("digest", "does not match its manifest.json"),
        ("keys", "does not match its manifest.json"),
        ("missing", "produced no /out/image.json or /out/artifacts/manifest.json"),
        ("incomplete", "lacks manifest_digest"),
    ],
)
def test_image_json_that_does_not_describe_its_manifest_fails_the_build(client, tmp_path, case, fragment):
    from monodecode_ops.commands.build import read_build_outputs
    from monodecode_ops.labels import ImageError

    text = manifest_text(tmp_path)
    info = {"backends": ["flydsl"], "build_keys": [KEY], "manifest_digest": digest(text)}
    manifest: str | None = text
    if case == "digest":
        info["manifest_digest"] = digest(text + " ")
    elif case == "keys":
        info["build_keys"] = ["ef" * 32]
    elif case == "missing":
        manifest = None
    else:
        del info["manifest_digest"]
    with pytest.raises(ImageError) as err:
        read_build_outputs(client, _outputs(client, case, info, manifest))
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_final_image_with_another_manifest_is_removed_and_fails(client, tmp_path):
    import docker

    from monodecode_ops.commands.build import ArchPlan, check_final_manifest
    from monodecode_ops.labels import DEFAULT_ARTIFACT_DIR, ImageError

    labelled = manifest_text(tmp_path / "labelled")
    rebuilt = manifest_text(tmp_path / "rebuilt", "ef" * 32)  # what a second kernel build would have written

    good = scratch_image(client, f"{TAG}-final-ok", {f"{DEFAULT_ARTIFACT_DIR}/manifest.json": labelled})
    plan = ArchPlan(arch="gfx942", base_image="scratch", tag=good, profiles=["tiny"])
    check_final_manifest(client, plan, good, {"manifest_digest": digest(labelled)})
    client.images.get(good)  # kept

    bad = scratch_image(client, f"{TAG}-final-bad", {f"{DEFAULT_ARTIFACT_DIR}/manifest.json": rebuilt})
    plan = ArchPlan(arch="gfx942", base_image="scratch", tag=bad, profiles=["tiny"])
    with pytest.raises(ImageError) as err:
        check_final_manifest(client, plan, bad, {"manifest_digest": digest(labelled)})
    assert "is not the one its labels were computed from" in str(err.value)
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get(bad)  # a labelled image describing other files is not left behind
