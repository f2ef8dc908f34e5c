"""One GEMV stage of K1/K2 alone at widths > 1: how fast each tile formulation streams (one GPU).

The kernels' GEMV task (``gemv.gemv_task``) runs here as a persistent grid of one program per SM
over one weight matrix of a profile (``--shapes``, e.g. ``llama3-8b:o_proj``), the way a K2
stage runs it, for each setting of the wide path (matrix instructions on rows padded to 16):
row tile, split along K (``KS``), K chunk, pipelining depth, warps. Width 1's FMA tile and
cuBLAS (``F.linear``) at the same width are the bars. Each timed launch reads a
different copy of the matrix (``attention_probe.L2_FLUSH_BYTES`` in all), so the weights stream
from HBM. Inputs are random; every setting's output is checked against ``F.linear`` in fp32.

Usage (GPU machine, repository root): ``python benchmarks/gemv_probe.py --shapes
llama3-8b:o_proj,llama3-1b:qkv --widths 2,4,8 [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from attention_probe import L2_FLUSH_BYTES, _replay_us  # noqa: E402

from monodecode.kernels.triton.gemv import gemv_task  # noqa: E402
from monodecode.model.profiles import profile_dims  # noqa: E402


@triton.jit
def _gemv_grid(
    w_ptr,
    x_ptr,
    y_ptr,
    health,
    N,
    TASKS,
    K: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    KS: tl.constexpr,
    STAGES: tl.constexpr,
    NPROG: tl.constexpr,
):
    KP: tl.constexpr = K // KS
    rows = tl.arange(0, WP)
    rstd = tl.zeros([WP], dtype=tl.float32)
    first = tl.program_id(0) % NPROG
    for t in tl.range(first, TASKS, NPROG, flatten=True):
        ks = t % KS
        n0 = (t // KS) * BN
        y, _ = gemv_task(
            w_ptr + ks * KP, w_ptr, w_ptr, w_ptr, n0, N, x_ptr + ks * KP, K, x_ptr, rstd, 1e-6, 0, health, 0,
            KP, W, WP, BN, BK, 1, False, False, False, STAGES, 1, False, K if KS > 1 else 0, 0,
        )  # fmt: skip
        n = n0 + tl.arange(0, BN)
        tl.store(y_ptr + ks * W * N + rows[None, :] * N + n[:, None], y, mask=(rows[None, :] < W) & (n[:, None] < N))


def _shape(spec: str) -> tuple[int, int]:
    """``profile:matrix`` as (rows, K) of one layer's matrix (qkv, o_proj, gate, down)."""
    profile, mat = spec.split(":")
    d = profile_dims(profile)
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    return {
        "qkv": (q + 2 * kv, d.hidden_size),
        "o_proj": (d.hidden_size, q),
        "gate": (d.intermediate_size, d.hidden_size),
        "down": (d.hidden_size, d.intermediate_size),
    }[mat]


def _settings(widths: list[int]) -> list[dict]:
    out = []
    for w in widths:
        wp = 1 if w == 1 else max(16, triton.next_power_of_2(w))
        if w == 1:
            out.append(dict(mode="w1", W=1, WP=1, BN=16, BK=512, KS=1, STAGES=5, warps=8))
            continue
        for bn, bk, ks in ((16, 256, 1), (32, 256, 1), (64, 128, 1), (64, 128, 2), (64, 128, 4)):
            out.append(dict(mode="dot", W=w, WP=wp, BN=bn, BK=bk, KS=ks, STAGES=4, warps=8))
    return out


def _launch(s: dict, w, x, y, health, n: int, k: int, sms: int) -> None:
    tasks = triton.cdiv(n, s["BN"]) * s["KS"]
    _gemv_grid[(min(sms, tasks),)](
        w, x, y, health, n, tasks, K=k, W=s["W"], WP=s["WP"], BN=s["BN"], BK=s["BK"], KS=s["KS"],
        STAGES=s["STAGES"], NPROG=min(sms, tasks), num_warps=s["warps"],
    )  # fmt: skip


def _warm(job: tuple) -> str:
    """Compile one setting (a spawned worker, so the timing process finds it in Triton's cache)."""
    spec, s = job
    n, k = _shape(spec)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(s["W"], k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(s["KS"], s["W"], n, device="cuda")
    try:
        _launch(
            s,
            w,
            x,
            y,
            torch.zeros(1, device="cuda", dtype=torch.int32),
            n,
            k,
            torch.cuda.get_device_properties(0).multi_processor_count,
        )
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # reported when timed
        return str(e)[:120]


def probe(spec: str, settings: list[dict], reps: int) -> list[dict]:
    n, k = _shape(spec)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes = n * k * 2
    copies = max(2, -(-L2_FLUSH_BYTES // nbytes))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
    health = torch.zeros(1, device="cuda", dtype=torch.int32)
    rows = []
    for s in settings:
        x = torch.randn(s["W"], k, device="cuda", dtype=torch.bfloat16)
        y = torch.zeros(s["KS"], s["W"], n, device="cuda")
        ref = torch.nn.functional.linear(x.float(), ws[0].float())
        row = {"shape": spec, "N": n, "K": k, **s}
        try:
            _launch(s, ws[0], x, y, health, n, k, sms)
            torch.cuda.synchronize()
        except Exception as e:  # a setting that does not compile or fit: one line, go on
            rows.append({**row, "error": str(e)[:160]})
            print(json.dumps(rows[-1]), flush=True)
            continue
        err = float((y.sum(0) - ref).abs().max() / ref.abs().max())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(20):
                _launch(s, ws[i % copies], x, y, health, n, k, sms)
        us = _replay_us(graph, reps)
        rows.append({**row, "us": round(us, 2), "gbs": round(nbytes / us / 1e3, 1), "rel_err": round(err, 5)})
        print(json.dumps(rows[-1]), flush=True)
    for w in sorted({s["W"] for s in settings}):
        x = torch.randn(w, k, device="cuda", dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        torch.nn.functional.linear(x, ws[0])
        with torch.cuda.graph(graph):
            for i in range(20):
                torch.nn.functional.linear(x, ws[i % copies])
        us = _replay_us(graph, reps)
        rows.append({"shape": spec, "N": n, "K": k, "mode": "cublas", "W": w, "us": round(us, 2),
                     "gbs": round(nbytes / us / 1e3, 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="llama3-8b:o_proj,llama3-8b:down,llama3-1b:qkv")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=12, help="parallel compile workers")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    settings = _settings([int(v) for v in a.widths.split(",")])
    specs = a.shapes.split(",")
    jobs = [(spec, s) for spec in specs for s in settings]
    with ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
        list(ex.map(_warm, jobs))
    rows = [r for spec in specs for r in probe(spec, settings, a.reps)]
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "gemv_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
