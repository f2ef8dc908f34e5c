"""The label contract of a monodecode image: what ``build`` writes and ``inspect``/``verify`` read.

An image built by ``monodecode-ops build`` carries its facts as labels (readable from a
registry without pulling layers) and as files (``/opt/monodecode/artifacts/manifest.json`` and
``/opt/monodecode/image.json``). ``ImageLabels`` is those facts, validated; ``to_labels()`` and
``from_labels()`` are the one mapping between it and the label dict, so the writer and the
readers cannot drift apart. A malformed label is an ``ImageError`` naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath
from typing import Any

from monodecode.errors import MonodecodeError
from monodecode.services.platform import SUPPORTED_AMD_ARCHS

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
L_BASE_NAME = OCI + "base.name"
L_BASE_DIGEST = OCI + "base.digest"
L_REVISION = OCI + "revision"
L_CREATED = OCI + "created"
L_SOURCE = OCI + "source"

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
    L_VLLM: "vLLM version of the base image (empty: the base has no vLLM)",
    L_TORCH: "torch version of the base image",
    L_BASE_NAME: "the base image reference the build was asked for",
    L_BASE_DIGEST: "the digest the base was pinned to (from the reference or resolved through its registry)",
}

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


class ImageError(MonodecodeError):
    """An image, image reference, label or Docker engine problem: engine unreachable, image
    missing, malformed labels, a failed build or push."""


def _csv(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


@dataclass(frozen=True)
class ImageLabels:
    """The facts an image's labels carry, validated (``from_labels``) and written (``to_labels``)."""

    arch: str
    version: str
    profiles: tuple[str, ...]
    backends: tuple[str, ...]
    build_keys: tuple[str, ...]
    manifest_digest: str
    artifact_dir: str = DEFAULT_ARTIFACT_DIR
    compilers: tuple[str, ...] = ()
    vllm_version: str = ""
    torch_version: str = ""
    base_name: str = ""
    base_digest: str = ""
    revision: str = ""
    created: str = ""
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_labels(self) -> dict[str, str]:
        """Every label of the image (images/README.md says what each means)."""
        labels = {
            OCI + "title": "vllm-monodecode",
            OCI + "description": f"vLLM with monodecode decode megakernels for AMD Instinct {self.arch}",
            OCI + "version": self.version,
            OCI + "licenses": "Apache-2.0",
            OCI + "vendor": "monodecode",
            L_REVISION: self.revision,
            L_CREATED: self.created,
            L_BASE_NAME: self.base_name,
            L_BASE_DIGEST: self.base_digest,
            L_ARCH: self.arch,
            L_VERSION: self.version,
            L_PROFILES: ",".join(self.profiles),
            L_BACKENDS: ",".join(self.backends),
            L_BUILD_KEYS: ",".join(self.build_keys),
            L_MANIFEST_DIGEST: self.manifest_digest,
            L_COMPILERS: ",".join(self.compilers),
            L_ARTIFACT_DIR: self.artifact_dir,
            L_VLLM: self.vllm_version,
            L_TORCH: self.torch_version,
        }
        if self.source:
            labels[L_SOURCE] = self.source
        return labels

    @classmethod
    def from_labels(cls, image: str, labels: Mapping[str, str] | None) -> ImageLabels:
        """Validate an image's labels; ``ImageError`` naming the first bad one."""
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
            if not SHA256_HEX.match(k):
                raise ImageError(
                    f"{image}: label {L_BUILD_KEYS} has {k[:20]!r}, not a 64-digit lowercase sha256 hex key"
                )
        if len(set(keys)) != len(keys):
            raise ImageError(f"{image}: label {L_BUILD_KEYS} lists a build key twice")
        digest = get(L_MANIFEST_DIGEST)
        if not DIGEST.match(digest):
            raise ImageError(f"{image}: label {L_MANIFEST_DIGEST} is {digest[:30]!r}; expected sha256:<64 hex digits>")
        artifact_dir = get(L_ARTIFACT_DIR)
        p = PurePosixPath(artifact_dir)
        if not p.is_absolute() or ".." in p.parts:
            raise ImageError(f"{image}: label {L_ARTIFACT_DIR} is {artifact_dir!r}; expected an absolute path")
        return cls(
            arch=arch,
            version=get(L_VERSION),
            profiles=profiles,
            backends=backends,
            build_keys=keys,
            manifest_digest=digest,
            artifact_dir=artifact_dir,
            compilers=_csv(labels.get(L_COMPILERS, "")),
            vllm_version=labels.get(L_VLLM, "").strip(),
            torch_version=labels.get(L_TORCH, "").strip(),
            base_name=labels.get(L_BASE_NAME, "").strip(),
            base_digest=labels.get(L_BASE_DIGEST, "").strip(),
            revision=labels.get(L_REVISION, "").strip(),
            created=labels.get(L_CREATED, "").strip(),
            source=labels.get(L_SOURCE, "").strip(),
        )
