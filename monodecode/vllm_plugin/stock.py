"""vLLM's own decoder layers as the stock side of the runner's checks.

``VllmStockLayer.run(layer, x, meta, cache)`` computes one decoder layer with vLLM's module
(``model.model.layers[i]``: its norms, its linear kernels on the weights vLLM holds, its rotary
embedding and its attention backend: ``CPU_ATTN``, ``TRITON_ATTN``, ``FLASH_ATTN`` or AITER's) for the
decode rows of ``meta``, over ``cache``: a private cache in the layout and packing vLLM binds,
written by the backend's own writer (``impl.do_kv_cache_update``). The layer runs under a forward
context holding the metadata vLLM's own builder makes for the layer's backend
(``get_builder_cls()(...).build``, as the model runner does each step).

- ``stock_check`` compares layer 0 and one whole decode step of the kernels with vLLM's layers
  when vLLM binds its KV cache, on every platform: a weight or KV packing the kernels read
  otherwise than vLLM does is refused before any request.
- ``VllmStockBench`` is the stock side of the width policy's timing (``Runner.time_widths``), on
  every platform: vLLM's layers against the kernels at several contexts on one private cache,
  metadata from vLLM's builder, the context stored where vLLM's writer stores it; on GPUs both
  steps are captured in a CUDA graph (``width_policy.time_step``).
- The runner's shadow check calls the layer (``Runner(stock_layer=...)``) on vLLM's CPU platform,
  where the runner's K/V is the plain staged copy of the step's blocks. On GPUs the shadow check
  keeps the reference layer (``MonoDecode`` chooses, and says so): its stock side would need the
  step's context copied out of a cache of many GiB at every check.

Nothing of vLLM's serving state is touched: the private cache replaces ``attn.kv_cache`` only for
the call. Where vLLM's CPU attention kernels are missing (the CUDA wheel run on vLLM's CPU
platform) ``available()`` is False: the start-up comparison does not run, and the width timing
reports its stock side ``unavailable`` and times nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from monodecode.model.paged_kv import BlockAllocator, DecodeMetadata, PagedKVCache
from monodecode.runtime.width_policy import kv_budget_bytes, timing_contexts
from monodecode.vllm_plugin.cpu_kv import LayerKV, StagedKV
from monodecode.vllm_plugin.step import kv_views, run_kernel_layers


def available(platform: str) -> bool:
    """vLLM's attention kernels for ``platform`` are loaded: on CPU its C++ kernels (``vllm._C``,
    which ``vllm._custom_ops`` loads); a GPU backend carries its own."""
    if platform != "cpu":
        return True
    import vllm._custom_ops  # noqa: F401

    return hasattr(torch.ops._C, "cpu_attn_reshape_and_cache") and hasattr(torch.ops._C, "get_scheduler_metadata")


def private_cache(bound: torch.Tensor, blocks: int) -> torch.Tensor:
    """A zeroed ``[blocks, heads, block_size, C]`` cache laid out in memory like ``bound`` (vLLM's
    resolved layout), so vLLM's writer and attention address it as they address ``bound``."""
    order = sorted(range(4), key=lambda a: -bound.stride(a))  # physical axis order, outermost first
    shape = [blocks if a == 0 else bound.shape[a] for a in order]
    flat = torch.zeros(shape, dtype=bound.dtype, device=bound.device)
    return flat.permute([order.index(a) for a in range(4)])


class VllmStockLayer:
    def __init__(self, model: Any, vllm_config: Any, attn_layers: list[Any], staged_cpu: bool):
        backbone = model.model
        self._layers = list(backbone.layers)[backbone.start_layer : backbone.end_layer]
        self._attn = attn_layers
        self._vllm_config = vllm_config
        self.staged_cpu = staged_cpu  # vLLM's CPU packing: the kernels read blocks staged per step
        self._builder: Any = None
        self.bound = False

    def bind(self) -> None:
        """vLLM bound its cache: build the layers' metadata builder as the model runner does
        (after binding: on CPU the builder has chosen each layer's instruction set by then)."""
        from vllm.config import set_current_vllm_config

        attn = self._attn[0]
        bound = attn.kv_cache
        spec = dataclasses.replace(attn.get_kv_cache_spec(self._vllm_config), block_size=int(bound.shape[2]))
        builder_cls = attn.get_attn_backend().get_builder_cls()
        with set_current_vllm_config(self._vllm_config):
            self._builder = builder_cls(spec, [a.layer_name for a in self._attn], self._vllm_config, bound.device)
        self.bound = True

    def unbind(self) -> None:
        self._builder = None
        self.bound = False

    @torch.no_grad()
    def __call__(self, layer: int, x: torch.Tensor, meta: DecodeMetadata, kv: PagedKVCache) -> torch.Tensor:
        """The layer on the runner's plain K/V ``kv`` (the shadow check's stock side): copied into a
        private cache in vLLM's CPU packing, the new rows copied back. CPU only, once bound."""
        if not (self.bound and self.staged_cpu):
            raise RuntimeError(
                "vLLM's decoder layers run on the runner's plain K/V only on its CPU platform, once bound"
            )
        attn = self._attn[layer]
        key, value = kv.key[layer], kv.value[layer]
        blocks, bs, heads, head_dim = key.shape
        private = private_cache(attn.kv_cache, blocks)
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

    def kernel_kv(
        self, caches: list[torch.Tensor], meta: DecodeMetadata
    ) -> tuple[PagedKVCache | None, StagedKV | None]:
        """What the kernels read of ``caches`` (one per layer, vLLM's layout) in a step with
        ``meta``, as when serving (``step.run_kernel_layers``' ``kv`` and ``staged``): on CPU the
        step's blocks staged through views of vLLM's packing, on GPUs strided views in place."""
        if self.staged_cpu:
            views = [LayerKV.of(c, self._attn[i].isa) for i, c in enumerate(caches)]
            return None, StagedKV(views, [meta] * len(caches))
        attn = self._attn[0]
        return kv_views(caches, int(attn.num_kv_heads), int(attn.head_size)), None

    def write(self, layer: int, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[tokens, heads, head_dim]`` at slots 0.. of ``cache`` with the
        layer's own backend writer, in its layout and packing."""
        attn = self._attn[layer]
        slots = torch.arange(key.shape[0], device=cache.device)
        attn.impl.do_kv_cache_update(attn, key, value, cache, slots)

    @torch.no_grad()
    def run(
        self, layer: int, x: torch.Tensor, meta: DecodeMetadata, cache: torch.Tensor, md: Any = None
    ) -> torch.Tensor:
        """vLLM's decoder layer ``layer`` on ``x`` with ``cache`` (vLLM's own layout and packing)
        as the layer's KV cache for the call; returns the residual stream after the layer. ``md``:
        the step's attention metadata (``metadata(meta)``), built here when not given."""
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context

        attn = self._attn[layer]
        rows = int(meta.positions.shape[0])
        md = self.metadata(meta) if md is None else md
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

    def metadata(self, meta: DecodeMetadata) -> Any:
        """The attention metadata of a decode batch (one query token per row), from vLLM's builder
        (host work and a device-to-host copy: built before a graph capture, never inside one)."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        rows = int(meta.positions.shape[0])
        device = meta.positions.device
        starts = torch.arange(rows + 1, dtype=torch.int32)
        seq_lens = meta.seq_lens.to(torch.int32)
        seq_lens_cpu = seq_lens.cpu()  # a start-up / CPU-only path: the copy waits on nothing served
        common = CommonAttentionMetadata(
            query_start_loc=starts.to(device),
            query_start_loc_cpu=starts,
            seq_lens=seq_lens,
            num_reqs=rows,
            num_actual_tokens=rows,
            max_query_len=1,
            max_seq_len=int(seq_lens_cpu.max()),
            block_table_tensor=meta.block_tables.to(torch.int32),
            slot_mapping=meta.slot_mapping,
            positions=meta.positions,
            seq_lens_cpu_upper_bound=seq_lens_cpu,  # FLASH_ATTN's builder schedules from it
        )
        return self._builder.build(0, common)


@torch.no_grad()
def stock_check(
    runner: Any, stock: VllmStockLayer, num_layers: int, hidden_size: int, atol: float, rtol: float
) -> tuple[str | None, str]:
    """The kernels against vLLM's own layers, on one decode row over a random context that each
    layer's own backend writer stored in vLLM's layout: the kernels read it as when serving (on
    CPU through the plugin's views of the blocks staged per step, on GPUs in place through the
    strided views), vLLM's layers through their attention backend. Layer 0 on the same input,
    then one whole decode step (every layer on the previous layer's output). None when each
    agrees within ``atol + rtol * max|stock|``, else the refusal reason (``warmup_failed``); and
    what was measured, for the log. Raises ArithmeticError when vLLM's side returns non-finite
    values twice on the finite input (the caller then has no vLLM comparison, as when its layers
    cannot run here): a NaN of vLLM's own is no verdict on the kernels."""
    attn0 = stock._attn[0]
    bound = attn0.kv_cache
    heads, head_dim = int(attn0.num_kv_heads), int(attn0.head_size)
    block_size = int(bound.shape[2])
    device = bound.device
    gen = torch.Generator().manual_seed(0)
    context = block_size + 3  # crosses a block boundary
    blocks = context // block_size + 1
    meta = DecodeMetadata(
        positions=torch.tensor([context], device=device),
        slot_mapping=torch.tensor([context], device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None, :],
        seq_lens=torch.tensor([context + 1], dtype=torch.int32, device=device),
    )
    # A context attention cannot average away: large keys (a peaked softmax, so a misplaced key
    # moves the weights) and values with a per-dimension offset (a misplaced value moves the
    # output); a small residual input, so the attention's share of the output is not drowned.
    caches = []
    for layer in range(num_layers):
        cache = private_cache(stock._attn[layer].kv_cache, blocks)
        k = torch.randn(context, heads, head_dim, generator=gen) * 2.0
        offset = torch.randn(1, heads, head_dim, generator=gen) * 2.0
        v = torch.randn(context, heads, head_dim, generator=gen) + offset
        stock.write(layer, cache, k.to(bound.dtype).to(device), v.to(bound.dtype).to(device))
        caches.append(cache)
    x0 = (torch.randn(1, hidden_size, generator=gen) * 0.1).to(torch.bfloat16).to(device)

    def kernels(last: int) -> torch.Tensor:
        kv, staged = stock.kernel_kv([c.clone() for c in caches], meta)
        return run_kernel_layers(
            runner.forward_layer, x0, [meta] * num_layers, kv, staged, last + 1, forward_step=runner.forward_step
        )

    def vllm_layers(last: int) -> torch.Tensor:
        x = x0
        for layer in range(last + 1):
            x = stock.run(layer, x, meta, caches[layer].clone())
        return x

    measured = []
    for last, what in ((0, "layer 0"), (num_layers - 1, "one decode step through every layer")):
        ours, theirs = kernels(last).float(), vllm_layers(last).float()
        if not bool(torch.isfinite(theirs).all()):  # on this finite input vLLM's CPU attention returned
            theirs = vllm_layers(last).float()  # NaN once in a CI run of 2 loaded cores (2026-12-05): again
        if not bool(torch.isfinite(theirs).all()):  # no comparison with it can judge the kernels
            raise ArithmeticError(f"vLLM's own decoder layers returned non-finite values twice ({what})")
        err = float((ours - theirs).abs().max())
        bound_err = atol + rtol * float(theirs.abs().max())
        measured.append(f"{what}: max |err| {err:.3g} of {bound_err:.3g}")
        if not err <= bound_err:
            return (
                f"warmup_failed: {what}: the kernels differ from vLLM's own decoder layers by {err:.4g} "
                f"(tolerance {bound_err:.4g}) on vLLM's KV layout: weights or KV are not read as vLLM reads them",
                measured[-1],
            )
    return None, "; ".join(measured)


class VllmStockBench:
    """The width timing's stock side (``width_policy.StockBench``): vLLM's decoder layers
    (``VllmStockLayer.run``, metadata from vLLM's builder) against the kernels as they serve
    (``step.run_kernel_layers`` on ``kernel_kv``), both on one private cache per layer in the
    layout vLLM bound, filled with random values (a timing reads, it does not compare) and
    sized by ``width_policy.kv_budget_bytes``: the longest context timed per width is the
    deployment's ``max_model_len`` or what that budget holds for ``width`` rows. Each row has
    its own blocks, as distinct requests do."""

    name = "vllm_layers"

    def __init__(
        self, stock: VllmStockLayer, forward_layer: Any, hidden_size: int, max_model_len: int, forward_step: Any = None
    ):
        self._stock = stock
        self._forward = forward_layer
        self._forward_step = forward_step  # the kernels' whole-step launch, where they have one
        self._hidden = hidden_size
        self._max_context = max_model_len - 1  # the context of a row whose next token is the last
        bound = stock._attn[0].kv_cache
        self._block_size = int(bound.shape[2])
        block_bytes = bound[0].numel() * bound.element_size()  # one block of one layer, K and V
        self._budget_blocks = max(1, kv_budget_bytes(bound.device) // (block_bytes * len(stock._attn)))
        self._caches: list[torch.Tensor] = []

    def contexts(self, width: int) -> tuple[int, ...]:
        return timing_contexts(self._max_context, (self._budget_blocks // width) * self._block_size - 1)

    def _caches_of(self, blocks: int) -> list[torch.Tensor]:
        if not self._caches or self._caches[0].shape[0] < blocks:
            self._caches = []  # the smaller cache goes before the larger is allocated
            for attn in self._stock._attn:
                cache = private_cache(attn.kv_cache, blocks)
                cache.normal_()
                self._caches.append(cache)
        return self._caches

    @torch.no_grad()
    def steps(self, width: int, context: int) -> tuple[Any, Any]:
        stock, bs = self._stock, self._block_size
        per_row = -(-(context + 1) // bs)
        caches = self._caches_of(width * per_row)
        device = caches[0].device
        alloc = BlockAllocator(width * per_row, bs)
        for row in range(width):
            alloc.append_slots(row, context)
        meta = alloc.decode_metadata(list(range(width)), device=device)
        x = (torch.randn(width, self._hidden) * 0.1).to(torch.bfloat16).to(device)
        md = stock.metadata(meta)
        metas = [meta] * len(caches)
        kv, staged = stock.kernel_kv(caches, meta)

        @torch.no_grad()
        def mono() -> torch.Tensor:
            step_kv, step_staged = (kv, None) if staged is None else stock.kernel_kv(caches, meta)  # staged per step
            return run_kernel_layers(self._forward, x, metas, step_kv, step_staged, forward_step=self._forward_step)

        @torch.no_grad()
        def vllm_layers() -> torch.Tensor:
            y = x
            for layer, cache in enumerate(caches):
                y = stock.run(layer, y, meta, cache, md)
            return y

        return mono, vllm_layers

    def close(self) -> None:
        on_gpu = bool(self._caches) and self._caches[0].is_cuda
        self._caches = []
        if on_gpu:  # back to the device before vLLM sizes or allocates anything else (its profiling binding)
            torch.cuda.empty_cache()
