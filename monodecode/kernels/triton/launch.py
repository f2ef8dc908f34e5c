"""Host side of the Triton K1/K2: weight packing, the scratch buffer, and the launches.

Everything a launch touches has a fixed device address after build (weights, scratch, per-width
attention buffers), and nothing on the host depends on device values, so ``forward_layer`` can
be captured in a CUDA graph and replayed. Widths are padded with inert rows (slot -1).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from monodecode.errors import ConfigError
from monodecode.kernels.base import BuildRequest
from monodecode.kernels.padded import TwoLaunchKernels
from monodecode.kernels.plan import K1, K2
from monodecode.kernels.triton.args import k1_args, k2_args, ka_args, kv_strides, pack_layer
from monodecode.kernels.triton.config import (
    REGS_PER_SM,
    SMEM_PER_SM,
    Target,
    attn_launch_on_layer,
    check_dims,
    compile_options,
    constexprs,
    cuda_programs_per_sm,
    k2_arrive_counters,
    plan_for,
    prof_grid,
    residency_misfits,
)

# A volatile poll of an L2-resident word takes roughly half a microsecond; the spin budget is
# the wait timeout in polls.
_POLL_SECONDS = 0.5e-6


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _Meta:
    """Decode metadata in the dtypes the kernels read (int64 positions/slots, int32 tables/lengths)."""

    def __init__(self, meta, device):
        self.positions = meta.positions.to(device=device, dtype=torch.int64).contiguous()
        self.slot_mapping = meta.slot_mapping.to(device=device, dtype=torch.int64).contiguous()
        self.block_tables = meta.block_tables.to(device=device, dtype=torch.int32).contiguous()
        self.seq_lens = meta.seq_lens.to(device=device, dtype=torch.int32).contiguous()


class TritonKernels(TwoLaunchKernels):
    """K1/K2 for every built width of one model on one device."""

    kernel_label = "triton kernels"

    def __init__(self, req: BuildRequest, weights: Any, target: Target, num_programs: int, device, share: Any = None):
        """``num_programs``: the SMs (each width's grid has ``Target.programs_per_sm`` programs on
        each). ``share``: another TritonKernels of the same weights whose packed layers this one
        reuses (the benchmark's launch-target variants; no second copy of the fused QKV weights)."""
        dims = req.dims
        check_dims(dims, req.widths)
        self.req = req
        self.dims = dims
        self.widths = req.widths
        self.target = target
        self.device = torch.device(device)
        self.interpret = interpreting()
        self.fp8 = req.weight_dtype in ("fp8", "fp8_fnuz")
        self.plan = plan_for(dims, req.widths, num_programs, target, req.tp_size, self.fp8)
        # The persistent grids (K1's, K2's) of each width. The interpreter runs programs one after
        # another: one instance plays all of them (``VP``), stage by stage.
        self.grids = {w: (self.plan.layers[w].workgroups(K1), self.plan.layers[w].workgroups(K2)) for w in req.widths}
        self.num_programs = max(prof_grid(self.plan.layers[w]) for w in req.widths)  # the timeline's program slots
        have = weights.layers[0].q_proj.kind if weights.layers else req.weight_dtype
        if have != req.weight_dtype:
            raise ConfigError(f"triton kernels: built for {req.weight_dtype} weights but the model has {have}")
        self.consts = {
            w: constexprs(dims, self.plan, w, target, req.block_size, self.fp8, self.interpret) for w in req.widths
        }
        if share is not None:
            self.layers = share.layers
        else:
            self.layers = [pack_layer(dims, l, w, self.device) for l, w in enumerate(weights.layers)]
        self.scratch = torch.zeros(self.plan.scratch.nbytes // 8, dtype=torch.int64, device=self.device)
        self.health_word = self.scratch.view(torch.int32)[:1]  # header region "health" at offset 0
        self.prof = self.scratch[:1]  # timestamp buffer (``enable_timeline``); unused while compiled out
        self.attn = {w: torch.zeros(w, dims.q_size, dtype=torch.bfloat16, device=self.device) for w in req.widths}
        # the attention launch's split partials and per-(row, KV head) arrival counters (``ka.py``)
        self.ka_bufs = {w: self._ka_buffers(w) for w in req.widths if len(self.consts[w]) > 2}
        self.ka_layers = [attn_launch_on_layer(target, L.window) for L in self.layers]
        # K2's arrival counters of split row tiles (``Target.split_k_merge``; each launch leaves them at zero)
        self.k2_arrive = {
            w: torch.zeros(
                max(1, k2_arrive_counters(self.plan.layers[w], target)), dtype=torch.int32, device=self.device
            )
            for w in req.widths
        }
        self.spin_limit = min(2**31 - 1, max(1000, int(req.wait_timeout_s / _POLL_SECONDS)))
        self._compiled = {} if self.interpret else self._compile(req)
        self.residency = self._residency()
        from monodecode.kernels.triton.k1 import k1_kernel
        from monodecode.kernels.triton.k2 import k2_kernel
        from monodecode.kernels.triton.ka import ka_kernel

        self._kernels = (k1_kernel, k2_kernel, ka_kernel)
        self._arg_names = tuple(list(k.arg_names) for k in self._kernels)

    def _ka_buffers(self, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The attention launch's partials, arrival counters and grid (one program per task)."""
        c = self.consts[width][2]
        part = torch.zeros(width * c["H"] * c["S"] * (c["D"] + 2), dtype=torch.float32, device=self.device)
        arrive = torch.zeros(width * c["KVH"], dtype=torch.int32, device=self.device)
        return part, arrive, width * c["KVH"] * c["S"]

    def enable_timeline(self, num_layers: int, on: bool = True) -> None:
        """Recompile with the stage timestamps on (``timeline.py``; CUDA only, for the
        benchmark's timeline plots): every launch then writes its programs' stamps. ``on=False``
        goes back to the kernels without them."""
        from monodecode.kernels.triton.timeline import buffer_words

        if self.interpret or self.target.kind != "cuda":
            raise ConfigError("triton kernels: stage timestamps need a compiled CUDA build")
        words = buffer_words(num_layers, self.num_programs) if on else 1
        self.prof = torch.zeros(words, dtype=torch.int64, device=self.device)
        self.consts = {
            w: constexprs(self.dims, self.plan, w, self.target, self.req.block_size, self.fp8, prof=on)
            for w in self.widths
        }
        self._compiled = self._compile(self.req, prof=on)
        self.residency = self._residency()

    def timeline(self, num_layers: int, rows: int):
        """The stamps of the last step of ``rows`` rows as ``[layer, kernel, program, stage,
        (enter, ready, end, -)]`` int64 ns (the program slots of that step's width, ``prof_grid``:
        those past a kernel's grid stay 0)."""
        from monodecode.kernels.triton.timeline import MAX_STAGES, SLOTS, buffer_words

        grid = prof_grid(self.plan.layers[self._width(rows)])
        return self.prof[: buffer_words(num_layers, grid)].view(num_layers, 2, grid, MAX_STAGES, SLOTS).cpu()

    def _compile(self, req: BuildRequest, prof: bool = False) -> dict:
        """Compile K1/K2 of every width (Triton's cache makes a rebuild cheap)."""
        import triton

        from monodecode.kernels.triton.sources import kernel_sources

        gpu = triton.runtime.driver.active.get_current_target()
        out = {}
        for w in req.widths:
            srcs = kernel_sources(self.dims, req.weight_dtype, w, req.block_size, self.plan, self.target, prof)
            out[w] = tuple(
                triton.compile(src, target=gpu, options=compile_options(self.target, w, name, self.fp8))
                for name, src in srcs
            )
        return out

    def _residency(self) -> dict[int, dict[str, int]]:
        """Programs per SM each compiled launch of each width holds on this GPU (k1, k2, ka),
        from its registers, warps and shared memory (CUDA only; {} otherwise)."""
        if self.interpret or self.target.kind != "cuda":
            return {}
        props = torch.cuda.get_device_properties(self.device)
        regs = getattr(props, "regs_per_multiprocessor", 0) or REGS_PER_SM
        smem = getattr(props, "shared_memory_per_multiprocessor", 0) or SMEM_PER_SM
        out = {}
        for w, compiled in self._compiled.items():
            out[w] = {}
            for name, k in zip(("k1", "k2", "ka"), compiled):
                k._init_handles()  # loads the binary (as the first launch would): its register count
                out[w][name] = cuda_programs_per_sm(k.n_regs, k.metadata.num_warps, k.metadata.shared, regs, smem)
        return out

    def residency_misfits(self, width: int | None = None) -> list[str]:
        """Launches (of ``width``, or of every width) that hold fewer programs per SM on this GPU
        than their plan is made for (``config.residency_misfits``); [] where all fit or nothing
        was compiled."""
        return [
            m
            for w, resident in self.residency.items()
            if width in (None, w)
            for m in residency_misfits(self.target, self.plan.layers[w], self.fp8, resident)
        ]

    def _run(self, which: int, width: int, args: list, grid: int = 0) -> None:
        """Launch kernel ``which`` (0 K1, 1 K2, 2 the attention launch) on ``grid`` programs
        (0: the kernel's persistent grid at that width)."""
        grid = grid or (1 if self.interpret else self.grids[width][which])
        if self.interpret:
            self._kernels[which][(grid,)](*args, **self.consts[width][which])
            return
        for a in args:
            if isinstance(a, torch.Tensor) and a.data_ptr() % 16:
                raise ConfigError("triton kernels: every tensor argument must be 16-byte aligned")
        # a compiled kernel's launcher takes every argument in signature order, constexprs included
        names, consts = self._arg_names[which], self.consts[width][which]
        it = iter(args)
        full = [consts[n] if n in consts else next(it) for n in names]
        self._compiled[width][which][(grid, 1, 1)](*full)

    # -- launches ------------------------------------------------------------------------------

    def _launch_meta(self, meta):
        return _Meta(meta, self.device)

    def _kv_strides(self, layer: int, kv) -> list[int]:
        if kv.block_size != self.req.block_size:
            raise ConfigError(
                f"triton kernels: built for KV block size {self.req.block_size}, cache has {kv.block_size}"
            )
        return kv_strides(kv.key[layer], kv.value[layer], self.dims, self.req.block_size)

    def check_kv(self, kv) -> None:
        for layer in range(len(kv.key)):
            self._kv_strides(layer, kv)

    def _launch_k1(self, layer, x, meta, kv, width, stall=0):
        st = self._kv_strides(layer, kv)
        out = self.attn[width]
        kc, vc = kv.key[layer], kv.value[layer]
        args = k1_args(
            self.layers[layer],
            x,
            kc,
            vc,
            st,
            meta,
            out,
            self.scratch,
            self.health_word,
            self.prof,
            layer,
            self.spin_limit,
            stall,
            self.dims,
        )
        self._run(0, width, args)
        if width in self.ka_bufs and self.ka_layers[layer]:
            part, arrive, grid = self.ka_bufs[width]
            ka = ka_args(self.layers[layer], kc, vc, st, meta, out, self.scratch, self.health_word, part, arrive,
                         layer, self.spin_limit, self.dims)  # fmt: skip
            self._run(2, width, ka, grid=grid)
        return out

    def _launch_k2(self, layer, x, attn, width, nan_fault=0):
        out = torch.empty(width, self.dims.hidden_size, dtype=torch.bfloat16, device=self.device)
        args = k2_args(
            self.layers[layer],
            x,
            attn,
            out,
            self.scratch,
            self.health_word,
            self.prof,
            self.k2_arrive[width],
            layer,
            self.spin_limit,
            nan_fault,
            self.dims,
        )
        self._run(1, width, args)
        return out

    def close(self) -> None:
        self.layers = []
        self.scratch = torch.zeros(1, dtype=torch.int64)
        self.attn = {}
        self.ka_bufs = {}
        self.k2_arrive = {}
