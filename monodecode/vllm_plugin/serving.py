"""The one attention backend + KV cache layout pair mono decode supports on each platform.

vLLM resolves one KV cache layout per engine (``vllm/v1/attention/backends/utils.py``:
``resolve_kv_cache_layout``) from the layouts every attention backend in use declares
(``AttentionBackend.supported_kv_cache_layouts``; None = any, then vLLM prefers LBNHC), and the
engine core refuses to start when ``VLLM_KV_CACHE_LAYOUT`` names a layout outside that set. The
kernels read K and V of vLLM's per-layer logical ``[blocks, kv_heads, block_size, K|V]`` cache
through strides (GPU) or through the CPU backend's own block-interior packing (CPU), so the pair
is chosen per platform from vLLM 0.33's backend classes:

- rocm: ``TRITON_ATTN`` (declares no layout: any works) with ``LBNHC``. ``ROCM_ATTN`` (ROCm's
  default) packs K and V into two head slots with an x-packed K (``customize_spec``), and the
  AITER backends need ``VLLM_ROCM_USE_AITER=1``, which also preshuffles FP8 weights: neither is
  readable as vLLM's K|V layout, and none of the three accepts LBNHC;
- cuda: ``FLASH_ATTN`` (declares no layout) with ``LBNHC``, vLLM's own default there;
- cpu: ``CPU_ATTN`` (the only one) with ``LBHNC``, the only layout it declares.

``serve_settings(platform)`` gives the ``vllm serve`` arguments and environment that select the
pair (the image entrypoint and the Helm chart set exactly these); the plugin refuses any other
pair at KV-cache binding with a reason naming the backend and the layout. Pure: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

from monodecode.errors import ConfigError


@dataclass(frozen=True)
class ServeSettings:
    """What selects the supported pair on one platform."""

    platform: str
    attention_backend: str  # vLLM's AttentionBackendEnum name (``--attention-backend``)
    kv_cache_layout: str  # vLLM's KVCacheLayout name (``VLLM_KV_CACHE_LAYOUT``)

    @property
    def args(self) -> tuple[str, ...]:
        return ("--attention-backend", self.attention_backend)

    @property
    def env(self) -> dict[str, str]:
        return {"VLLM_KV_CACHE_LAYOUT": self.kv_cache_layout}


SERVE_SETTINGS: dict[str, ServeSettings] = {
    "rocm": ServeSettings("rocm", "TRITON_ATTN", "LBNHC"),
    "cuda": ServeSettings("cuda", "FLASH_ATTN", "LBNHC"),
    "cpu": ServeSettings("cpu", "CPU_ATTN", "LBHNC"),
}


def serve_settings(platform: str) -> ServeSettings:
    """The ``vllm serve`` arguments and environment for mono decode on ``platform``."""
    try:
        return SERVE_SETTINGS[platform]
    except KeyError:
        raise ConfigError(f"platform {platform!r}: mono decode serves on {', '.join(sorted(SERVE_SETTINGS))}") from None


def pair_reason(platform: str, backend: str, layout: str | None) -> str | None:
    """None when ``backend`` + ``layout`` is the pair mono decode supports on ``platform``; else
    the refusal reason, naming the pair found and the pair to set."""
    want = SERVE_SETTINGS.get(platform)
    if want is None:
        return f"attention_backend: no attention backend is supported for mono decode on platform {platform!r}"
    if backend != want.attention_backend:
        return (
            f"attention_backend: vLLM runs attention backend {backend} with KV layout {layout}; mono decode on "
            f"{platform} supports only {want.attention_backend} with {want.kv_cache_layout} "
            f"(--attention-backend {want.attention_backend}, VLLM_KV_CACHE_LAYOUT={want.kv_cache_layout})"
        )
    if layout != want.kv_cache_layout:
        return (
            f"kv_layout: vLLM resolved KV layout {layout} for attention backend {backend}; mono decode on "
            f"{platform} supports {want.attention_backend} only with {want.kv_cache_layout} "
            f"(VLLM_KV_CACHE_LAYOUT={want.kv_cache_layout})"
        )
    return None
