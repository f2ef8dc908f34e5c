"""Is a base image's vLLM one the monodecode plugin supports?

The plugin declares the vLLM releases it supports (``monodecode.vllm_plugin.versions``); this
applies that declaration to an image: the image's runtime stage runs
``python3 -m monodecode_ops.base_vllm``, so a base whose vLLM is outside the range fails the
build, naming both versions; ``verify --image`` applies it to the image's vLLM label. A base
without vLLM passes with a note (the image then runs ``verify`` and the kernels, not ``serve``).
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from monodecode.vllm_plugin.versions import supported_range, version_reason


def supported_vllm() -> str:
    """The supported vLLM releases, for messages (e.g. ``0.32, 0.33``)."""
    return supported_range()


def vllm_problem(version: str | None) -> str | None:
    """None when ``version`` (a base image's vLLM; None or empty = none) is supported, else one
    line naming the base's version and the supported releases."""
    if not version:
        return None
    if version_reason(version) is None:
        return None
    return f"the base image has vLLM {version}; the monodecode plugin supports vLLM {supported_range()}"


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
        print(f"base_vllm: vLLM {version} is one the plugin supports ({supported_range()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
