"""Base images: the default per arch, image-reference syntax, and pinning a base to a digest.

A base is used only pinned: by the digest in its reference (``name:tag@sha256:...``, the tag
then only documents it), by the digest its registry serves for the tag at build time (recorded
in the image's ``org.opencontainers.image.base.digest`` label), or, for an image that exists
only in the local engine (``--local-base``), by its image id. A base that cannot be pinned is
refused, naming why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from monodecode_ops.engine import get_image, registry_digest
from monodecode_ops.labels import ARCHS, ImageError

if TYPE_CHECKING:
    import docker

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]{1,5})?"
_REFERENCE = re.compile(
    rf"(?:(?P<host>{_HOST})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>\w[\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?"
)
_IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Reference:
    """A parsed image reference: ``[host/]path[:tag][@digest]``."""

    text: str
    name: str  # [host/]path
    tag: str | None
    digest: str | None

    @property
    def pinned(self) -> bool:
        return self.digest is not None


def parse_reference(text: str, what: str = "--base-image") -> Reference:
    """``ImageError`` (one line) unless ``text`` is an image reference Docker accepts."""
    m = _REFERENCE.fullmatch(text) if isinstance(text, str) and len(text) <= 512 else None
    if m is None:
        shown = repr(text) if len(repr(text)) <= 80 else repr(text)[:77] + "..."
        raise ImageError(f"{what} {shown} is not an image reference ([registry/]name[:tag][@sha256:<digest>])")
    name = f"{m['host']}/{m['path']}" if m["host"] else m["path"]
    return Reference(text=text, name=name, tag=m["tag"], digest=m["digest"])


@dataclass(frozen=True)
class BaseImage:
    """A default base: the upstream ROCm vLLM release image, which serves gfx942 and gfx950."""

    arch: str
    ref: str  # repository:tag, with @sha256:<digest> where a real digest is on record
    vllm_version: str  # the vLLM the tag carries (checked against the plugin's range by tests)
    note: str

    @property
    def digest(self) -> str | None:
        return parse_reference(self.ref).digest


VLLM_ROCM_REPOSITORY = "vllm/vllm-openai-rocm"
# Digests on public record for that repository. None is invented: v0.31.0's vLLM is below the
# plugin's supported range, so it is not a default; no record of a v0.33.0 digest was found, so
# the default is the tag, resolved to its digest through the registry at build time.
RECORDED_DIGESTS: dict[str, str] = {
    f"{VLLM_ROCM_REPOSITORY}:v0.31.0": "sha256:749f6f3f944f12af49966ac523c1f8573e4b229594b541954bd5f879b4496b1f",
}
DEFAULT_VLLM = "0.33.0"
BASE_IMAGES: dict[str, BaseImage] = {
    arch: BaseImage(
        arch=arch,
        ref=f"{VLLM_ROCM_REPOSITORY}:v{DEFAULT_VLLM}",
        vllm_version=DEFAULT_VLLM,
        note="upstream vLLM ROCm release (built for gfx942 and gfx950); no digest on record: "
        "resolved through the registry at build time",
    )
    for arch in ARCHS
}


@dataclass(frozen=True)
class PinnedBase:
    """What the build uses as ``FROM``, and how it was pinned."""

    ref: str  # as given
    use: str  # what FROM gets: name[:tag]@digest, or a local image id
    digest: str  # recorded in the base.digest label
    how: str  # "reference" | "registry" | "local"


def pin_base(client: docker.DockerClient, ref: str, *, local: bool) -> PinnedBase:
    """Pin ``ref``: its own digest, the registry's digest for its tag, or (``local``) the image id
    of a local image. ``ImageError`` when none applies."""
    r = parse_reference(ref)
    if r.pinned:
        return PinnedBase(ref=ref, use=ref, digest=r.digest, how="reference")
    if local:
        image = get_image(client, ref)
        if not isinstance(image.id, str) or not _IMAGE_ID.fullmatch(image.id):
            raise ImageError(f"local base {ref} has no sha256 image id ({image.id!r})")
        return PinnedBase(ref=ref, use=image.id, digest=image.id, how="local")
    try:
        digest = registry_digest(client, ref)
    except ImageError as e:
        raise ImageError(
            f"base image {ref} has no digest and cannot be pinned: {e} "
            f"(pin it as {r.name}{':' + r.tag if r.tag else ''}@sha256:<digest>, or pass --local-base "
            "for an image built in this engine)"
        ) from None
    return PinnedBase(ref=ref, use=f"{ref}@{digest}", digest=digest, how="registry")
