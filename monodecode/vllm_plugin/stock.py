"""vLLM's own decoder layers as the stock side of the runner's checks (vLLM's CPU platform).

``VllmStockLayer(layer, x, meta, kv)`` computes one decoder layer with vLLM's module
(``model.model.layers[i]``: its norms, its linear kernels on the weights vLLM holds, its rotary
embedding and its ``CPU_ATTN`` attention kernel) for the decode rows of ``meta`` over the plain
K/V blocks ``kv`` (the runner's layout). The blocks are written into a private cache in vLLM's
own layout and packing (``cpu_kv`` views for the layer's instruction set), the layer runs under a
forward context holding vLLM's CPU attention metadata (its scheduler metadata from vLLM's op), and
the row's new K/V that vLLM's kernel stored is copied back into ``kv`` like the kernels store it.
The runner's shadow check calls it (``Runner(stock_layer=...)``), and ``stock_check`` compares
layer 0 and one whole decode step of the kernels with it when vLLM binds its KV cache.

Nothing of vLLM's serving state is touched: the private cache replaces ``attn.kv_cache`` only for
the call. Where vLLM's CPU attention kernels are missing (the CUDA wheel run on vLLM's CPU
platform) ``available()`` is False and the runner keeps its reference stock layer.
"""

from __future__ import annotations

from typing import Any

import torch

from monodecode.model.paged_kv import DecodeMetadata, PagedKVCache
from monodecode.vllm_plugin.cpu_kv import LayerKV, StagedKV


def available() -> bool:
    """vLLM's CPU attention kernels are loaded (``vllm._C``, which ``vllm._custom_ops`` loads)."""
    import vllm._custom_ops  # noqa: F401

    return hasattr(torch.ops._C, "cpu_attn_reshape_and_cache") and hasattr(torch.ops._C, "get_scheduler_metadata")


class VllmStockLayer:
    def __init__(self, model: Any, vllm_config: Any, attn_layers: list[Any], fallback: Any):
        backbone = model.model
        self._layers = list(backbone.layers)[backbone.start_layer : backbone.end_layer]
        self._attn = attn_layers
        self._vllm_config = vllm_config
        self._fallback = fallback  # the stock layer before vLLM bound its cache (no ISA yet)
        self.bound = False

    @torch.no_grad()
    def __call__(self, layer: int, x: torch.Tensor, meta: DecodeMetadata, kv: PagedKVCache) -> torch.Tensor:
        if not self.bound:
            return self._fallback(layer, x, meta, kv)
        attn = self._attn[layer]
        key, value = kv.key[layer], kv.value[layer]
        blocks, bs, heads, head_dim = key.shape
        private = torch.zeros(blocks, heads, bs, 2 * head_dim, dtype=key.dtype, device=key.device)
        views = LayerKV.of(private, attn.isa)
        every = torch.arange(blocks * bs, device=key.device)
        views.scatter(views.key, every, key.reshape(-1, heads, head_dim))
        views.scatter(views.value, every, value.reshape(-1, heads, head_dim))
        out = self.run(layer, x, meta, private)
        slots = meta.slot_mapping[meta.slot_mapping >= 0]
        all_blocks = torch.arange(blocks)
        for src, dst in ((views.key, key), (views.value, value)):  # the new rows, as the kernels store them
            plain = views.gather(src, all_blocks)
            dst[slots // bs, slots % bs] = plain[slots // bs, slots % bs]
        return out

    @torch.no_grad()
    def run(self, layer: int, x: torch.Tensor, meta: DecodeMetadata, cache: torch.Tensor) -> torch.Tensor:
        """vLLM's decoder layer ``layer`` on ``x`` with ``cache`` (vLLM's own layout and packing)
        as the layer's KV cache for the call; returns the residual stream after the layer."""
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        attn = self._attn[layer]
        rows = int(meta.positions.shape[0])
        md = self._metadata(attn, meta, rows)
        saved = attn.kv_cache
        attn.kv_cache = cache
        try:
            with (
                set_current_vllm_config(self._vllm_config),
                set_forward_context(
                    {attn.layer_name: md},
                    self._vllm_config,
                    num_tokens=rows,
                    slot_mapping={attn.layer_name: meta.slot_mapping},
                ),
            ):
                hidden, residual = self._layers[layer](meta.positions, x, None)
        finally:
            attn.kv_cache = saved
        return (hidden.float() + residual.float()).to(x.dtype)

    def _metadata(self, attn: Any, meta: DecodeMetadata, rows: int) -> Any:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

        query_start_loc = torch.arange(rows + 1, dtype=torch.int32)
        seq_lens = meta.seq_lens.to(torch.int32)
        window = attn.impl.sliding_window
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_size,
            seq_lens=seq_lens,
            dtype=self._vllm_config.model_config.dtype,
            query_start_loc=query_start_loc,
            causal=True,
            sliding_window_size=window if window is not None else -1,
            isa=attn.isa,
            enable_kv_split=False,
        )
        return CPUAttentionMetadata(
            num_actual_tokens=rows,
            max_query_len=1,
            query_start_loc=query_start_loc,
            max_seq_len=int(seq_lens.max()),
            seq_lens=seq_lens,
            block_table=meta.block_tables.to(torch.int32),
            slot_mapping=meta.slot_mapping,
            scheduler_metadata=sched,
            num_decode_tokens=rows,
        )


@torch.no_grad()
def stock_check(
    runner: Any, stock: VllmStockLayer, num_layers: int, hidden_size: int, atol: float, rtol: float
) -> str | None:
    """The kernels against vLLM's own layers, on one decode row over a random context that vLLM's
    own writer stored in its layout (``cpu_attn_reshape_and_cache`` with each layer's instruction
    set): the kernels read it through the plugin's views (staged exactly as when serving), vLLM's
    layers through its attention kernel. Layer 0 on the same input, then one whole decode step
    (every layer on the previous layer's output). None when each agrees within
    ``atol + rtol * max|stock|``; else the refusal reason (``warmup_failed``)."""
    from vllm import _custom_ops as ops

    attn0 = stock._attn[0]
    heads, head_dim = int(attn0.num_kv_heads), int(attn0.head_size)
    block_size = int(stock._vllm_config.cache_config.block_size)
    gen = torch.Generator().manual_seed(0)
    context = block_size + 3  # crosses a block boundary
    blocks = context // block_size + 1
    meta = DecodeMetadata(
        positions=torch.tensor([context]),
        slot_mapping=torch.tensor([context]),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None, :],
        seq_lens=torch.tensor([context + 1], dtype=torch.int32),
    )
    # A context attention cannot average away: large keys (a peaked softmax, so a misplaced key
    # moves the weights) and values with a per-dimension offset (a misplaced value moves the
    # output); a small residual input, so the attention's share of the output is not drowned.
    caches = []
    for layer in range(num_layers):
        cache = torch.zeros(blocks, heads, block_size, 2 * head_dim, dtype=torch.bfloat16)
        k = (torch.randn(context, heads, head_dim, generator=gen) * 2.0).to(torch.bfloat16)
        offset = torch.randn(1, heads, head_dim, generator=gen) * 2.0
        v = (torch.randn(context, heads, head_dim, generator=gen) + offset).to(torch.bfloat16)
        kc, vc = cache.view(blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(context), stock._attn[layer].isa)
        caches.append(cache)
    x0 = (torch.randn(1, hidden_size, generator=gen) * 0.1).to(torch.bfloat16)

    def kernels(last: int) -> torch.Tensor:
        views = [LayerKV.of(c.clone(), stock._attn[i].isa) for i, c in enumerate(caches)]
        staged = StagedKV(views, [meta] * num_layers)
        x = x0
        for layer in range(last + 1):
            kv = staged.stage(layer, num_layers)
            x = runner.forward_layer(layer, x, staged.metas[layer], kv)
            staged.commit(layer, kv)
        return x

    def vllm_layers(last: int) -> torch.Tensor:
        x = x0
        for layer in range(last + 1):
            x = stock.run(layer, x, meta, caches[layer].clone())
        return x

    for last, what in ((0, "layer 0"), (num_layers - 1, "one decode step through every layer")):
        ours, theirs = kernels(last).float(), vllm_layers(last).float()
        err = float((ours - theirs).abs().max())
        bound = atol + rtol * float(theirs.abs().max())
        if not err <= bound:
            return (
                f"warmup_failed: {what}: the kernels differ from vLLM's own decoder layers by {err:.4g} "
                f"(tolerance {bound:.4g}) on vLLM's KV layout: weights or KV are not read as vLLM reads them"
            )
    return None
