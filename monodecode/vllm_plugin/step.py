"""One step as the runner sees it, read from vLLM's forward context.

``step_info`` reads only host fields that vLLM's scheduler hands every TP rank identically
(token count, prefill/decode split, cudagraph runtime mode, whether attention metadata exists),
so every rank takes the same path. ``decode_metadata`` and ``kv_views`` turn vLLM's per-layer
attention metadata and KV cache into the runner's ``DecodeMetadata`` / ``PagedKVCache`` without
copying the cache: the views alias vLLM's tensors, so both paths read and write the same KV.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from monodecode.errors import ConfigError, MonodecodeError
from monodecode.kernels.base import kernel_layers
from monodecode.model.paged_kv import DecodeMetadata, PagedKVCache
from monodecode.runtime.vote import StepInfo


class KVLayoutError(MonodecodeError):
    """vLLM bound a KV cache in a layout the kernels cannot read."""


def _first_metadata(attn_metadata: Any) -> Any:
    if not isinstance(attn_metadata, dict) or not attn_metadata:
        return None  # profile / dummy runs (None) and micro-batched steps (a list)
    return next(iter(attn_metadata.values()))


def prefill_rows(md: Any, num_tokens: int) -> int:
    """Rows of this step that belong to prefill chunks (0 for a pure decode step).

    Read from host fields only. Backends without an explicit prefill/decode split expose just
    ``max_query_len``: a step with one request and ``max_query_len > 1`` is a prefill; with
    several requests the split lives on the device, so it is reported as a mixed batch."""
    if hasattr(md, "num_prefills") and hasattr(md, "num_decode_tokens"):
        # backends with an explicit split (ROCm AITER FA): decode rows first, then the rest
        if int(md.num_prefills) + int(getattr(md, "num_extends", 0) or 0) == 0:
            return 0
        return max(int(md.num_actual_tokens) - int(md.num_decode_tokens), 1)
    max_query_len = getattr(md, "max_query_len", None)
    if max_query_len is None:
        return num_tokens  # an unknown metadata layout is never treated as decode
    if int(max_query_len) <= 1:
        return 0
    num_reqs = int(md.seq_lens.shape[0])
    return num_tokens if num_reqs <= 1 else num_tokens - 1


def step_info(forward_context: Any, num_tokens: int, allowed: Callable[[Any], bool] | None = None) -> StepInfo:
    """``StepInfo`` of the step in ``forward_context`` (None = no context: a dummy pass).
    Metadata ``allowed`` rejects (a class the bound backend's builder does not return) is read
    as no metadata: such a step is never classified as decode."""
    if forward_context is None:
        return StepInfo(num_rows=num_tokens, has_metadata=False)
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    graph_mode = getattr(mode, "name", "NONE").lower()
    md = _first_metadata(getattr(forward_context, "attn_metadata", None))
    if md is None or (allowed is not None and not allowed(md)):
        return StepInfo(num_rows=num_tokens, graph_mode=graph_mode, has_metadata=False)
    return StepInfo(num_rows=num_tokens, num_prefill_rows=prefill_rows(md, num_tokens), graph_mode=graph_mode)


def _pad_rows(t: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows]
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


def decode_metadata(md: Any, positions: torch.Tensor, slot_mapping: torch.Tensor | None = None) -> DecodeMetadata:
    """The runner's ``DecodeMetadata`` for a decode-only step: one row per token of ``positions``
    (padded rows beyond the real requests get slot -1, an empty table and length 0: inert)."""
    rows = int(positions.shape[0])
    slots = md.slot_mapping if slot_mapping is None else slot_mapping
    return DecodeMetadata(
        positions=positions.to(torch.int64),
        slot_mapping=_pad_rows(slots.to(torch.int64), rows, -1),
        block_tables=_pad_rows(md.block_table.to(torch.int32), rows, 0),
        seq_lens=_pad_rows(md.seq_lens.to(torch.int32), rows, 0),
    )


def kv_views(kv_caches: list[torch.Tensor], num_kv_heads: int, head_dim: int, kernels: Any = None) -> PagedKVCache:
    """Per-layer key/value views ``[num_blocks, block_size, kv_heads, head_dim]`` of vLLM's
    per-layer caches, logically ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` with K then
    V along the last axis (the split vLLM's strided GPU backends use). The views alias vLLM's
    memory and are strided, so a kernel addresses them through the tensors' strides. Whether the
    cache really is that layout is decided from vLLM's objects (backend, resolved layout, cache
    spec) by ``binding.bind``; this builds the views and, with ``kernels``, runs the backend's own
    capability check (``DecodeKernels.check_kv``: alignment, strides, block size), so a layout
    its kernels cannot address is refused at binding, never at a launch."""
    keys, values = [], []
    block_size = None
    for layer, kv in enumerate(kv_caches):
        if kv.dim() != 4 or kv.shape[1] != num_kv_heads or kv.shape[-1] != 2 * head_dim:
            raise KVLayoutError(
                f"kv_layout: layer {layer}'s KV cache has shape {tuple(kv.shape)}; expected "
                f"[blocks, {num_kv_heads} KV heads, block size, {2 * head_dim}] (vLLM's K|V layout)"
            )
        k, v = kv.transpose(1, 2).split(head_dim, dim=-1)
        keys.append(k)
        values.append(v)
        block_size = k.shape[1]
    if block_size is None:
        raise KVLayoutError("kv_layout: no KV caches are bound")
    kv = PagedKVCache(key=keys, value=values, block_size=block_size)
    if kernels is not None:
        try:
            kernels.check_kv(kv)
        except ConfigError as e:
            why = str(e)
            raise KVLayoutError(why if why.startswith("kv_layout: ") else f"kv_layout: {why}") from None
    return kv


def run_kernel_layers(
    forward_layer: Callable[[int, torch.Tensor, DecodeMetadata, PagedKVCache], torch.Tensor],
    x: torch.Tensor,
    metas: list[DecodeMetadata],
    kv: PagedKVCache | None,
    staged: Any = None,
    count: int | None = None,
    forward_step: Callable[[torch.Tensor, list[DecodeMetadata], PagedKVCache], torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The residual stream through decoder layers ``0 .. count - 1`` (default: all) on the kernels,
    as a mono step runs them: on vLLM's cache in place (``kv``), or on vLLM's CPU platform staged
    per layer (``staged``, a ``cpu_kv.StagedKV``: the layer's blocks copied out, new rows back).
    With ``forward_step`` (``Runner.forward_step``), every layer on the cache in place is first
    offered to it as one launch; where it returns None (no whole-step launch) the layers run one
    ``forward_layer`` at a time."""
    n = len(metas) if count is None else count
    if staged is None:
        return kernel_layers(forward_layer, x, metas[:n], kv, forward_step if n == len(metas) else None)
    for layer in range(n):
        layer_kv = staged.stage(layer, len(staged.metas))
        x = forward_layer(layer, x, staged.metas[layer], layer_kv)
        staged.commit(layer, layer_kv)
    return x
