"""The step launch's width-1 arithmetic on one weight chunk, alone (one GPU, sm_90).

At width 1 each program of the step launch (``step_kernel.py``) multiplies a [16, 1024] weight
chunk from its shared-memory ring by the staged input row, FMA in fp32, 8 warps an SM; around
that arithmetic each chunk pays fixed costs (its ring slot's wait, the barriers, the refill's
issue). Run 137 timed FP8's 16 KiB chunks at 1.12 µs each on gate/up (1.87 TB/s). This probe asks
how much of that is the arithmetic: one program an SM loops ``--chunks`` times over four chunks
resident in shared memory (no HBM, no waits but one barrier a chunk, as the step has), reading
the weights in the step's register layout and widening them as the step does (bf16, or e4m3 by
``.to(float32)``), and prints the SM cycles a chunk (``%clock64``) and the result's error against
torch.

Usage (GPU machine, repository root): ``python benchmarks/chunk_probe.py [--dtypes bf16,fp8]
[--chunks 2000] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import sys

import torch
from probe_results import write_rows
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

SLOTS = 4  # chunks resident in shared memory, walked in turn
ROWS, BK = 16, 1024  # a weight chunk (``step_plan.ROWS``, ``BK``)
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@gluon.jit
def chunk_loop(w_ptr, x_ptr, out_ptr, t_ptr, N: gl.constexpr, NW: gl.constexpr):
    """``N`` chunks of the step's width-1 arithmetic (``acc += W[16, 1024] * x``, the layout
    ``step_kernel``'s ``cp_lay``) over ``SLOTS`` chunks in shared memory; the row sums to
    ``out[pid]`` and the loop's SM cycles to ``t[pid]``."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])
    col: gl.constexpr = gl.SliceLayout(0, lay)
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, lay))[:, None]
    c = gl.arange(0, 1024, layout=col)
    ring = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [4, 16, 1024], gl.SwizzledSharedLayout(8, 1, 1, [1, 0]))
    xs = gl.allocate_shared_memory(gl.bfloat16, [4, 1024], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for s in gl.static_range(4):
        ring.index(s).store(gl.load(w_ptr + s * 16384 + r * 1024 + c[None, :]))
        xs.index(s).store(gl.load(x_ptr + s * 1024 + c))
    gl.thread_barrier()
    acc = gl.zeros([16, 1024], gl.float32, lay)
    t0 = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    for i in range(N):
        gl.thread_barrier()  # the step's one barrier a chunk
        acc += ring.index(i % 4).load(lay).to(gl.float32) * xs.index(i % 4).load(col).to(gl.float32)[None, :]
    gl.thread_barrier()
    t1 = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    pid = gl.program_id(0)
    gl.store(out_ptr + pid * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, lay)), gl.sum(acc, axis=1))
    gl.store(t_ptr + pid, t1 - t0)


def run(dtype: str, chunks: int) -> dict:
    """One dtype's cycles a chunk (mean over the SMs) and relative error against torch."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(SLOTS * ROWS * BK, generator=g, device=dev) * 0.5).to(DTYPES[dtype])
    x = torch.randn(SLOTS * BK, generator=g, device=dev).to(torch.bfloat16)
    out = torch.zeros(sms * ROWS, device=dev)
    t = torch.zeros(sms, dtype=torch.int64, device=dev)
    for _ in range(2):  # the first launch compiles
        chunk_loop[(sms,)](w, x, out, t, N=chunks, NW=8, num_warps=8)
    torch.cuda.synchronize()
    per_slot = (w.float().view(SLOTS, ROWS, BK) * x.float().view(SLOTS, 1, BK)).sum(-1)
    want = sum(per_slot[i % SLOTS] for i in range(SLOTS)) * (chunks // SLOTS) + sum(
        per_slot[i % SLOTS] for i in range(chunks % SLOTS)
    )
    got = out.view(sms, ROWS)
    err = ((got - want).norm(dim=1) / want.norm()).max().item()
    cycles = t.double().mean().item() / chunks
    return {"dtype": dtype, "chunks": chunks, "cycles_per_chunk": cycles, "rel_err": err, "sms": sms}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bf16,fp8", help=f"weight dtypes, of: {', '.join(DTYPES)}")
    ap.add_argument("--chunks", type=int, default=2000)
    ap.add_argument("--out", default="benchmarks/results/chunk_probe")
    a = ap.parse_args(argv)
    dtypes = [d for d in a.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in DTYPES] or ([] if dtypes else [a.dtypes])
    if bad:
        print(f"error: --dtypes: {bad[0]!r} is not one of {', '.join(DTYPES)}", file=sys.stderr)
        return 2
    if not 1 <= a.chunks <= 1_000_000:
        print(f"error: --chunks must be 1 to 1000000, got {a.chunks}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("error: chunk_probe needs an sm_90 or newer GPU", file=sys.stderr)
        return 2
    rows = [run(d, a.chunks) for d in dtypes]
    for r in rows:
        print(f"{r['dtype']}: {r['cycles_per_chunk']:.0f} SM cycles a [16, 1024] chunk, rel err {r['rel_err']:.1e}")
    print(write_rows(a.out, "chunk_probe", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
