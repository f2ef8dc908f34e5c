"""K1's attention stage alone, under launch settings K1 cannot vary per stage (one GPU).

K1 runs its attention tasks (``attention.attn_task``) inside a persistent launch whose warp
count the GEMV stages choose. This probe launches the same task function as a plain grid (one
program per task) for one profile and batch, over a paged cache of each ``--context`` (comma separated), and
times it per setting: warps, context positions per tile, pipelining depth, and the cache layout
(the reference's planes ``[blocks, block, kv_heads, head_dim]``, vLLM 0.33's interleaved K|V views,
or one head's positions contiguous). The timed launches cycle through several layers' caches
(``L2_FLUSH_BYTES`` in all), so the KV streams from HBM as in a decode step. It prints µs per
stage and the KV bytes' bandwidth, and writes the table as JSON. ``--sdpa`` adds the bar: PyTorch's
fused SDPA (flash) over contiguous caches of the same bytes. Inputs are random; the published partials are not checked here (the
GPU numerics tests cover the stage inside K1).

Usage (GPU machine, repository root): ``python benchmarks/attention_probe.py --profile gemma3-27b
--batch 2,8 [--layouts vllm] [--warps 4,8] [--tiles 64,128] [--stages 3,5] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from monodecode.kernels.plan import attention_splits  # noqa: E402
from monodecode.kernels.triton.attention import attn_task  # noqa: E402
from monodecode.model.profiles import profile_dims  # noqa: E402


@triton.jit
def _attn_grid(
    qkv,
    acc,
    ml,
    qn,
    kn,
    inv,
    kc,
    vc,
    k_sb,
    k_st,
    k_sh,
    v_sb,
    v_st,
    v_sh,
    pos,
    slot,
    bt,
    bt_stride,
    seq,
    window,
    tag,
    health,
    bad_code,
    scale,
    NQKV: tl.constexpr,
    Q: tl.constexpr,
    KV: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    KVH: tl.constexpr,
    H: tl.constexpr,
    S: tl.constexpr,
    BS: tl.constexpr,
    BT: tl.constexpr,
    QK_NORM: tl.constexpr,
    STAGES: tl.constexpr,
):
    attn_task(
        tl.program_id(0),
        qkv,
        acc,
        ml,
        (qn, kn, inv),
        (kc, vc, k_sb, k_st, k_sh, v_sb, v_st, v_sh),
        (pos, slot, bt, bt_stride, seq, window),
        1e-6,
        scale,
        tag,
        health,
        bad_code,
        (NQKV, Q, KV, D, G, GP, KVH, H, S, BS, BT),
        QK_NORM,
        False,
        True,
        STAGES,
    )


L2_FLUSH_BYTES = 256 << 20  # KV bytes the timed launches cycle through: several times an H200's L2


def _caches(layout: str, blocks: int, bs: int, kvh: int, d: int, device: str):
    """K and V views of shape [blocks, bs, kvh, d] in one of three memory layouts."""
    dt = torch.bfloat16
    if layout == "planes":  # the reference's cache
        return tuple(torch.randn(blocks, bs, kvh, d, device=device, dtype=dt) for _ in range(2))
    if layout == "vllm":  # K|V interleaved per head (token stride kvh*2*d)
        kv = torch.randn(blocks, bs, kvh, 2, d, device=device, dtype=dt)
        return kv[:, :, :, 0, :], kv[:, :, :, 1, :]
    # one head's positions of a block contiguous: [blocks, kvh, bs, d] seen as [blocks, bs, kvh, d]
    return tuple(torch.randn(blocks, kvh, bs, d, device=device, dtype=dt).transpose(1, 2) for _ in range(2))


@dataclass
class Setup:
    """One profile and batch: the launches' arguments (one per cache), the shape constexprs, the
    grid and the KV bytes one launch reads."""

    launches: list[tuple]
    consts: dict
    tasks: int
    kv_bytes: int


def setup(
    profile: str, batch: int, context: int, grid_sms: int, layout: str, device: str = "cuda", splits: int = 0
) -> Setup:
    """Random inputs for ``batch`` rows of ``context`` positions over scattered cache blocks, and
    as many layers' caches as keep the KV out of L2 when the launches cycle through them (one
    cache replayed sits in L2 up to its size: run 26 measured that as a false gain). ``splits``:
    context splits per (row, KV head); 0: K1's (``plan.attention_splits``, one wave of the grid)."""
    dims = profile_dims(profile)
    d, kvh, heads = dims.head_dim, dims.num_kv_heads, dims.num_heads
    q, kv, bs = heads * d, kvh * d, 16
    splits = splits or attention_splits(batch, kvh, grid_sms)
    per_row = -(-context // bs)
    blocks = per_row * batch + 1
    kv_bytes = batch * context * kv * 2 * 2
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    perm = torch.randperm(blocks - 1, device=device).to(i32)  # scattered blocks, as in a real pool
    bt = perm[: batch * per_row].view(batch, per_row).contiguous()
    inputs = (
        torch.randn(batch, q + 2 * kv, device=device).to(torch.bfloat16),  # q|k|v rows
        torch.zeros(batch * heads * splits * d, device=device, dtype=f32),  # partials
        torch.zeros(batch * heads * splits * 2, device=device, dtype=f32),
        torch.ones(d, device=device, dtype=torch.bfloat16),  # q-norm
        torch.ones(d, device=device, dtype=torch.bfloat16),  # k-norm
        torch.rand(d // 2, device=device, dtype=f32),  # inv_freq
    )
    common = (
        torch.full((batch,), context - 1, device=device, dtype=i64),  # positions
        (bt[:, -1].to(i64) * bs + (context - 1) % bs).contiguous(),  # slots
        bt,
        bt.stride(0),
        torch.full((batch,), context, device=device, dtype=i32),  # seq lens
        0,  # window
        1,  # tag
        torch.zeros(1, device=device, dtype=i32),  # health
        0,  # bad code
        0.08,  # scale
    )
    caches = [_caches(layout, blocks, bs, kvh, d, device) for _ in range(max(1, -(-L2_FLUSH_BYTES // kv_bytes)))]
    launches = [
        (*inputs, kc, vc, kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), *common)
        for kc, vc in caches
    ]
    consts = dict(
        NQKV=q + 2 * kv, Q=q, KV=kv, D=d, G=heads // kvh, GP=max(16, triton.next_power_of_2(heads // kvh)),
        KVH=kvh, H=heads, S=splits, BS=bs, QK_NORM=dims.qk_norm,
    )  # fmt: skip
    return Setup(launches, consts, batch * kvh * splits, kv_bytes)


def probe(profile: str, batch: int, context: int, grid_sms: int, reps: int, grid: dict) -> list[dict]:
    rows = []
    for layout, splits in itertools.product(grid["layouts"], grid["splits"]):
        su = setup(profile, batch, context, grid_sms, layout, splits=splits)  # one set of caches each
        for warps, bt_tile, stages in itertools.product(grid["warps"], grid["tiles"], grid["stages"]):
            rows.append(_time(su, layout, warps, bt_tile, stages, reps))
            print(json.dumps(rows[-1]), flush=True)
        del su
    if grid["sdpa"]:
        rows.append(_time_sdpa(profile, batch, context, reps))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _time_sdpa(profile: str, batch: int, context: int, reps: int) -> dict:
    """The bar: PyTorch's fused SDPA (flash) over contiguous ``[batch, kv_heads, context, head_dim]``
    caches with ``enable_gqa``, one query position per row, the same KV bytes, cycled out of L2."""
    dims = profile_dims(profile)
    d, kvh, heads = dims.head_dim, dims.num_kv_heads, dims.num_heads
    kv_bytes = batch * context * kvh * d * 2 * 2
    n = max(1, -(-L2_FLUSH_BYTES // kv_bytes))
    dt = torch.bfloat16
    q = torch.randn(batch, heads, 1, d, device="cuda", dtype=dt)
    caches = [tuple(torch.randn(batch, kvh, context, d, device="cuda", dtype=dt) for _ in range(2)) for _ in range(n)]
    out = torch.empty_like(q)

    def step(i: int) -> None:
        k, v = caches[i % n]
        out.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))

    step(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(20):
            step(i)
    us = _replay_us(graph, reps)
    return {"layout": "sdpa_contiguous", "us": round(us, 2), "kv_gbs": round(kv_bytes / us / 1e3, 1)}


def _replay_us(graph, reps: int) -> float:
    """Median µs of one of the graph's 20 launches over ``reps`` replays."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / 20)
    return sorted(times)[len(times) // 2] * 1e6


def _time(su: Setup, layout: str, warps: int, bt_tile: int, stages: int, reps: int) -> dict:
    """One setting: the median µs of a launch over ``reps`` replays of 20 launches in a graph."""
    row = {"layout": layout, "warps": warps, "tile": bt_tile, "stages": stages}
    consts = {**su.consts, "BT": bt_tile, "STAGES": stages}
    tasks = (su.tasks,)
    try:
        _attn_grid[tasks](*su.launches[0], **consts, num_warps=warps)
        torch.cuda.synchronize()
    except Exception as e:  # a setting that does not compile or fit: one line, go on
        return {**row, "error": str(e)[:160]}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(20):
            _attn_grid[tasks](*su.launches[i % len(su.launches)], **consts, num_warps=warps)
    us = _replay_us(graph, reps)
    return {**row, "us": round(us, 2), "kv_gbs": round(su.kv_bytes / us / 1e3, 1), "tasks": su.tasks,
            "splits": su.consts["S"], "caches": len(su.launches)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="gemma3-27b")
    ap.add_argument("--batch", default="8", help="batches, comma separated")
    ap.add_argument("--layouts", default="planes,vllm,head_major")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--tiles", default="64,128")
    ap.add_argument("--stages", default="3,5")
    ap.add_argument("--splits", default="0", help="context splits per (row, KV head); 0: K1's")
    ap.add_argument("--sdpa", action="store_true", help="also time PyTorch's SDPA over the same bytes")
    ap.add_argument("--context", default="1024", help="contexts, comma separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = {
        "layouts": a.layouts.split(","),
        "warps": [int(v) for v in a.warps.split(",")],
        "tiles": [int(v) for v in a.tiles.split(",")],
        "stages": [int(v) for v in a.stages.split(",")],
        "splits": [int(v) for v in a.splits.split(",")],
        "sdpa": a.sdpa,
    }
    for context, batch in itertools.product(
        [int(v) for v in a.context.split(",")], [int(v) for v in a.batch.split(",")]
    ):
        rows = probe(a.profile, batch, context, sms, a.reps, grid)
        if a.out:
            out = Path(a.out) / f"attention_probe_{a.profile}_c{context}_b{batch}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            meta = {"profile": a.profile, "batch": batch, "context": context}
            out.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
