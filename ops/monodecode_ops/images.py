"""Docker helpers for monodecode images: the engine connection, image labels, files baked into
an image, and ``verify_image`` (does this image fit this node?).

An image built by ``monodecode-ops build`` carries its facts twice: as labels (readable from a
registry without pulling layers) and as files (``/opt/monodecode/artifacts/manifest.json`` and
``/opt/monodecode/image.json``). Verification checks that the two agree and that every baked
file still has the checksum the manifest records. Files are read through a created, never
started container, so nothing in the image runs on the host.

Every problem a user can cause (engine unreachable, image missing, labels malformed) is an
``ImageError`` with one line naming it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tarfile
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from monodecode.errors import ArtifactError, MonodecodeError
from monodecode.services.artifacts import MANIFEST, ArtifactStore, parse_manifest
from monodecode.services.platform import SUPPORTED_AMD_ARCHS, Platform
from monodecode_ops.output import Check

if TYPE_CHECKING:  # the Docker SDK is imported only when an engine is actually used
    import docker

    from monodecode.model.dims import ModelDims

ARCHS: tuple[str, ...] = tuple(SUPPORTED_AMD_ARCHS)

# Where the Dockerfile puts things (images/Dockerfile, images/build/precompile.sh).
IMAGE_ROOT = "/opt/monodecode"
IMAGE_INFO_PATH = f"{IMAGE_ROOT}/image.json"
DEFAULT_ARTIFACT_DIR = f"{IMAGE_ROOT}/artifacts"

OCI = "org.opencontainers.image."
PREFIX = "io.monodecode."
L_ARCH = PREFIX + "arch"
L_VERSION = PREFIX + "version"
L_PROFILES = PREFIX + "profiles"
L_BACKENDS = PREFIX + "backends"
L_BUILD_KEYS = PREFIX + "build-keys"
L_MANIFEST_DIGEST = PREFIX + "manifest-digest"
L_COMPILERS = PREFIX + "compilers"
L_ARTIFACT_DIR = PREFIX + "artifact-dir"
L_VLLM = PREFIX + "vllm-version"
L_TORCH = PREFIX + "torch-version"

# What each label means (README "Container images" and `inspect` show this).
LABEL_DOCS: dict[str, str] = {
    L_ARCH: "GPU arch the kernels were compiled for (gfx942 = MI300X/MI325X, gfx950 = MI350X/MI355X)",
    L_VERSION: "monodecode version installed in the image",
    L_PROFILES: "model profiles whose kernels were precompiled",
    L_BACKENDS: "kernel backends usable without compiling (reference needs no artifacts)",
    L_BUILD_KEYS: "build keys of the baked artifacts (sha256 over everything a kernel depends on)",
    L_MANIFEST_DIGEST: "sha256 of the baked manifest.json (artifact-dir/manifest.json)",
    L_COMPILERS: "kernel compilers and versions that produced the artifacts",
    L_ARTIFACT_DIR: "where the artifacts and manifest live inside the image",
    L_VLLM: "vLLM version of the base image",
    L_TORCH: "torch version of the base image",
}

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


class ImageError(MonodecodeError):
    """Engine unreachable, image missing, malformed labels, a failed build or push."""


# ---------------------------------------------------------------------------------------------
# Base images per arch


@dataclass(frozen=True)
class BaseImage:
    arch: str
    ref: str  # repository:tag@sha256:<digest> (the digest is what is pulled; the tag documents it)
    family: str  # the arch family AMD's image is built for
    note: str  # where the digest was recorded

    @property
    def digest(self) -> str | None:
        return self.ref.split("@", 1)[1] if "@" in self.ref else None


# Upstream ROCm vLLM images, pinned by digest. AMD tags its newest images per arch family
# (gfx94X-dcgpu, gfx950-dcgpu) and changes the tag scheme between ROCm trains, so only a digest
# is a stable reference. Re-pin with `docker buildx imagetools inspect <tag>` (images/README.md).
BASE_IMAGES: dict[str, BaseImage] = {
    "gfx942": BaseImage(
        arch="gfx942",
        ref="rocm/vllm:rocm7.12.0_gfx94X-dcgpu_ubuntu24.04_py3.12_pytorch_2.9.1_vllm_0.16.0"
        "@sha256:997f858b973cb4e9566653a180c79bc27170bd87585a6930f9257346869a28f7",
        family="gfx94X-dcgpu",
        note="AMD's gfx94X-dcgpu image of the ROCm 7.12 train; digest as recorded on 2026-05-11",
    ),
    "gfx950": BaseImage(
        arch="gfx950",
        ref="rocm/vllm:rocm7.0.0_vllm_0.11.2_20251210"
        "@sha256:e7f02dd2ce3824959658bc0391296f6158638e3ebce164f6c019c4eca8150ec7",
        family="cdna (gfx942 + gfx950)",
        note="AMD's CDNA release image (built for gfx942 and gfx950); digest from AMD's ROCm docs",
    ),
}


# ---------------------------------------------------------------------------------------------
# Labels


@dataclass(frozen=True)
class ImageLabels:
    """The ``io.monodecode.*`` labels of an image, validated."""

    arch: str
    version: str
    profiles: tuple[str, ...]
    backends: tuple[str, ...]
    build_keys: tuple[str, ...]
    manifest_digest: str
    artifact_dir: str
    compilers: tuple[str, ...] = ()
    vllm_version: str = ""
    torch_version: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def parse_labels(image: str, labels: Mapping[str, str] | None) -> ImageLabels:
    """Validate an image's monodecode labels; ``ImageError`` naming the first bad one."""
    labels = dict(labels or {})
    if not any(k.startswith(PREFIX) for k in labels):
        raise ImageError(f"{image}: not a monodecode image (it has no {PREFIX}* labels)")

    def get(key: str, required: bool = True) -> str:
        value = labels.get(key)
        if value is None or (required and not value.strip()):
            raise ImageError(
                f"{image}: label {key} is missing or empty (was the image built with monodecode-ops build?)"
            )
        return value.strip()

    arch = get(L_ARCH)
    if arch not in ARCHS:
        raise ImageError(f"{image}: label {L_ARCH} is {arch!r}; expected one of {', '.join(ARCHS)}")
    version = get(L_VERSION)
    profiles = _csv(get(L_PROFILES))
    for p in profiles:
        if not _NAME.match(p):
            raise ImageError(f"{image}: label {L_PROFILES} has a malformed profile name {p!r}")
    backends = _csv(get(L_BACKENDS))
    for b in backends:
        if not _NAME.match(b):
            raise ImageError(f"{image}: label {L_BACKENDS} has a malformed backend name {b!r}")
    keys = _csv(get(L_BUILD_KEYS, required=False))
    for k in keys:
        if not _SHA256.match(k):
            raise ImageError(f"{image}: label {L_BUILD_KEYS} has {k[:20]!r}, not a 64-digit lowercase sha256 hex key")
    if len(set(keys)) != len(keys):
        raise ImageError(f"{image}: label {L_BUILD_KEYS} lists a build key twice")
    digest = get(L_MANIFEST_DIGEST)
    if not _DIGEST.match(digest):
        raise ImageError(f"{image}: label {L_MANIFEST_DIGEST} is {digest[:30]!r}; expected sha256:<64 hex digits>")
    artifact_dir = get(L_ARTIFACT_DIR)
    p = PurePosixPath(artifact_dir)
    if not p.is_absolute() or ".." in p.parts:
        raise ImageError(f"{image}: label {L_ARTIFACT_DIR} is {artifact_dir!r}; expected an absolute path")
    return ImageLabels(
        arch=arch,
        version=version,
        profiles=profiles,
        backends=backends,
        build_keys=keys,
        manifest_digest=digest,
        artifact_dir=artifact_dir,
        compilers=_csv(labels.get(L_COMPILERS, "")),
        vllm_version=labels.get(L_VLLM, "").strip(),
        torch_version=labels.get(L_TORCH, "").strip(),
    )


# ---------------------------------------------------------------------------------------------
# Engine


def _reason(e: BaseException) -> str:
    """One line from a Docker SDK / requests exception (they nest and span lines)."""
    text = getattr(e, "explanation", None) or str(e) or type(e).__name__
    text = " ".join(str(text).split())
    return text[:300]


def docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def connect(timeout: int | None = 120) -> docker.DockerClient:
    """A client for the engine in ``DOCKER_HOST`` (default the local socket), checked with a ping."""
    try:
        import docker
    except ImportError:
        raise ImageError("the Docker SDK is not installed (pip install 'monodecode[ops]')") from None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except Exception as e:  # DockerException, requests errors, OSError: all mean "not reachable"
        raise ImageError(
            f"cannot reach the Docker engine at {docker_host()}: {_reason(e)} "
            "(is dockerd running? scripts/services.d/dockerd.sh start)"
        ) from None
    return client


def get_image(client: docker.DockerClient, ref: str):
    import docker

    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        raise ImageError(f"image {ref} is not in the Docker engine (docker pull {ref}, or build it)") from None
    except docker.errors.APIError as e:
        raise ImageError(f"cannot look up image {ref}: {_reason(e)}") from None


def pull_ref(ref: str) -> str:
    """What to pull for ``ref``: ``name@digest`` when pinned (the tag then only documents it)."""
    if "@" in ref:
        name, digest = ref.split("@", 1)
        last = name.rsplit("/", 1)[-1]
        if ":" in last:  # drop the tag, keep a registry port
            name = name[: len(name) - len(last)] + last.split(":", 1)[0]
        return f"{name}@{digest}"
    return ref


def _safe_members(tar: tarfile.TarFile, dest: Path) -> list[tarfile.TarInfo]:
    out = []
    for m in tar.getmembers():
        target = (dest / m.name).resolve()
        if not str(target).startswith(str(dest.resolve())) or m.issym() or m.islnk() or m.isdev():
            continue  # nothing from an image may land outside dest or link anywhere
        out.append(m)
    return out


@contextlib.contextmanager
def image_files(client: docker.DockerClient, image: str, paths: Sequence[str]) -> Iterator[Path]:
    """Copy ``paths`` (files or directories) out of ``image`` into a temporary directory.

    ``<tmp>/<basename(path)>`` exists for every path the image has; missing ones are absent.
    The container is created, never started, and always removed.
    """
    import docker

    try:
        container = client.containers.create(
            image,
            entrypoint=["/monodecode-never-started"],
            command=[],
            network_disabled=True,
            labels={PREFIX + "purpose": "read-files"},
        )
    except docker.errors.APIError as e:
        raise ImageError(f"cannot open image {image} to read its files: {_reason(e)}") from None
    try:
        with tempfile.TemporaryDirectory(prefix="monodecode-image-") as tmp:
            dest = Path(tmp)
            for path in paths:
                try:
                    chunks, _stat = container.get_archive(path)
                except docker.errors.NotFound:
                    continue
                with tempfile.TemporaryFile() as buf:
                    for chunk in chunks:
                        buf.write(chunk)
                    buf.seek(0)
                    with tarfile.open(fileobj=buf) as tar:
                        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                        tar.extractall(dest, members=_safe_members(tar, dest), **extra)
            yield dest
    finally:
        with contextlib.suppress(Exception):
            container.remove(force=True, v=True)


# ---------------------------------------------------------------------------------------------
# What an image holds


@dataclass
class ImageContents:
    """Labels plus the baked files of one image (read once, checked by verify and shown by inspect)."""

    image: str
    image_id: str
    created: str
    size_bytes: int
    labels: ImageLabels
    all_labels: dict[str, str]
    manifest_text: str | None  # None when the image lacks artifact-dir/manifest.json
    image_info: dict[str, Any] | None
    artifact_problems: list[tuple[str, str | None]] = field(default_factory=list)  # (build key, problem)
    manifest_error: str | None = None
    entries: list[Any] = field(default_factory=list)

    @property
    def manifest_digest(self) -> str | None:
        if self.manifest_text is None:
            return None
        return "sha256:" + hashlib.sha256(self.manifest_text.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "id": self.image_id,
            "created": self.created,
            "size_bytes": self.size_bytes,
            "labels": self.all_labels,
            "monodecode": self.labels.to_dict(),
            "image_info": self.image_info,
            "manifest": {
                "path": f"{self.labels.artifact_dir}/{MANIFEST}",
                "digest": self.manifest_digest,
                "error": self.manifest_error,
                "artifacts": [
                    {**e.to_dict(), "problem": dict(self.artifact_problems).get(e.build_key)} for e in self.entries
                ],
            },
        }


def read_image(image: str, client: docker.DockerClient | None = None) -> ImageContents:
    """Labels (validated; ``ImageError`` if bad) and baked files of ``image``, checksums verified."""
    client = client or connect()
    img = get_image(client, image)
    labels = parse_labels(image, img.labels)
    contents = ImageContents(
        image=image,
        image_id=img.id,
        created=img.attrs.get("Created", ""),
        size_bytes=int(img.attrs.get("Size", 0) or 0),
        labels=labels,
        all_labels=dict(img.labels or {}),
        manifest_text=None,
        image_info=None,
    )
    art_name = PurePosixPath(labels.artifact_dir).name
    with image_files(client, image, [labels.artifact_dir, IMAGE_INFO_PATH]) as tmp:
        info = tmp / PurePosixPath(IMAGE_INFO_PATH).name
        if info.is_file():
            try:
                contents.image_info = json.loads(info.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                contents.image_info = {"error": f"{IMAGE_INFO_PATH} is not valid JSON"}
        store = ArtifactStore(tmp / art_name)
        if store.manifest_path.is_file():
            try:
                contents.manifest_text = store.manifest_path.read_bytes().decode()  # no newline translation
                contents.entries = parse_manifest(contents.manifest_text, f"{labels.artifact_dir}/{MANIFEST}")
            except (ArtifactError, UnicodeDecodeError) as e:
                contents.manifest_error = str(e) if isinstance(e, ArtifactError) else f"{MANIFEST} is not UTF-8"
            else:
                contents.artifact_problems = [(e.build_key, p) for e, p in store.verify_all()]
    return contents


# ---------------------------------------------------------------------------------------------
# verify --image


def _arch_check(labels: ImageLabels, platform: Platform) -> Check:
    name = "image arch"
    if platform.kind != "rocm":
        return Check.skipped(
            name,
            f"no AMD GPU on this node ({platform.kind}: {platform.name}); the image is for {labels.arch}",
            data={"image_arch": labels.arch, "node_arch": platform.arch},
        )
    if platform.arch not in ARCHS:
        return Check.failure(
            name,
            f"node GPU arch {platform.arch} is not one monodecode builds for ({', '.join(ARCHS)})",
            data={"image_arch": labels.arch, "node_arch": platform.arch},
        )
    if platform.arch != labels.arch:
        return Check.failure(
            name,
            f"image is built for {labels.arch}, this node's GPU is {platform.arch} ({platform.name}); "
            f"use the {platform.arch} image",
            data={"image_arch": labels.arch, "node_arch": platform.arch},
        )
    return Check.passed(
        name,
        f"{labels.arch} matches the node's GPU ({platform.name})",
        data={"image_arch": labels.arch, "node_arch": platform.arch},
    )


def _manifest_checks(c: ImageContents, prefix: str = "image", facts: str = "labels") -> list[Check]:
    """Manifest vs the recorded digest and build keys (``facts``: the labels, or image.json),
    then every artifact's files."""
    lab = c.labels
    digest_src = f"label {L_MANIFEST_DIGEST}" if facts == "labels" else f"{facts} manifest_digest"
    keys_src = f"label {L_BUILD_KEYS}" if facts == "labels" else f"{facts} build_keys"
    where = f"{lab.artifact_dir}/{MANIFEST}"
    if c.manifest_text is None:
        return [Check.failure(f"{prefix} manifest", f"{where} is missing from the image")]
    checks = []
    if c.manifest_digest != lab.manifest_digest:
        checks.append(
            Check.failure(
                f"{prefix} manifest",
                f"{where} has digest {c.manifest_digest[:19]}..., {digest_src} says {lab.manifest_digest[:19]}... "
                "(the manifest was changed after the build)",
                data={"actual": c.manifest_digest, "label": lab.manifest_digest},
            )
        )
    elif c.manifest_error:
        checks.append(Check.failure(f"{prefix} manifest", c.manifest_error))
    else:
        checks.append(
            Check.passed(
                f"{prefix} manifest",
                f"{where} matches {digest_src} ({lab.manifest_digest[:19]}...)",
                data={"digest": lab.manifest_digest},
            )
        )
    if c.manifest_error:
        return checks
    keys = {e.build_key for e in c.entries}
    if keys != set(lab.build_keys):
        only_m = sorted(k[:12] for k in keys - set(lab.build_keys))
        only_l = sorted(k[:12] for k in set(lab.build_keys) - keys)
        checks.append(
            Check.failure(
                f"{prefix} build keys",
                f"{keys_src} and the manifest disagree (only in the manifest: {', '.join(only_m) or '-'}; "
                f"only in {keys_src}: {', '.join(only_l) or '-'})",
            )
        )
    else:
        checks.append(Check.passed(f"{prefix} build keys", f"{len(keys)} build key(s) agree with the manifest"))
    problems = [(k, p) for k, p in c.artifact_problems if p]
    wrong_arch = [e for e in c.entries if e.arch != lab.arch]
    nfiles = sum(len(e.files) for e in c.entries)
    if problems:
        checks.append(
            Check.failure(
                f"{prefix} artifacts",
                f"{len(problems)} of {len(c.entries)} artifact(s) failed verification: {problems[0][1]}",
                data={"problems": [p for _, p in problems]},
            )
        )
    elif wrong_arch:
        checks.append(
            Check.failure(
                f"{prefix} artifacts",
                f"artifact {wrong_arch[0].build_key[:12]} is compiled for {wrong_arch[0].arch}, the image is labelled {lab.arch}",
            )
        )
    elif not c.entries:
        checks.append(
            Check.passed(
                f"{prefix} artifacts", f"no ahead-of-time artifacts baked (backends: {', '.join(lab.backends)})"
            )
        )
    else:
        checks.append(
            Check.passed(
                f"{prefix} artifacts",
                f"{len(c.entries)} artifact(s), {nfiles} file(s): sizes and sha256 verified",
                data={"artifacts": len(c.entries), "files": nfiles},
            )
        )
    return checks


def _model_check(c: ImageContents, platform: Platform, dims: ModelDims | None) -> Check:
    name = "image artifacts for model"
    # A missing kernel only matters where the image would run its AOT kernels.
    required = platform.kind == "rocm"
    if dims is None:
        return Check.skipped(
            name, f"no model given; the image bakes profiles {', '.join(c.labels.profiles)}", required=False
        )
    if c.manifest_error or c.manifest_text is None:
        return Check.failure(name, "the image's manifest is unreadable (see image manifest)", required=required)
    digest = dims.digest()
    hits = [e for e in c.entries if e.dims_digest == digest and e.arch == c.labels.arch]
    if hits:
        e = hits[0]
        return Check.passed(
            name,
            f"{', '.join(sorted({h.backend for h in hits}))} artifact(s) for this model "
            f"(profile {e.profile or '-'}, widths {list(e.widths)})",
            data={"build_keys": [h.build_key for h in hits]},
            required=required,
        )
    if not c.entries:
        return Check.skipped(
            name,
            f"the image bakes no ahead-of-time artifacts (backends: {', '.join(c.labels.backends)})",
            required=False,
        )
    return Check.failure(
        name,
        f"no artifact for this model's dims (digest {digest[:12]}) on {c.labels.arch}; "
        f"the image bakes profiles {', '.join(c.labels.profiles)}",
        required=required,
    )


def verify_image(
    image: str,
    platform: Platform,
    *,
    dims: ModelDims | None = None,
    client: docker.DockerClient | None = None,
) -> list[Check]:
    """Checks that ``image`` fits ``platform`` (and the model ``dims`` when given).

    Raises ``ImageError`` when the engine is unreachable, the image is missing or its labels are
    malformed; everything else (arch mismatch, tampered manifest or artifact, no artifact for
    the model) is a failed check.
    """
    c = read_image(image, client)
    lab = c.labels
    checks = [
        Check.passed(
            "image labels",
            f"{image}: monodecode {lab.version} for {lab.arch}, backends {', '.join(lab.backends)}, "
            f"profiles {', '.join(lab.profiles)}",
            data={"image": image, "id": c.image_id, **lab.to_dict()},
        )
    ]
    checks.append(_arch_check(lab, platform))
    checks.extend(_manifest_checks(c))
    checks.append(_model_check(c, platform, dims))
    return checks


# ---------------------------------------------------------------------------------------------
# verify inside an image


def baked_checks(info_path: str | Path | None = None) -> list[Check]:
    """Checks of the image ``verify`` runs in: its baked manifest against ``image.json`` (written
    at build time, the same facts as the labels) and every artifact's size and sha256.

    Returns [] outside a monodecode image (no ``$MONODECODE_IMAGE_INFO`` / ``image.json``).
    """
    path = Path(info_path or os.environ.get("MONODECODE_IMAGE_INFO") or IMAGE_INFO_PATH)
    if not path.is_file():
        return []
    try:
        info = json.loads(path.read_text())
        art_dir = os.environ.get("MONODECODE_ARTIFACT_DIR") or DEFAULT_ARTIFACT_DIR
        labels = ImageLabels(
            arch=info["arch"],
            version=str(info["versions"]["monodecode"]),
            profiles=tuple(info["profiles"]),
            backends=tuple(info["backends"]),
            build_keys=tuple(info["build_keys"]),
            manifest_digest=info["manifest_digest"],
            artifact_dir=art_dir,
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [Check.failure("baked manifest", f"{path} is unreadable or incomplete ({type(e).__name__}: {e})")]
    c = ImageContents(
        image="this image",
        image_id="",
        created="",
        size_bytes=0,
        labels=labels,
        all_labels={},
        manifest_text=None,
        image_info=info,
    )
    store = ArtifactStore(art_dir)
    if store.manifest_path.is_file():
        try:
            c.manifest_text = store.manifest_path.read_bytes().decode()
            c.entries = parse_manifest(c.manifest_text, str(store.manifest_path))
        except (ArtifactError, UnicodeDecodeError, OSError) as e:
            c.manifest_error = str(e)
        else:
            c.artifact_problems = [(e.build_key, p) for e, p in store.verify_all()]
    return _manifest_checks(c, prefix="baked", facts=str(path))
