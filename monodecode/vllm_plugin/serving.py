"""The attention backend + KV cache layout pairs mono decode supports on each platform.

vLLM resolves one KV cache layout per engine (``vllm/v1/attention/backends/utils.py``:
``resolve_kv_cache_layout``) from the layouts every attention backend in use declares
(``AttentionBackend.supported_kv_cache_layouts``; None = any, then vLLM prefers LBNHC), and the
engine core refuses to start when ``VLLM_KV_CACHE_LAYOUT`` names a layout outside that set. The
kernels read K and V of vLLM's per-layer logical ``[blocks, kv_heads, block_size, K|V]`` cache
through strides (GPU) or through the CPU backend's own block-interior packing (CPU), so the pairs
are chosen per platform from vLLM 0.32-0.33's backend classes (the first is the default):

- rocm: AMD's recommended setting, AITER on (``VLLM_ROCM_USE_AITER=1``: AITER's linear, norm and
  attention kernels for prefill and every stock step): ``ROCM_AITER_FA`` (AITER's MHA, vLLM's
  flagship ROCm backend) with ``LBHNC``; ``ROCM_AITER_UNIFIED_ATTN`` (AITER's Triton attention)
  with ``LBHNC``. Both split K and V out of the content dim as strided views, head-major inside
  a block, and declare LBHNC / LHBNC (never LBNHC); LBHNC keeps every stride within a block, so
  the kernels' i32 stride arguments cover any cache size (LHBNC's head stride spans the whole
  cache). With AITER on vLLM selects ``ROCM_ATTN`` first, which packs K and V into two head
  slots with an x-packed K (``customize_spec``): unreadable, so the backend is always named.
  The older pair, ``TRITON_ATTN`` (declares no layout) with ``LBNHC``, stays selectable (AITER
  unset unless the operator sets it). AITER's (16, 16)-preshuffled linear weights are undone into
  a row-major copy at load (``vllm_plugin.weights``);
- cuda: ``FLASH_ATTN`` (declares no layout) with ``LBNHC``, vLLM's own default there;
- cpu: ``CPU_ATTN`` (the only one) with ``LBHNC``, the only layout it declares.

``serve_settings(platform, backend)`` gives the ``vllm serve`` arguments and environment that
select one pair (the image entrypoint and the Helm chart set exactly these); the plugin refuses
any other pair at KV-cache binding with a reason naming the backend and the layout. Pure: no
vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

from monodecode.errors import ConfigError

AITER_ON = (("VLLM_ROCM_USE_AITER", "1"),)


@dataclass(frozen=True)
class ServeSettings:
    """What selects one supported pair on one platform."""

    platform: str
    attention_backend: str  # vLLM's AttentionBackendEnum name (``--attention-backend``)
    kv_cache_layout: str  # vLLM's KVCacheLayout name (``VLLM_KV_CACHE_LAYOUT``)
    backend_env: tuple[tuple[str, str], ...] = ()  # what else the backend needs (AITER on)

    @property
    def args(self) -> tuple[str, ...]:
        return ("--attention-backend", self.attention_backend)

    @property
    def env(self) -> dict[str, str]:
        return {"VLLM_KV_CACHE_LAYOUT": self.kv_cache_layout, **dict(self.backend_env)}


# platform -> its pairs, the default first
SERVE_PAIRS: dict[str, tuple[ServeSettings, ...]] = {
    "rocm": (
        ServeSettings("rocm", "ROCM_AITER_FA", "LBHNC", AITER_ON),
        ServeSettings("rocm", "ROCM_AITER_UNIFIED_ATTN", "LBHNC", AITER_ON),
        ServeSettings("rocm", "TRITON_ATTN", "LBNHC"),
    ),
    "cuda": (ServeSettings("cuda", "FLASH_ATTN", "LBNHC"),),
    "cpu": (ServeSettings("cpu", "CPU_ATTN", "LBHNC"),),
}
SERVE_SETTINGS: dict[str, ServeSettings] = {platform: pairs[0] for platform, pairs in SERVE_PAIRS.items()}


def _pairs_text(platform: str) -> str:
    return ", ".join(f"{p.attention_backend} with {p.kv_cache_layout}" for p in SERVE_PAIRS[platform])


def serve_settings(platform: str, attention_backend: str | None = None) -> ServeSettings:
    """The ``vllm serve`` arguments and environment for mono decode on ``platform``: the pair of
    ``attention_backend``, or the platform's default pair when None."""
    pairs = SERVE_PAIRS.get(platform)
    if pairs is None:
        raise ConfigError(f"platform {platform!r}: mono decode serves on {', '.join(sorted(SERVE_PAIRS))}")
    if attention_backend is None:
        return pairs[0]
    for pair in pairs:
        if pair.attention_backend == attention_backend:
            return pair
    raise ConfigError(
        f"attention backend {attention_backend!r}: mono decode on {platform} runs with {_pairs_text(platform)}"
    )


def pair_reason(platform: str, backend: str, layout: str | None) -> str | None:
    """None when ``backend`` + ``layout`` is a pair mono decode supports on ``platform``; else
    the refusal reason, naming the pair found and the pairs to set (``layout`` None: the backend
    alone is checked)."""
    pairs = SERVE_PAIRS.get(platform)
    if pairs is None:
        return f"attention_backend: no attention backend is supported for mono decode on platform {platform!r}"
    want = next((p for p in pairs if p.attention_backend == backend), None)
    if want is None:
        default = pairs[0]
        return (
            f"attention_backend: vLLM runs attention backend {backend} with KV layout {layout}; mono decode on "
            f"{platform} supports {_pairs_text(platform)} (default: --attention-backend {default.attention_backend}, "
            f"VLLM_KV_CACHE_LAYOUT={default.kv_cache_layout})"
        )
    if layout is not None and layout != want.kv_cache_layout:
        return (
            f"kv_layout: vLLM resolved KV layout {layout} for attention backend {backend}; mono decode on "
            f"{platform} supports {want.attention_backend} only with {want.kv_cache_layout} "
            f"(VLLM_KV_CACHE_LAYOUT={want.kv_cache_layout})"
        )
    return None
