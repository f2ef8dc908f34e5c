"""Binding vLLM's KV cache to the kernels, checked from vLLM's own objects.

Runs when vLLM binds each attention layer's cache (``AttentionLayerBase.bind_kv_cache``, called by
``bind_kv_cache_to_layers`` inside the model runner's ``initialize_kv_cache``), before any forward
that could reach the kernels, for the profiling cache and again for the real one. What it reads:

- the attention backend class each layer runs (``layer.get_attn_backend()``), named by vLLM's
  own ``AttentionBackendEnum`` (class path identity: ``ROCM_AITER_FA``'s ``get_name()`` says
  FLASH_ATTN, so the name a class reports is not used);
- the KV layout the engine core resolved (``cache_config.kv_cache_layout``);
- the layer's cache spec (``get_kv_cache_spec``): one head slot per KV head, dense K|V content
  of ``head_size`` each, bf16, no KV quantization;
- the bound tensor: its strides must be the resolved layout's physical order;
- on the CPU platform, the instruction set vLLM's metadata builder chose (``layer.isa``).

The supported backend + layout pairs per platform are ``serving.SERVE_PAIRS``; anything else is
a ``BindError`` whose message is the refusal reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from monodecode.model.paged_kv import PagedKVCache
from monodecode.vllm_plugin.cpu_kv import CpuKVError, LayerKV
from monodecode.vllm_plugin.serving import pair_reason
from monodecode.vllm_plugin.step import kv_views

# backend -> the attention metadata class its builder returns (what step_info may read)
METADATA_CLASSES = {
    "TRITON_ATTN": "vllm.v1.attention.backends.triton_attn.TritonAttentionMetadata",
    "ROCM_AITER_FA": "vllm.v1.attention.backends.rocm_aiter_fa.AiterFlashAttentionMetadata",
    # AITER's unified attention reuses ROCM_ATTN's metadata builder and class
    "ROCM_AITER_UNIFIED_ATTN": "vllm.v1.attention.backends.rocm_attn.RocmAttentionMetadata",
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn.FlashAttentionMetadata",
    "CPU_ATTN": "vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadata",
}


class BindError(ValueError):
    """vLLM's attention or KV cache is not what the kernels can read; the message is the reason."""


def backend_enum_name(backend_cls: type) -> str:
    """The ``AttentionBackendEnum`` member whose class ``backend_cls`` is (else its class path)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    path = f"{backend_cls.__module__}.{backend_cls.__qualname__}"
    for member in AttentionBackendEnum:
        try:
            if member.get_path() == path:
                return member.name
        except ValueError:  # CUSTOM without a registration
            continue
    return path


def layer_backend(attn: Any) -> str:
    return backend_enum_name(attn.get_attn_backend())


def backend_reason(platform: str, attn_layers: list[Any]) -> str | None:
    """Refusal reason when a layer runs an attention backend mono decode does not support on
    ``platform`` (known when the model is built, before the layout is resolved)."""
    for attn in attn_layers:
        why = pair_reason(platform, layer_backend(attn), None)
        if why:
            return why
    return None


def _spec_reason(attn: Any, vllm_config: Any) -> str | None:
    spec = attn.get_kv_cache_spec(vllm_config)
    problems = []
    if getattr(spec, "num_head_slots", None) is not None:
        problems.append(f"{spec.num_head_slots} packed head slots for {spec.num_kv_heads} KV heads")
    if getattr(spec, "state_content_bytes", None) is not None:
        problems.append(f"packed content of {spec.state_content_bytes} bytes")
    if spec.head_size_v != spec.head_size:
        problems.append(f"V head size {spec.head_size_v} != K head size {spec.head_size}")
    if spec.dtype != torch.bfloat16:
        problems.append(f"dtype {spec.dtype}")
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is not None and getattr(mode, "name", "NONE") != "NONE":
        problems.append(f"KV quantization {mode.name}")
    if problems:
        return f"kv_layout: layer {attn.layer_name}'s KV cache spec has {', '.join(problems)}; mono decode reads dense bf16 K|V"
    return None


def _stride_reason(name: str, kv: torch.Tensor, layout: Any) -> str | None:
    """The bound ``[B, H, N, C]`` tensor must lie in memory in ``layout``'s physical order."""
    if kv.dim() != 4 or kv.stride(3) != 1:
        return f"kv_layout: layer {name}'s KV cache {tuple(kv.shape)} / {tuple(kv.stride())} is not a [B, H, N, C] view"
    order = tuple(sorted(range(3), key=lambda a: -kv.stride(a))) + (3,)
    sized = tuple(a for a in order if kv.shape[a] > 1 or a == 3)
    want = tuple(a for a in layout.layer_view_order if kv.shape[a] > 1 or a == 3)
    if sized != want:
        return (
            f"kv_layout: layer {name}'s KV cache strides {tuple(kv.stride())} are not vLLM's {layout.name} "
            f"layout (physical axis order {want} of [B, H, N, C])"
        )
    return None


@dataclass
class Binding:
    """What a mono step reads and writes: a strided cache (GPU) or the CPU layers' views."""

    key: tuple  # (data_ptr, numel) of every layer's cache: changes when vLLM re-binds
    kv: PagedKVCache | None = None  # GPU: the kernels read vLLM's cache through these views
    cpu_layers: list[LayerKV] | None = None  # CPU: staged per step (cpu_kv.StagedKV)


def bind(platform: str, attn_layers: list[Any], vllm_config: Any, kernels: Any = None) -> Binding:
    """Check every layer's backend, layout, spec and tensor; the binding, or ``BindError``."""
    caches = [a.kv_cache for a in attn_layers]
    key = tuple((c.data_ptr(), c.numel()) for c in caches)
    layout_name = vllm_config.cache_config.kv_cache_layout
    for attn in attn_layers:
        why = pair_reason(platform, layer_backend(attn), layout_name)
        if why:
            raise BindError(why)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    for attn, kv in zip(attn_layers, caches):
        why = _spec_reason(attn, vllm_config) or _stride_reason(attn.layer_name, kv, layout)
        if why:
            raise BindError(why)
    if platform == "cpu":
        try:
            return Binding(
                key, cpu_layers=[LayerKV.of(kv, str(getattr(a, "isa", None))) for a, kv in zip(attn_layers, caches)]
            )
        except CpuKVError as e:
            raise BindError(str(e)) from None
    a0 = attn_layers[0]
    try:
        return Binding(key, kv=kv_views(caches, int(a0.num_kv_heads), int(a0.head_size), kernels))
    except ValueError as e:
        raise BindError(str(e)) from None


def metadata_allowed(backend: str, md: Any) -> bool:
    """True when ``md`` is the metadata class ``backend``'s builder returns (checked by class path)."""
    want = METADATA_CLASSES.get(backend)
    cls = type(md)
    return want is not None and f"{cls.__module__}.{cls.__qualname__}" == want
