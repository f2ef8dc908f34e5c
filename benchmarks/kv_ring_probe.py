"""The step launch's attention task alone, at each depth of its K/V ring (one GPU, sm_90).

The step launch (``step_kernel.py``) runs every attention task of a decode step on one program an
SM, its K and V tiles streaming through a ring of ``KVS`` shared-memory slots filled by
``cp.async`` ``KVS - 1`` tiles ahead (3 slots at head_dim 64, 2 at 128: what fits beside the weight
ring). At 32k x 8 that ring is the only thing in flight on an SM for most of the layer, and the step
reads the cache below the read probe (run 114: 1B's step 0.97x the strongest stock there). This
probe asks whether a deeper ring would read faster, before any build gives the weight ring's
shared memory to it: it launches the step kernel's own task (``_kv_first``'s tiles, then
``_attend``, the partials stored, no merge) as a plain grid of one program a task, each holding
at least 128 KiB of shared memory as the step's programs hold all of theirs (one program an SM),
over a paged cache of every row's ``--context`` (the reference's planes, or a head's positions of
a block together), for each ring depth and each step length (16 or 32 positions a warp: ``StepGeometry.kv_step``), the
ring's copies alone beside the whole task (``--tasks copy``: what the cache and the ring read with
no arithmetic), blocks shuffled (as the benchmark's allocator hands them out) or in order, and
prints the cache's bytes a microsecond (GB/s) beside a plain read of the same bytes (``torch.sum``
over the caches), and how far each variant's attention output (its splits' partials merged in
torch) is from the first variant's.

Usage (GPU machine, repository root): ``python benchmarks/kv_ring_probe.py [--profiles
llama3-1b,llama3-8b] [--batches 1,8] [--contexts 8192,32768] [--depths 2,3,4,6] [--layouts
planes,heads] [--warp-positions 16,32] [--tasks attend,copy] [--blocks shuffled,sequential]
[--out DIR]``. Inputs are random; the step launch's GPU tests check the task against the
reference, this probe only each variant against the first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from probe_results import write_rows  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

from monodecode.kernels.triton.step_kernel import _attend, _cos_sin, _kv_blocks, _kv_copy, _kv_span, _qkv_in  # noqa: E402
from monodecode.kernels.triton.step_plan import NUM_WARPS, StepGeometry  # noqa: E402
from monodecode.model.profiles import profile_dims  # noqa: E402

HOLD_BYTES = 128 * 1024  # a program's shared memory at least: more than half an SM's, so one an SM
HOLD_MOST = 220 * 1024  # ... at most: sm_90's 227 KiB a program, less room for RoPE's row and scratch
L2_FLUSH_BYTES = 256 * 1024 * 1024  # written before each timed launch: well past the H100's and H200's 50 MiB L2


@gluon.jit
def _task(act_ptr, part_ptr, kc_ptr, vc_ptr, k_sb, k_st, k_sh, v_sb, v_st, v_sh, bt_ptr, bt_stride, inv_ptr, ctx,
          slot, QH: gl.constexpr, KVH: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, SCALE: gl.constexpr,
          NSPLIT: gl.constexpr, KVS: gl.constexpr, SLOTS: gl.constexpr, NW: gl.constexpr, PW: gl.constexpr,
          COPY: gl.constexpr):  # fmt: skip
    """One attention task a program: row ``pid // (KVH * NSPLIT)``, task ``pid % (KVH * NSPLIT)``
    over ``ctx`` cached positions, ``PW`` a warp a step, through a ``KVS``-slot ring carved from
    ``SLOTS`` slots. ``COPY``: the ring's copies alone, each step's wait, barrier and next copy
    as ``_attend`` issues them, no arithmetic (what the cache and the ring read by themselves)."""
    G: gl.constexpr = QH // KVH
    QKVR: gl.constexpr = (QH + 2 * KVH) * D
    mma_sw: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])
    pid = gl.program_id(0)
    row = pid // (KVH * NSPLIT)
    task = pid % (KVH * NSPLIT)
    held = gl.allocate_shared_memory(gl.bfloat16, [2 * SLOTS, NW, PW, D], mma_sw)
    kvs = held._reinterpret(gl.bfloat16, [2 * KVS, NW, PW, D], mma_sw)
    cs = gl.allocate_shared_memory(gl.float32, [2 * D], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    _cos_sin(cs, ctx, inv_ptr, D, NW)
    gl.thread_barrier()
    kvh, sp, start, end = _kv_span(task, ctx, 0, NSPLIT, NW, PW)
    bt_row = bt_ptr + row.to(gl.int64) * bt_stride
    for t in gl.static_range(KVS - 1):  # the ring's first tiles, as _kv_first issues them
        b = start + t * NW * PW
        _kv_copy(kvs, t, kc_ptr, vc_ptr, 0, 0, _kv_blocks(bt_row, b, end, BS, NW, PW), kvh, b, end, k_sb, k_st, k_sh,
                 v_sb, v_st, v_sh, BS, D, NW, PW)  # fmt: skip
    bnext = _kv_blocks(bt_row, start + (KVS - 1) * NW * PW, end, BS, NW, PW)
    if COPY:
        i = 0
        for b in range(start, end, NW * PW):
            async_copy.wait_group(KVS - 2)
            gl.thread_barrier()
            nb = b + (KVS - 1) * NW * PW
            _kv_copy(kvs, (i + KVS - 1) % KVS, kc_ptr, vc_ptr, 0, 0, bnext, kvh, nb, end, k_sb, k_st, k_sh, v_sb, v_st,
                     v_sh, BS, D, NW, PW)  # fmt: skip
            bnext = _kv_blocks(bt_row, nb + NW * PW, end, BS, NW, PW)
            i += 1
    else:  # (the step kernel asks for q, k and v before the first tiles' copies: here after them)
        qx, qr, kx, kr, vn = _qkv_in(act_ptr + row * QKVR, kvh, QH, KVH, D, NW)
        _attend(qx, qr, kx, kr, vn, kc_ptr, vc_ptr, 0, 0, cs, part_ptr + row * (KVH * NSPLIT * G * (D + 2)), bt_row,
                bnext, task, ctx, slot, kvs, k_sb, k_st, k_sh, v_sb, v_st, v_sh, QH, KVH, D, BS,
                SCALE, NSPLIT, KVS, NW, PW)  # fmt: skip
    async_copy.wait_group(0)


def _time_us(fn, flush: torch.Tensor, reps: int = 20) -> float:
    """Median µs of ``fn`` over ``reps`` launches, L2 overwritten by ``flush`` before each (a
    1-row cache fits in L2)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def held_slots(kvs: int, pw: int, d: int) -> int | None:
    """The K/V slots a program allocates for a ``kvs``-slot ring of ``pw`` positions a warp at
    head_dim ``d``: ``kvs``, or more up to ``HOLD_BYTES``; None where ``kvs`` do not fit."""
    slot = 2 * NUM_WARPS * pw * d * 2  # a K tile and its V tile, bf16
    slots = max(kvs, -(-HOLD_BYTES // slot))
    return slots if slots * slot <= HOLD_MOST else None


def _merged(part: torch.Tensor) -> torch.Tensor:
    """The attention output from the splits' partials ([rows, KV heads, splits, G, D + 2]: each
    split's sum of exp-weighted V rows at its max, the max, the weights' sum), merged in torch."""
    o, m, l = part[..., :-2], part[..., -2], part[..., -1]
    w = torch.exp(m - m.amax(dim=2, keepdim=True))
    return (w[..., None] * o).sum(2) / (w * l).sum(2)[..., None]


def run_cell(
    profile: str,
    batch: int,
    context: int,
    depths: list[int],
    layout: str = "planes",
    steps: tuple[int, ...] = (16,),
    tasks: tuple[str, ...] = ("attend",),
    blocks: str = "shuffled",
    block_size: int = 16,
) -> list[dict]:
    dims = profile_dims(profile)
    d, kvh, qh = dims.head_dim, dims.num_kv_heads, dims.num_heads
    splits = StepGeometry(dims, batch, torch.cuda.get_device_properties(0).multi_processor_count).splits
    blocks_per_row = -(-context // block_size)
    nblocks = batch * blocks_per_row + 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(nblocks, block_size, kvh, d, device="cuda", generator=gen).to(torch.bfloat16)
    vc = torch.randn(nblocks, block_size, kvh, d, device="cuda", generator=gen).to(torch.bfloat16)
    if layout == "heads":  # a head's positions of a block together ([blocks, KV heads, block, D], same strides' names)
        kc = kc.transpose(1, 2).contiguous().transpose(1, 2)
        vc = vc.transpose(1, 2).contiguous().transpose(1, 2)
    order = (
        torch.randperm(nblocks - 1, device="cuda", generator=gen) if blocks == "shuffled" else torch.arange(nblocks - 1)
    )
    bt = (order[: batch * blocks_per_row] + 1).to(device="cuda", dtype=torch.int32)
    bt = bt.view(batch, blocks_per_row).contiguous()
    act = torch.randn(batch, (qh + 2 * kvh) * d, device="cuda", generator=gen) * 0.1
    part = torch.empty(batch * kvh * splits * (qh // kvh) * (d + 2), device="cuda")
    inv = torch.tensor(dims.rope_for_layer(0).inv_freq(d), dtype=torch.float32, device="cuda")
    ctx = context - 1  # cached positions before the new one
    kv_bytes = 2 * batch * ctx * kvh * d * 2
    out = []
    flush = torch.empty(L2_FLUSH_BYTES // 4, device="cuda")
    plain = _time_us(lambda: (kc.sum(dtype=torch.float32), vc.sum(dtype=torch.float32)), flush)
    base = None  # the first variant's merged output: every other one is checked against it
    for task, pw, kvs in [(t, p, k) for t in tasks for p in steps for k in depths]:
        slots = held_slots(kvs, pw, d)
        cell = {"profile": profile, "batch": batch, "context": context, "layout": layout, "blocks": blocks,
                "task": task, "warp_positions": pw, "kv_slots": kvs}  # fmt: skip
        if slots is None:
            out.append({**cell, "skipped": "no room"})
            continue
        grid = (batch * kvh * splits,)

        def launch(kvs=kvs, slots=slots, pw=pw, copy=int(task == "copy")):
            _task[grid](act, part, kc, vc, *kc.stride()[:3], *vc.stride()[:3], bt, bt.stride(0), inv, ctx, -1,
                        QH=qh, KVH=kvh, D=d, BS=block_size, SCALE=dims.attn_scale, NSPLIT=splits, KVS=kvs,
                        SLOTS=slots, NW=NUM_WARPS, PW=pw, COPY=copy, num_warps=NUM_WARPS)  # fmt: skip

        part.fill_(float("nan"))  # what a copy-only task leaves: no number to compare
        us = _time_us(launch, flush)
        err = None
        if task == "attend":
            merged = _merged(part.view(batch, kvh, splits, qh // kvh, d + 2))
            base = merged if base is None else base
            err = ((merged - base).norm() / base.norm()).item()
        out.append({**cell, "splits": splits, "programs": grid[0], "us": us, "kv_gbs": kv_bytes / us / 1e3,
                    "plain_sum_gbs": 2 * kc.numel() * 2 / plain / 1e3, "rel_diff_vs_first": err})  # fmt: skip
        r = out[-1]
        diff = "" if err is None else f", relative difference from the first {err:.1e}"
        print(f"{profile} b{batch} ctx {context} {layout} {blocks} {task}: {pw} positions a warp, {kvs} slots "
              f"{us:8.1f} us {r['kv_gbs']:6.0f} GB/s (torch.sum over the caches {r['plain_sum_gbs']:6.0f} GB/s)"
              f"{diff}", flush=True)  # fmt: skip
    return out


def _ints(lo: int, hi: int, step: int = 1):
    """argparse type: comma-separated integers from ``lo`` to ``hi``, multiples of ``step``."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
        if not values or any(not lo <= v <= hi or v % step for v in values):
            kind = f"{lo} to {hi}" if step == 1 else f"multiples of {step} from {lo} to {hi}"
            raise argparse.ArgumentTypeError(f"values must be {kind}, got {text!r}")
        return values

    return parse


def _names(known: tuple[str, ...]):
    """argparse type: comma-separated names from ``known``."""

    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        if not names or (bad := [x for x in names if x not in known]):
            raise argparse.ArgumentTypeError(f"{(bad or [text])[0]!r} is not one of {', '.join(known)}")
        return names

    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", type=_names(("llama3-1b", "llama3-8b")), default="llama3-1b,llama3-8b")
    ap.add_argument("--batches", type=_ints(1, 8), default="1,8")
    ap.add_argument("--contexts", type=_ints(2, 1 << 20), default="8192,32768")
    ap.add_argument("--depths", type=_ints(2, 8), default="2,3,4,6", help="K/V ring slots")
    ap.add_argument("--warp-positions", type=_ints(16, 32, 16), default="16,32", help="positions a warp's step reads "
                    "(16 or 32: StepGeometry.kv_step 1 or 2)")  # fmt: skip
    ap.add_argument("--tasks", type=_names(("attend", "copy")), default="attend,copy", help="attend: the step's "
                    "task; copy: its K/V ring's copies alone")  # fmt: skip
    ap.add_argument("--blocks", type=_names(("shuffled", "sequential")), default="shuffled", help="cache blocks "
                    "handed out in a random order (as the benchmark's allocator) or in order")  # fmt: skip
    ap.add_argument("--layouts", type=_names(("planes", "heads")), default="planes,heads", help="planes: [blocks, "
                    "block, KV heads, D] (the reference's and vLLM's order); heads: [blocks, KV heads, block, D]")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results/kv_ring_probe")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("error: kv_ring_probe needs an sm_90 or newer GPU", file=sys.stderr)
        return 2
    rows = []
    for p in a.profiles:
        for b in a.batches:
            for c in a.contexts:
                for lay in a.layouts:
                    for order in a.blocks:
                        rows += run_cell(p, b, c, a.depths, lay, a.warp_positions, a.tasks, order)
    print(write_rows(a.out, "kv_ring_probe", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
