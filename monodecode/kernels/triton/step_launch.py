"""Host side of the step launch (``step_kernel.py``): packed weights, buffers, arguments, launches.

``StepKernels`` runs a whole decode step's decoder layers in one launch (``forward_step``) or one
layer in one launch (``forward_layer``, the per-layer interface every backend has). Every buffer a
launch touches has a fixed address after build, and nothing on the host depends on device values,
so both can be captured in a CUDA graph and replayed. The launch counter and completion counters
of each (width, layers a launch) pair are its own: the kernel's targets count launches of that
shape only.
"""

from __future__ import annotations

from typing import Any

import torch

from monodecode.errors import ConfigError
from monodecode.kernels.base import BuildRequest
from monodecode.kernels.padded import PaddedKernels
from monodecode.kernels.triton.args import kv_strides
from monodecode.kernels.triton.launch import _POLL_SECONDS, _Meta
from monodecode.kernels.triton.sources import POINTER_TYPES
from monodecode.kernels.triton.step_plan import (
    BK,
    NCTR,
    NUM_WARPS,
    ROWS,
    TB,
    StepGeometry,
    checked_plan,
    step_refusals,
)
from monodecode.model.weights import TORCH_DTYPES

SHARED_SCRATCH = 1126  # what the compiler adds to the plan's shared memory, at most (test_step_compile)
KV_OFFSET_MULTIPLE = 16  # the kernel tells the compiler each layer's cache offset is a multiple of this


def pack_step_weights(g: StepGeometry, weights: Any, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's weights as the kernel streams them (``StepGeometry``'s layout): one block a
    layer (bf16, or e4m3fn for fp8), gate/up rows interleaved 8 gate then their 8 up (each task
    stores SiLU(g)·u); and for fp8 each packed row's scale (fp32, ``StepGeometry.scale_offsets``;
    bf16: one unused word)."""
    d = g.dims
    h, i = d.hidden_size, d.intermediate_size
    fp8 = g.weight_dtype == "fp8"
    # (o_proj: hidden rows of q_size columns, packed at whole rows of both: TMA's o view, ``off_o``)
    blob = torch.zeros(len(weights.layers) * g.layer_weights, dtype=TORCH_DTYPES[g.weight_dtype], device=device)
    so = g.scale_offsets
    scales = torch.ones(len(weights.layers) * so["end"] if fp8 else 1, dtype=torch.float32, device=device)
    for n, lw in enumerate(weights.layers):
        p = blob[n * g.layer_weights : (n + 1) * g.layer_weights]
        qkv = (lw.q_proj, lw.k_proj, lw.v_proj)
        p[: g.qkv_rows * h].copy_(torch.cat([m.weight for m in qkv], dim=0).reshape(-1))
        p[g.off_o : g.off_gu].copy_(lw.o_proj.weight.reshape(-1))
        gu = torch.stack([lw.gate_proj.weight.view(i // 8, 8, h), lw.up_proj.weight.view(i // 8, 8, h)], dim=1)
        p[g.off_gu : g.off_gu + 2 * i * h].copy_(gu.reshape(-1))
        p[g.off_down : g.off_down + h * i].copy_(lw.down_proj.weight.reshape(-1))
        if fp8:
            sc = scales[n * so["end"] : (n + 1) * so["end"]]
            sc[: so["o"]].copy_(torch.cat([m.scale for m in qkv]))
            sc[so["o"] : so["gu"]].copy_(lw.o_proj.scale)
            sc[so["gu"] : so["down"]].copy_(
                torch.stack([lw.gate_proj.scale.view(-1, 8), lw.up_proj.scale.view(-1, 8)], 1).reshape(-1)
            )
            sc[so["down"] :].copy_(lw.down_proj.scale)
    return blob, scales


def weight_descriptors(blob: torch.Tensor, dims) -> dict[tuple[bool, int], tuple[Any, Any, Any]]:
    """TMA's views of the packed weights, rows of ``hidden`` columns (qkv, o_proj, gate/up), rows
    of ``intermediate`` (down) and rows of heads x head_dim (o_proj where that is not hidden:
    Gemma-3; else the first view again), for each ring order and box (key: the products run on mma.sync,
    ``StepGeometry.mma``; the 1024-column parts a box spans, ``StepGeometry.box_parts``: 2 for
    FP8's chunks, built for every model). On FMA (width 1) a box is [16 rows, 4 x parts, 256],
    unswizzled (a ring slot holds the same bytes in the same order as ``cp.async`` leaves them).
    On mma.sync (``wide_tma``): two [8 column blocks, 16 rows, 64] boxes a part, at column 0 and
    64 of each block, the swizzle as wide as a box row (128 bytes bf16, 64 fp8) on, so that each
    warp's 128 columns land as two [16, 64] operand tiles read without bank conflicts (the view's
    strides are not ordered: column ``c`` of block ``w`` of row ``r`` is element ``r * K + 128 w + c``)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bits = blob.element_size() * 8
    boxes = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=3)
    wide = gl.NVMMASharedLayout(swizzle_byte_width=8 * bits, element_bitwidth=bits, rank=3)
    half = BK // NUM_WARPS // 2

    def rows_of(k: int, mma_order: bool, parts: int):
        if not mma_order:
            return TensorDescriptor.from_tensor(blob.view(-1, k // TB, TB), [ROWS, parts * BK // TB, TB], boxes)
        shape = [k // (2 * half), blob.numel() // k, 2 * half]
        return TensorDescriptor(blob, shape, [2 * half, k, 1], [NUM_WARPS, ROWS, half], wide)

    h, i, q = dims.hidden_size, dims.intermediate_size, dims.num_heads * dims.head_dim
    keys = [(False, 1), (False, 2), (True, 1)]
    out = {}
    for m, p in keys:
        wh = rows_of(h, m, p)
        out[(m, p)] = (wh, rows_of(i, m, p), wh if q == h else rows_of(q, m, p))
    return out


class _Buffers:
    """One (width, layers a launch) pair's device buffers."""

    def __init__(self, g: StepGeometry, layers: int, device):
        d = g.dims
        self.box = (g.mma, g.box_parts)  # its TMA views' key (``weight_descriptors``)
        self.act = torch.zeros(layers * g.width * g.act_offsets["end"], dtype=torch.float32, device=device)
        self.part = torch.zeros(g.partial_places, dtype=torch.float32, device=device)
        self.res = torch.zeros(max(1, layers - 1) * g.width * d.hidden_size, dtype=torch.bfloat16, device=device)
        self.ctr = torch.zeros(layers * NCTR, dtype=torch.int64, device=device)
        self.hctr = torch.zeros(layers * g.width * d.num_kv_heads, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)


def kernel_arguments(k, b: _Buffers, first, layers, x, meta, caches, offsets, strides, out, fault_layer, fault_kind):
    """``step_kernel``'s runtime arguments in signature order: ``k``'s weights, their TMA views,
    their rows' scales (fp8), norms (Gemma-3's post and q/k norms and windows too), RoPE
    frequencies (Gemma-3's sliding layers' too), health word, timeline stamps and spin
    budget; ``b``, one launch shape's buffers; the caches of layer 0 and every layer's offset from
    them; the K and V strides; the metadata."""
    wh, wi, wo = k.descriptors[b.box]
    return [
        k.weights, wh, wi, wo, k.wscale, k.gin, k.gpost, k.gpp, k.qkn, k.wnd, k.inv_freq, k.inv2, x, b.res, out, b.act,
        b.part,
        *caches, *offsets, *strides,
        meta.positions, meta.slot_mapping, meta.block_tables, meta.block_tables.stride(0), meta.seq_lens,
        b.ctr, b.hctr, b.epoch, k.health_word, k.prof, first, layers, k.spin_limit, fault_layer, fault_kind,
    ]  # fmt: skip


class StepKernels(PaddedKernels):
    """The step launch of every built width of one model on one device."""

    kernel_label = "triton step launch"

    def __init__(
        self, req: BuildRequest, weights: Any, num_programs: int, device, plan: dict | None = None, share: Any = None
    ):
        """``plan``: knobs of the plan changed from their defaults (``step_plan.PLAN_KNOBS``; the
        benchmark's step variants), checked with every width's geometry. ``share``: another
        StepKernels of the same weights whose packed copy this one reads (the layout is the
        model's, not the plan's: one copy on the GPU, not one a variant)."""
        why = step_refusals(req.dims, req.weight_dtype, req.tp_size, req.widths, num_programs)
        if why:
            raise ConfigError(f"{self.kernel_label}: {why[0]}")
        try:
            self.plan = checked_plan(plan)
            self.geometry = {
                w: StepGeometry(req.dims, w, num_programs, weight_dtype=req.weight_dtype, **self.plan)
                for w in req.widths
            }
            for g in self.geometry.values():
                g.check()
        except ValueError as e:
            raise ConfigError(f"{self.kernel_label}: {e}") from None
        self.req = req
        self.dims = req.dims
        self.widths = req.widths
        self.num_layers = len(weights.layers)
        self.device = torch.device(device)
        if self.device.type == "cuda":  # an sm_90+ part with less shared memory a program (sm_120: 99 KiB)
            props = torch.cuda.get_device_properties(self.device)
            have = getattr(props, "shared_memory_per_block_optin", 0)
            need = max(g.shared_bytes() for g in self.geometry.values()) + SHARED_SCRATCH
            if have and need > have:
                raise ConfigError(
                    f"{self.kernel_label}: needs {need} bytes of shared memory a program, {props.name} offers {have}"
                )
        if share is not None:
            self.weights, self.wscale, self.descriptors = share.weights, share.wscale, share.descriptors
        else:
            self.weights, self.wscale = pack_step_weights(self.geometry[req.widths[0]], weights, self.device)
            self.descriptors = weight_descriptors(self.weights, req.dims)
        self._norms(weights)
        self.health_word = torch.zeros(4, dtype=torch.int32, device=self.device)[:1]
        self.prof = torch.zeros(1, dtype=torch.int64, device=self.device)  # stamps only with enable_timeline
        self._prof_layers = 0
        self.spin_limit = min(2**31 - 1, max(1000, int(req.wait_timeout_s / _POLL_SECONDS)))
        self.programs = next(iter(self.geometry.values())).programs  # the plan's ``grid``, else one an SM
        self._buffers: dict[tuple[int, int], _Buffers] = {}
        self._kv_key: tuple | None = None
        self._kv_offsets: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kv_strides: list[int] = []
        self._retired: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _norms(self, weights: Any) -> None:
        """The norms' weights, windows and RoPE tables the kernel reads. Llama-style: the two norms
        as bf16, one table. Gemma-3 (``StepGeometry.gemma``): every norm as fp32 (1 + w), as the
        reference makes it, the post norms [layers, 2, hidden] and the q/k norms [layers, 2, D],
        each layer's window (0: full) and the sliding layers' table (the full one's where the
        model has none); the others one unused word each."""
        d, dev, layers = self.dims, self.device, weights.layers
        f32 = torch.float32

        def stacked(*names: str) -> torch.Tensor:
            w = torch.stack([torch.stack([getattr(lw, n) for n in names]) for lw in layers]).to(dev, f32)
            return (1.0 + w).contiguous()

        self.inv_freq = torch.tensor(d.rope_full.inv_freq(d.head_dim), dtype=f32, device=dev)
        if not self.geometry[self.widths[0]].gemma:
            self.gin = torch.stack([lw.attn_norm for lw in layers]).to(dev, torch.bfloat16).contiguous()
            self.gpost = torch.stack([lw.mlp_norm for lw in layers]).to(dev, torch.bfloat16).contiguous()
            self.gpp = self.qkn = self.inv2 = torch.zeros(1, dtype=f32, device=dev)
            self.wnd = torch.zeros(1, dtype=torch.int32, device=dev)
            return
        self.gin, self.gpost = stacked("attn_norm")[:, 0].contiguous(), stacked("mlp_norm")[:, 0].contiguous()
        self.gpp = stacked("attn_post_norm", "mlp_post_norm")
        self.qkn = stacked("q_norm", "k_norm")
        windows = [d.window_for_layer(n) or 0 for n in range(len(layers))]
        self.wnd = torch.tensor(windows, dtype=torch.int32, device=dev)
        self.inv2 = torch.tensor((d.rope_sliding or d.rope_full).inv_freq(d.head_dim), dtype=f32, device=dev)

    # -- the cache -----------------------------------------------------------------------------

    def _strides(self, kv) -> list[int]:
        if kv.block_size != self.req.block_size:
            raise ConfigError(
                f"{self.kernel_label}: built for KV block size {self.req.block_size}, cache has {kv.block_size}"
            )
        strides = [kv_strides(kv.key[n], kv.value[n], self.dims, kv.block_size) for n in range(len(kv.key))]
        if any(s != strides[0] for s in strides):
            raise ConfigError(f"{self.kernel_label}: the layers' KV caches must share one layout, got {strides}")
        return strides[0]

    def check_kv(self, kv) -> None:
        self._binding(kv)

    def _binding(self, kv) -> tuple[tuple[torch.Tensor, torch.Tensor], list[int]]:
        """The cache as the kernel addresses it: each layer's K and V as an element offset from
        layer 0's (int64 on the device) and the strides every layer shares, checked and computed
        once per binding of the cache (a step on the same cache checks nothing again; a replayed
        graph reads the same tensors)."""
        key = (kv.block_size, *((t.data_ptr(), *t.shape, *t.stride()) for t in (*kv.key, *kv.value)))
        if key != self._kv_key:
            strides = self._strides(kv)
            offs = []
            for caches in (kv.key, kv.value):
                base = caches[0].data_ptr()
                diffs = [(t.data_ptr() - base) for t in caches]
                if any(d % (2 * KV_OFFSET_MULTIPLE) for d in diffs):
                    raise ConfigError(
                        f"{self.kernel_label}: the layers' KV caches must start {2 * KV_OFFSET_MULTIPLE} bytes "
                        "apart or a multiple of that"
                    )
                offs.append(torch.tensor([d // 2 for d in diffs], dtype=torch.int64, device=self.device))
            if self._kv_offsets is not None:  # a graph captured on the old binding may still read them
                self._retired.append(self._kv_offsets)
            self._kv_key, self._kv_offsets, self._kv_strides = key, (offs[0], offs[1]), strides
        return self._kv_offsets, self._kv_strides

    # -- launches ------------------------------------------------------------------------------

    def _buffers_for(self, width: int, layers: int) -> _Buffers:
        key = (width, layers)
        if key not in self._buffers:
            self._buffers[key] = _Buffers(self.geometry[width], layers, self.device)
        return self._buffers[key]

    def _launch(self, first: int, layers: int, x: torch.Tensor, meta: Any, kv) -> torch.Tensor:
        """Layers ``first .. first + layers - 1`` over ``x`` (any rows up to the widest width)."""
        from monodecode.kernels.triton.step_kernel import step_kernel

        rows = x.shape[0]
        xp, mp, width = self._pad(x.to(torch.bfloat16), meta)
        fault_layer, fault_kind = 0, 0
        for kind, code in (("stall", 1), ("nonfinite", 2)):
            for n in range(first, first + layers):
                if self._take_fault(n, kind):
                    fault_layer, fault_kind = n - first + 1, code
        out = torch.empty(width, self.dims.hidden_size, dtype=torch.bfloat16, device=self.device)
        args, consts = self.arguments(first, layers, xp, _Meta(mp, self.device), kv, out, fault_layer, fault_kind)
        step_kernel[(self.programs,)](*args, **consts, num_warps=NUM_WARPS)
        return out if rows == width else out[:rows]

    def arguments(self, first, layers, x, meta, kv, out, fault_layer=0, fault_kind=0) -> tuple[list, dict]:
        """The kernel's runtime arguments in signature order, and its constexprs."""
        width = x.shape[0]
        if self._prof_layers and layers > self._prof_layers:
            raise ConfigError(
                f"{self.kernel_label}: the timeline holds {self._prof_layers} layers, the launch runs {layers}"
            )
        args = kernel_arguments(
            self, self._buffers_for(width, layers), first, layers, x, meta, (kv.key[0], kv.value[0]),
            *self._binding(kv), out, fault_layer, fault_kind,
        )  # fmt: skip
        return args, {**self.geometry[width].constexprs(self.req.block_size), "PROF": int(self._prof_layers > 0)}

    def enable_timeline(self, num_layers: int, on: bool = True) -> None:
        """Stamp every stage of every program from the next launch on (the benchmark's timeline
        plots; a build of its own per the ``PROF`` constexpr, which Triton's cache keeps), or, with
        ``on=False``, go back to the kernel without stamps."""
        from monodecode.kernels.triton.timeline import buffer_words

        if self.device.type != "cuda":
            raise ConfigError(f"{self.kernel_label}: stage timestamps need a CUDA device")
        words = buffer_words(num_layers, self.programs) if on else 1
        self.prof = torch.zeros(words, dtype=torch.int64, device=self.device)
        self._prof_layers = num_layers if on else 0

    def timeline(self, num_layers: int, rows: int):
        """The last launch's stamps as ``[layer, half, program, stage, (enter, ready, end, -)]``
        int64 ns (``decode_bench.timeline.STEP`` names the slots)."""
        from monodecode.kernels.triton.timeline import MAX_STAGES, SLOTS, buffer_words

        words = buffer_words(num_layers, self.programs)
        return self.prof[:words].view(num_layers, 2, self.programs, MAX_STAGES, SLOTS).cpu()

    def forward_layer(self, layer: int, x: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        return self._launch(layer, 1, x, meta, kv)

    def forward_step(self, x: torch.Tensor, metas: list, kv: Any) -> torch.Tensor | None:
        """Every layer in one launch; None when the layers' metadata differ (one launch reads one
        block table: the caller then runs ``forward_layer`` per layer)."""
        if any(m is not metas[0] for m in metas):
            return None
        return self._launch(0, self.num_layers, x, metas[0], kv)

    def close(self) -> None:
        self.weights = torch.zeros(1, dtype=torch.bfloat16)
        self.wscale = torch.ones(1, dtype=torch.float32)
        self._buffers = {}
        self._kv_key = self._kv_offsets = None
        self._retired = []


# -- compiled without a GPU (the CPU checks; same argument order as ``arguments``) ---------------

_STRIDES = ("k_sb", "k_st", "k_sh", "v_sb", "v_st", "v_sh")  # multiples of 16 (``kv_strides`` checks them)


def step_source(
    dims, width: int, programs: int, block_size: int, plan: dict | None = None, prof: bool = False,
    weight_dtype: str = "bf16",
):  # fmt: skip
    """The kernel's ``GluonASTSource`` for one width, its signature typed from ``kernel_arguments``
    over stand-in buffers of the launch's dtypes (pointers 16-byte aligned, as torch's buffers are
    and the launcher specialises them; the KV strides multiples of 16, the block table's any)."""
    from types import SimpleNamespace

    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from monodecode.kernels.triton.step_kernel import step_kernel

    g = StepGeometry(dims, width, programs, weight_dtype=weight_dtype, **checked_plan(plan))
    consts = {**g.constexprs(block_size), "PROF": int(prof)}
    t = lambda dt, *shape: torch.empty(*(shape or (1,)), dtype=dt, device="meta")  # noqa: E731
    bf, f32, i64, i32 = torch.bfloat16, torch.float32, torch.int64, torch.int32
    wt = TORCH_DTYPES[weight_dtype]
    blob = torch.empty(g.row_lcm, dtype=wt)  # (TMA views want real strides: whole rows of every view)
    norm = f32 if g.gemma else bf
    k = SimpleNamespace(
        weights=t(wt), descriptors=weight_descriptors(blob, dims), wscale=t(f32), gin=t(norm), gpost=t(norm), gpp=t(f32),
        qkn=t(f32), wnd=t(i32), inv_freq=t(f32), inv2=t(f32), health_word=t(i32), prof=t(i64), spin_limit=1000,
    )  # fmt: skip
    meta = SimpleNamespace(positions=t(i64, width), slot_mapping=t(i64, width), block_tables=t(i32, width, 7),
                           seq_lens=t(i32, width))  # fmt: skip
    runtime = kernel_arguments(
        k, _Buffers(g, 2, "meta"), 0, 2, t(bf), meta, (t(bf), t(bf)), (t(i64), t(i64)), [16] * 6, t(bf), 0, 0
    )
    names = [n for n in step_kernel.arg_names if n not in consts and n != "NW"]
    if len(names) != len(runtime):
        raise ValueError(f"step_kernel takes {len(names)} runtime arguments, kernel_arguments gives {len(runtime)}")
    sig, attrs = {name: "constexpr" for name in step_kernel.arg_names}, {}
    for name, v in zip(names, runtime):
        n = step_kernel.arg_names.index(name)
        if isinstance(v, torch.Tensor):
            sig[name] = POINTER_TYPES[v.dtype]
            attrs[(n,)] = [["tt.divisibility", 16]]
        elif isinstance(v, int):
            sig[name] = "i32"
            if name in _STRIDES:
                attrs[(n,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = mangle_type(v)
    return GluonASTSource(step_kernel, sig, constexprs={**consts, "NW": NUM_WARPS}, attrs=attrs)


def compile_step(
    dims, width: int, programs: int, block_size: int, plan: dict | None = None, prof: bool = False,
    weight_dtype: str = "bf16",
):  # fmt: skip
    """The kernel compiled for sm_90 on any machine (ptxas included): resources and spills."""
    import triton
    from triton.backends.compiler import GPUTarget

    src = step_source(dims, width, programs, block_size, plan, prof, weight_dtype)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
