"""Is a base image's vLLM one the monodecode plugin supports?

The supported range is what the monodecode distribution declares for vLLM (its ``vllm`` extra,
e.g. ``vllm==0.33.0``), read from the installed package's metadata: the same requirement pip
resolves, so the image build, ``verify --image`` and packaging cannot disagree. The image's runtime
stage runs ``python3 -m monodecode_ops.base_vllm``: a base whose vLLM is outside the range fails
the build, naming both versions; a base without vLLM passes with a note (the image then runs
``verify`` and the kernels, not ``serve``).
"""

from __future__ import annotations

import importlib.metadata as md
import sys

try:  # pip vendors packaging; a base image may have only pip's copy
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover - depends on the base image
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.version import InvalidVersion, Version


def supported_vllm() -> str:
    """The version specifier of vLLM the installed monodecode declares (its ``vllm`` extra)."""
    for text in md.requires("monodecode") or []:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name.lower() == "vllm" and req.marker is not None and req.marker.evaluate({"extra": "vllm"}):
            return str(req.specifier)
    raise RuntimeError("the installed monodecode declares no vllm extra (a broken install)")


def vllm_problem(version: str | None) -> str | None:
    """None when ``version`` (a base image's vLLM; None = none) is supported, else one line naming
    both the base's version and the supported range."""
    if not version:
        return None
    spec = supported_vllm()
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"the base image's vLLM version {version!r} is not a version; monodecode supports vllm{spec}"
    # local builds (0.33.0+rocm7.1) are the release they are built from
    if not SpecifierSet(spec).contains(Version(parsed.public), prereleases=True):
        return f"the base image has vLLM {version}; the monodecode plugin supports vllm{spec}"
    return None


def main() -> int:
    try:
        version = md.version("vllm")
    except md.PackageNotFoundError:
        version = None
    problem = vllm_problem(version)
    if problem:
        print(f"base_vllm: {problem} (pick a base with a supported vLLM: images/README.md)", file=sys.stderr)
        return 1
    if version is None:
        print("base_vllm: the base has no vLLM: the image runs verify and the kernels, not serve")
    else:
        print(f"base_vllm: vLLM {version} is in the supported range vllm{supported_vllm()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
