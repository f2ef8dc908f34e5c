"""Images against the real Docker engine (``make test`` starts it: scripts/services.d/dockerd.sh).

A local stand-in for the ROCm base (images/local-base.sh: Debian bookworm + Python + CPU torch +
the FlyDSL compile toolchain) is built once and kept in the engine as the cache between
sessions. Both arch images are built once per module with the tiny profile through the real
``monodecode-ops build``; every image this module builds is removed at its end (the base stays).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_helpers import ROOT, cli, process_error_line

import monodecode
from monodecode.model.profiles import profile_dims
from monodecode.services.platform import Platform

# The first test's setup makes the base (debootstrap, ~2.5 min) and builds both images (~2-3 min).
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

ARCHS = ("gfx942", "gfx950")
REPO = "monodecode-test/img"
TAG = f"t{os.getpid()}"  # per run: parallel runs on one engine never touch each other's images
BASE_REPO = "monodecode-test/base"
# pip inside the build trusts what the host trusts (a TLS-intercepting egress proxy included).
CA = next(
    (
        p
        for p in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt")
        if p and Path(p).is_file()
    ),
    None,
)
CPU = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)
MI300X = Platform(kind="rocm", arch="gfx942", name="AMD Instinct MI300X", compute_units=304, source="kfd")


def run_container(client, image: str, command: list[str], env: dict | None = None) -> tuple[int, str, str]:
    """Run ``image`` with no network; (exit code, stdout, stderr)."""
    c = client.containers.create(image, command=command, environment=env or {}, network_mode="none")
    try:
        c.start()
        rc = c.wait(timeout=600)["StatusCode"]
        return rc, c.logs(stdout=True, stderr=False).decode(), c.logs(stdout=False, stderr=True).decode()
    finally:
        c.remove(force=True)


def build_on(base: str, tag: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``monodecode-ops build`` of the tiny profile on a local base image (this engine's)."""
    ca = ["--ca-bundle", CA] if CA else []
    common = ["--base-image", base, "--local-base", "-p", "tiny", "--repository", REPO, "--tag", tag, *ca]
    return cli("build", *common, *args, timeout=timeout)


def derived_image(client, tag: str, dockerfile: str) -> str:
    client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, network_mode="none", rm=True, forcerm=True)
    return tag


@pytest.fixture(scope="session")
def docker_client():
    from monodecode_ops.engine import connect
    from monodecode_ops.labels import ImageError

    try:
        return connect()
    except ImageError as e:  # make test starts the engine; running pytest alone needs it too
        pytest.fail(str(e), pytrace=False)


def _base_tag() -> str:
    h = hashlib.sha256((ROOT / "images" / "local-base.sh").read_bytes())
    h.update(os.environ.get("MONODECODE_TORCH_WHEEL", "").encode())
    return f"{BASE_REPO}:{h.hexdigest()[:12]}"


@pytest.fixture(scope="session")
def local_base(docker_client) -> str:
    """The local base image, made once and reused while its recipe is unchanged."""
    import docker

    tag = _base_tag()
    try:
        docker_client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    proc = subprocess.run(
        ["bash", str(ROOT / "images" / "local-base.sh"), tag],
        capture_output=True,
        text=True,
        timeout=1500,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for image in docker_client.images.list(BASE_REPO):  # older recipes are dead weight
        if tag not in image.tags:
            docker_client.images.remove(image.id, force=True)
    return tag


@pytest.fixture(scope="module")
def built(docker_client, local_base, tmp_path_factory):
    """Both arch images, built by the real CLI."""
    proc = build_on(local_base, TAG, "-a", "gfx942", "-a", "gfx950", "--json", timeout=2400)
    log = tmp_path_factory.mktemp("build") / "build.log"
    log.write_text(proc.stderr)
    assert proc.returncode == 0, f"build failed (log {log}): {proc.stderr[-3000:]}"
    return {r["arch"]: r for r in json.loads(proc.stdout)["images"]}


@pytest.fixture(scope="module", autouse=True)
def _remove_what_this_module_builds(docker_client):
    yield
    # the legacy builder's cache images are untagged children: remove those first
    children: dict[str, list[str]] = {}
    for image in docker_client.images.list(all=True):
        children.setdefault(image.attrs.get("Parent") or "", []).append(image.id)

    def remove(image_id: str) -> None:
        import docker

        for child in children.get(image_id, []):
            remove(child)
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.images.remove(image_id, force=True)

    for image in docker_client.images.list(REPO):
        if any(t.startswith(f"{REPO}:{TAG}-") for t in image.tags):
            remove(image.id)
    # stage and cache images of the builds (images in use by a container, e.g. a build running
    # in parallel, are never pruned)
    docker_client.images.prune(filters={"dangling": True})


def tag_of(arch: str) -> str:
    return f"{REPO}:{TAG}-{arch}"


# ---- the build ---------------------------------------------------------------------------------


def test_build_labels_each_arch_image(built, local_base):
    for arch in ARCHS:
        r = built[arch]
        labels, info = r["labels"], r["image_info"]
        assert r["tag"] == tag_of(arch)
        assert labels["io.monodecode.arch"] == arch
        assert labels["io.monodecode.profiles"] == "tiny"
        assert labels["io.monodecode.version"] == monodecode.__version__
        assert labels["org.opencontainers.image.version"] == monodecode.__version__
        assert labels["org.opencontainers.image.base.name"] == local_base
        assert labels["org.opencontainers.image.base.digest"].startswith("sha256:")
        assert labels["io.monodecode.build-keys"].split(",") == info["build_keys"]
        assert labels["io.monodecode.manifest-digest"] == info["manifest_digest"]
        assert labels["io.monodecode.torch-version"].startswith("2.13.0")
        # FlyDSL kernels for the tiny profile were compiled inside the base, for this arch.
        assert labels["io.monodecode.backends"].split(",") == ["flydsl", "reference"]
        assert labels["io.monodecode.compilers"].startswith("flydsl=")
        assert len(info["build_keys"]) == 1
    # the arch is part of every build key
    assert built["gfx942"]["image_info"]["build_keys"] != built["gfx950"]["image_info"]["build_keys"]


def test_image_runs_as_non_root_with_the_entrypoint(docker_client, built):
    cfg = docker_client.images.get(tag_of("gfx942")).attrs["Config"]
    assert cfg["User"] == "10001:10001"
    assert cfg["Entrypoint"] == ["monodecode-entrypoint"]
    assert "MONODECODE_ARTIFACT_DIR=/opt/monodecode/artifacts" in cfg["Env"]


def test_no_wheel_reaches_the_image(docker_client, built):
    """The runtime stage copies the wheels stage's installed root: no wheel file is in the image,
    and wheels.lock records what was added (name and sha256 of each wheel)."""
    script = "find / -xdev -name '*.whl' 2>/dev/null; echo ---; cat /opt/monodecode/wheels.lock"
    rc, out, err = run_container(docker_client, tag_of("gfx942"), ["sh", "-c", script])
    found, lock = out.split("---\n")
    assert rc == 0 and found.strip() == "", (found, err)
    lines = lock.splitlines()
    assert any(line.startswith("wheels/monodecode-") for line in lines), lock
    assert all(" --hash=sha256:" in line for line in lines), lock


@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_json_manifest_matches_labels(built, arch):
    proc = cli("inspect", tag_of(arch), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    labels = doc["labels"]
    assert doc["manifest"]["digest"] == labels["io.monodecode.manifest-digest"]
    arts = doc["manifest"]["artifacts"]
    assert {a["build_key"] for a in arts} == set(labels["io.monodecode.build-keys"].split(","))
    for a in arts:
        assert a["problem"] is None
        assert (a["arch"], a["profile"], a["backend"]) == (arch, "tiny", "flydsl")
        assert a["files"] and all(f["bytes"] > 0 for f in a["files"])
    assert doc["image_info"]["versions"]["monodecode"] == monodecode.__version__


def test_inspect_table(built):
    proc = cli("inspect", tag_of("gfx950"), env={"COLUMNS": "200"})  # one table row per line
    assert proc.returncode == 0, proc.stderr
    for text in ("io.monodecode.build-keys", "io.monodecode.manifest-digest", "gfx950", "sha256 ok", "flydsl"):
        assert text in proc.stdout


# ---- verify ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_inside_the_container_passes_on_cpu(docker_client, built, arch):
    rc, out, err = run_container(docker_client, tag_of(arch), ["verify", "--json"])
    assert rc == 0, out[-3000:] + err[-3000:]
    doc = json.loads(out)
    checks = {c["name"]: c for c in doc["checks"]}
    assert doc["verdict"] == "pass"
    assert checks["baked manifest"]["status"] == "pass"
    assert checks["baked build keys"]["status"] == "pass"
    assert checks["baked artifacts"]["status"] == "pass"
    assert "1 artifact(s)" in checks["baked artifacts"]["detail"]
    assert not [c for c in doc["checks"] if c["status"] == "fail"]


def test_verify_image_from_the_host(built):
    proc = cli("verify", "--image", tag_of("gfx942"), "--no-self-test", "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["image labels"]["status"] == "pass"
    assert checks["image arch"]["status"] == "skip"  # this node has no AMD GPU
    for name in ("image manifest", "image build keys", "image artifacts"):
        assert checks[name]["status"] == "pass", checks[name]


def test_verify_image_against_a_node_and_a_model(docker_client, built):
    from monodecode_ops.image_checks import verify_image

    ok = {c.name: c for c in verify_image(tag_of("gfx942"), MI300X, dims=profile_dims("tiny"), client=docker_client)}
    assert ok["image arch"].status == "pass"
    assert ok["image artifacts for model"].status == "pass" and ok["image artifacts for model"].required
    wrong = {c.name: c for c in verify_image(tag_of("gfx950"), MI300X, client=docker_client)}
    assert wrong["image arch"].status == "fail"
    assert "built for gfx950" in wrong["image arch"].detail and "gfx942" in wrong["image arch"].detail
    other = {
        c.name: c for c in verify_image(tag_of("gfx942"), MI300X, dims=profile_dims("llama3-8b"), client=docker_client)
    }
    assert other["image artifacts for model"].status == "fail"
    assert "profiles tiny" in other["image artifacts for model"].detail


def test_tampered_artifact_fails_verify_with_the_checksum_reason(docker_client, built):
    from monodecode_ops.image_checks import verify_image

    tampered = derived_image(
        docker_client,
        f"{REPO}:{TAG}-tampered",
        f"""FROM {tag_of("gfx942")}
USER root
RUN python3 -c "import pathlib; f = sorted(p for p in pathlib.Path('/opt/monodecode/artifacts').rglob('*') \
if p.is_file() and p.name != 'manifest.json')[0]; b = bytearray(f.read_bytes()); b[len(b) // 2] ^= 0xFF; \
f.write_bytes(bytes(b)); print('flipped a byte of', f)"
USER 10001:10001
""",
    )
    # inside the container: verify fails, naming the checksum mismatch
    rc, out, err = run_container(docker_client, tampered, ["verify", "--json"])
    assert rc == 1, out[-2000:] + err[-2000:]
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["baked artifacts"]["status"] == "fail"
    assert "checksum mismatch" in checks["baked artifacts"]["detail"]
    assert checks["baked manifest"]["status"] == "pass"  # only the artifact file changed
    # from the host: verify --image says the same
    host = {c.name: c for c in verify_image(tampered, CPU, client=docker_client)}
    assert host["image artifacts"].status == "fail" and "checksum mismatch" in host["image artifacts"].detail
    proc = cli("verify", "--image", tampered, "--no-self-test", env={"COLUMNS": "300"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "checksum mismatch" in proc.stdout and "verdict: FAIL" in proc.stdout


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "label,value,expected",
    [
        ("io.monodecode.manifest-digest", "sha256:not-a-digest", "expected sha256:<64 hex digits>"),
        ("io.monodecode.arch", "gfx90a", "expected one of gfx942, gfx950"),
        ("io.monodecode.build-keys", "abc123", "not a 64-digit lowercase sha256 hex key"),
    ],
)
def test_bad_image_labels_are_one_error_line(docker_client, built, label, value, expected):
    bad = derived_image(
        docker_client, f"{REPO}:{TAG}-bad-{label.split('.')[-1]}", f'FROM {tag_of("gfx942")}\nLABEL {label}="{value}"\n'
    )
    for args in (("inspect", bad), ("verify", "--image", bad, "--no-self-test")):
        line = process_error_line(cli(*args))
        assert label in line and expected in line, line


def test_inspect_of_a_non_monodecode_image(local_base):
    assert "not a monodecode image" in process_error_line(cli("inspect", local_base))


def test_serve_entrypoint_in_the_image(docker_client, built):
    model = "/opt/monodecode/cache/models/tiny-gemma3"
    env = {"MONODECODE_MODEL": model, "MONODECODE_WIDTHS": "1,2", "MONODECODE_ENTRYPOINT_PRINT": "1"}
    rc, out, err = run_container(docker_client, tag_of("gfx942"), [], env=env)
    assert rc == 0, err
    printed = json.loads(out)
    cmd = printed["argv"]
    assert cmd[:3] == ["vllm", "serve", model] and cmd[3] == "--additional-config"
    assert json.loads(cmd[4])["monodecode"] == {
        "enabled": True,
        "widths": [1, 2],
        "artifact_dir": "/opt/monodecode/artifacts",
    }
    # the local base's torch is a CPU build: the platform the entrypoint detects is cpu
    from monodecode.vllm_plugin.serving import serve_settings

    assert printed["env"] == serve_settings("cpu").env and cmd[5:] == list(serve_settings("cpu").args)
    # the base has no vLLM: serving is one clear error line, exit 2
    rc, out, err = run_container(docker_client, tag_of("gfx942"), ["serve", model])
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: vllm: command not found"), err
    # a bad option is refused by the runtime's own validation before vLLM would start
    rc, out, err = run_container(docker_client, tag_of("gfx942"), ["serve", model], env={"MONODECODE_BACKEND": "cuda"})
    assert rc == 2 and "backend" in err and "must be one of" in err, err


@pytest.fixture
def registry(tmp_path):
    """A real registry (Debian's docker-registry) on 127.0.0.1, for the duration of one test."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "registry.yml"
    cfg.write_text(
        f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    log = open(tmp_path / "registry.log", "w")
    proc = subprocess.Popen(["docker-registry", "serve", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/v2/", timeout=2).read()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "registry.log").read_text()
            time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=20)
    log.close()


def test_push_to_a_registry(docker_client, built, local_base, registry):
    import urllib.request

    args = [
        "build",
        "-a",
        "gfx942",
        "--base-image",
        local_base,
        "--local-base",
        "-p",
        "tiny",
        "--registry",
        f"{registry}/monodecode-test",
        "--tag",
        f"{TAG}-pushed",
        "--push",
        "--json",
    ]
    proc = cli(*args, *(["--ca-bundle", CA] if CA else []), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = json.loads(proc.stdout)["images"]
    try:
        pushed = f"{TAG}-pushed-gfx942"
        assert r["pushed"] and r["tag"] == f"{registry}/monodecode-test/vllm-monodecode:{pushed}"
        base = f"http://{registry}/v2/monodecode-test/vllm-monodecode"
        tags = json.loads(urllib.request.urlopen(f"{base}/tags/list", timeout=10).read())["tags"]
        assert tags == [pushed]
        req = urllib.request.Request(
            f"{base}/manifests/{pushed}", headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"}
        )
        manifest = json.loads(urllib.request.urlopen(req, timeout=10).read())
        assert manifest["config"]["digest"] == r["id"]  # the registry holds exactly the built image
    finally:
        docker_client.images.remove(r["tag"], force=True)


def test_digest_pinned_base_is_pulled_and_used(docker_client, registry):
    """How the default bases are referenced (repository:tag@sha256:...): pulled by digest, then
    usable as FROM, shown with a small image through the local registry."""
    from monodecode_ops.commands.build import ensure_base

    name = f"{registry}/monodecode-test/pinned-base"
    docker_client.images.build(
        fileobj=io.BytesIO(b"FROM scratch\nLABEL purpose=pinned-base\n"), tag=f"{name}:v1", rm=True
    )
    docker_client.images.push(name, tag="v1")
    digest = docker_client.images.get(f"{name}:v1").attrs["RepoDigests"][0].split("@")[1]
    docker_client.images.remove(f"{name}:v1", force=True)
    pinned = f"{name}:v1@{digest}"
    try:
        ensure_base(docker_client, pinned, pull=True)
        assert docker_client.images.get(f"{name}@{digest}").labels == {"purpose": "pinned-base"}
        child = derived_image(docker_client, f"{REPO}:{TAG}-from-pinned", f"FROM {pinned}\nLABEL child=1\n")
        assert docker_client.images.get(child).labels == {"purpose": "pinned-base", "child": "1"}
    finally:
        docker_client.images.remove(f"{name}@{digest}", force=True)


def test_failing_build_step_is_one_line_with_its_output(local_base):
    # an unreachable package index (loopback, refused): the wheels stage fails inside pip
    proc = build_on(
        local_base, f"{TAG}-broken", "-a", "gfx942", "--pip-index-url", "http://127.0.0.1:9/simple", timeout=900
    )
    line = process_error_line(proc)
    assert line.startswith("error: build for gfx942 failed at step "), line
    assert "resolve-wheels.sh" in line and "returned a non-zero code" in line and "last output:" in line, line


def test_verify_image_fails_on_a_vllm_outside_the_plugins_range(docker_client, built):
    from monodecode_ops.base_vllm import supported_vllm
    from monodecode_ops.image_checks import verify_image

    old = derived_image(
        docker_client, f"{REPO}:{TAG}-old-vllm", f'FROM {tag_of("gfx942")}\nLABEL io.monodecode.vllm-version="0.31.0"\n'
    )
    checks = {c.name: c for c in verify_image(old, CPU, client=docker_client)}
    assert checks["image vLLM"].status == "fail" and checks["image vLLM"].required
    assert "0.31.0" in checks["image vLLM"].detail and supported_vllm() in checks["image vLLM"].detail
    proc = cli("verify", "--image", old, "--no-self-test", "--json")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    # the local base has no vLLM: reported, not a failure
    ok = {c.name: c for c in verify_image(tag_of("gfx942"), CPU, client=docker_client)}
    assert ok["image vLLM"].status == "skip"


def test_build_fails_on_a_base_with_an_unsupported_vllm(docker_client, local_base):
    """The runtime stage refuses a base whose vLLM (here a metadata-only 0.31.0 distribution,
    what importlib.metadata reads) is outside the plugin's range, naming both versions."""
    from monodecode_ops.base_vllm import supported_vllm

    old_base = derived_image(
        docker_client,
        f"{REPO}:{TAG}-base-vllm031",
        f"""FROM {local_base}
RUN d=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/vllm-0.31.0.dist-info && \\
mkdir -p "$d" && printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: 0.31.0\\n' > "$d/METADATA"
""",
    )
    proc = build_on(old_base, f"{TAG}-vllm031", "-a", "gfx942", timeout=1500)
    line = process_error_line(proc)
    assert "install-runtime.sh" in line, line
    assert f"the base image has vLLM 0.31.0; the monodecode plugin supports vLLM {supported_vllm()}" in line, line


def test_unpinned_base_is_pinned_through_its_registry(docker_client, registry):
    """A tag without a digest: the plan asks the registry (through the engine) for the digest it
    serves, and the build uses and records exactly that."""
    name = f"{registry}/monodecode-test/tag-only-base"
    docker_client.images.build(fileobj=io.BytesIO(b"FROM scratch\nLABEL purpose=tag-only\n"), tag=f"{name}:v2", rm=True)
    docker_client.images.push(name, tag="v2")
    digest = docker_client.images.get(f"{name}:v2").attrs["RepoDigests"][0].split("@")[1]
    try:
        proc = cli("build", "--dry-run", "--json", "-a", "gfx950", "-p", "tiny", "--base-image", f"{name}:v2")
        assert proc.returncode == 0, proc.stderr
        (arch,) = json.loads(proc.stdout)["plan"]["archs"]
        assert arch["base"] == {"ref": f"{name}:v2", "use": f"{name}:v2@{digest}", "digest": digest, "how": "registry"}
        assert arch["build_args"]["BASE_IMAGE"] == f"{name}:v2@{digest}"
        line = process_error_line(
            cli("build", "--dry-run", "-a", "gfx950", "-p", "tiny", "--base-image", f"{name}:nope")
        )
        assert f"base image {name}:nope has no digest and cannot be pinned" in line, line
    finally:
        docker_client.images.remove(f"{name}:v2", force=True)
