"""Decode-step latency of the kernel backends, against the memory roofline, on one GPU.

For each model profile (random weights with the profile's real dims), step width and weight
dtype, one decode step over every decoder layer (embedding, final norm and LM head excluded:
they stay in vLLM) at a context of ``--context`` tokens per row is timed for:

  reference-eager      the reference decode (the numerics oracle), op by op (PyTorch eager)
  reference-graph      the oracle replayed from one CUDA graph (fp32 attention and norms: slow)
  stock-graph          stock per-op decode over the paged KV cache (``stock.StockDecode``:
                       cuBLAS / _scaled_mm GEMMs, gather + SDPA attention), one CUDA graph
  stock-contig-graph   (a) the same per-op step over a contiguous per-row KV cache (SDPA reads it
                       in place, no gather), one CUDA graph
  stock-compiled-graph (b) as (a) with each layer's two halves around attention
                       ``torch.compile``d (inductor, default mode; vLLM's piecewise split), the
                       whole step one CUDA graph
  stock-gemm-floor     only the stock GEMMs, from one CUDA graph: no per-op path on them is faster
  triton               the persistent K1/K2 per layer (current launch target), one CUDA graph
  triton-<variant>     the same with a changed launch target (``--variants``; default: ``before``,
                       the launch target before the bf16 mailbox), measured in the same run

"Stock" in every verdict is the fastest of the three stock-* step graphs. Roofline: the bytes a
step must read (every projection weight, scale and norm of every layer, plus the K/V entries each
row attends to) over the read bandwidth measured in the same run (``sum`` over a 4 GiB fp32
tensor). ``fraction`` = roofline time / measured time.

Timing: device events around each graph replay (a whole step), after warm-up; the median of
``--replays``. The weights of a step are far larger than L2, so replays do not run from cache.
With ``--timeline-batches`` the triton kernels are then rebuilt with per-stage ``%globaltimer``
stamps and one replayed step is drawn per layer-of-interest (``timeline.py``).

Public interface (used by ``monodecode-ops bench``): ``run``, ``summary``, ``report_rows``,
``markdown_table``, ``summary_table``, ``verdict_table``, ``plot``.
Writes ``<out>/decode_latency_<gpu>_<date>.json`` and ``.png`` (+ timeline PNGs) and prints tables.
Usage: ``python benchmarks/decode_latency.py [--profiles ...] [--batches 1,2,4,8] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from monodecode.errors import MonodecodeError
from monodecode.kernels.base import BuildRequest
from monodecode.kernels.health import decode_health
from monodecode.model import reference as R
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import PROFILES, profile_config, profile_dims
from monodecode.model.weights import random_weights
from monodecode.runtime.width_policy import capture_graph
from monodecode_ops.decode_bench.stock import ContiguousStockDecode, StockDecode

DEFAULT_PROFILES = ("llama3-1b", "llama3-8b", "gemma3-27b")
DEFAULT_BATCHES = (1, 2, 4, 8)
BACKENDS = ("reference-eager", "reference-graph", "stock-graph", "stock-gemm-floor", "triton")
STOCK_BACKENDS = ("stock-graph", "stock-contig-graph", "stock-compiled-graph")
EXTRA_BACKENDS = ("stock-contig-graph", "stock-compiled-graph")
LABELS = {
    "reference-eager": "reference (oracle) eager",
    "reference-graph": "reference (oracle) graph",
    "stock-graph": "stock per-op graph",
    "stock-contig-graph": "stock per-op graph, contiguous KV",
    "stock-compiled-graph": "stock torch.compile'd layers, one graph",
    "stock-gemm-floor": "stock GEMMs only (floor)",
    "triton": "triton K1/K2",
}
# Launch-target changes measured next to the current target in the same run: "before" is the
# launch target of runs 17-18 (QKV chunks sized like every other stage's, 64-position attention
# tiles everywhere); "runs6-8" an older one (tagged words at width 1, FP8 weights widened to bf16
# at widths > 1, K chunks that divide K, the rows chooser's whole-wave model, no split-K, the
# attention loop pipelined 3 deep). Kernel code changes (run 19: relaxed exit atomics, the fused
# norm's weight pipelined) apply to every variant.
DEFAULT_VARIANTS = {
    "before": {"qkv_inflight_bytes": 0, "whole_attn_tile": 0, "wide_even_waves": False},
    "runs6-8": {
        "narrow_mailbox": "tagged",
        "narrow_store_1d": False,
        "narrow_task_bytes": 4096,
        "narrow_tail": False,
        "fp8_narrow_mailbox": "bf16",
        "fp8_wide": "widen",
        "fp8_pair_min_rows": 0,
        "wide_inflight_bytes": 0,
        "qkv_inflight_bytes": 0,
        "wide_burst": 0.0,
        "wide_split_k": 0,
        "wide_attn_stages": 0,
        "whole_attn_tile": 0,
        "wide_even_waves": False,
    },
}
# Fraction of the roofline each profile should reach at batch 1 (H200, context 1024).
TARGETS = {
    ("llama3-8b", "bf16"): 0.85,
    ("gemma3-27b", "bf16"): 0.90,
    ("llama3-1b", "bf16"): 0.70,
    ("llama3-8b", "fp8"): 0.75,
}
BLOCK = 16


def read_bandwidth(device, gib: float = 4.0, reps: int = 20) -> float:
    """Bytes/s of a large read-only reduction (fp32 sum), median of ``reps``."""
    n = int(gib * (1 << 30)) // 4
    t = torch.rand(n, device=device)
    times = []
    for i in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t.sum()
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del t
    torch.cuda.empty_cache()
    return n * 4 / statistics.median(times)


def weight_bytes(weights) -> int:
    total = 0
    for lw in weights.layers:
        for lin in (lw.q_proj, lw.k_proj, lw.v_proj, lw.o_proj, lw.gate_proj, lw.up_proj, lw.down_proj):
            total += lin.weight.numel() * lin.weight.element_size()
            if lin.scale is not None:
                total += lin.scale.numel() * 4
        for norm in (lw.attn_norm, lw.q_norm, lw.k_norm, lw.attn_post_norm, lw.mlp_norm, lw.mlp_post_norm):
            if norm is not None:
                total += norm.numel() * norm.element_size()
    return total


def kv_bytes(dims, layers: int, context: int, rows: int) -> int:
    """K and V bytes the rows attend to (window-limited on sliding layers), bf16."""
    total = 0
    for l in range(layers):
        window = dims.window_for_layer(l)
        seen = min(context, window) if window else context
        total += rows * seen * dims.num_kv_heads * dims.head_dim * 2 * 2
    return total


def _time_eager(fn, replays: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``replays`` calls of ``fn`` (CUDA events around each), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def _time_graph(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    return _time_eager(graph.replay, replays, warmup=3)


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def _measure(name: str, fn, log) -> tuple[Any, str | None]:
    """Run one measurement; a failure is recorded (and logged) instead of ending the run."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - one backend failing must not lose the others' numbers
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        log(f"  ! {name} failed: {why}")
        torch.cuda.synchronize()
        return None, why


def _triton_kernels(req, weights, change: dict, device, share=None):
    """Triton kernels for ``req`` with the CUDA launch target changed by ``change`` (sharing the
    packed weights of ``share``)."""
    import dataclasses

    from monodecode.kernels.triton.backend import TritonBackend
    from monodecode.kernels.triton.config import target_for
    from monodecode.kernels.triton.launch import TritonKernels

    if not change:
        return TritonBackend().build(req, weights, None, allow_jit=True)
    target = dataclasses.replace(target_for(req.platform.kind), **change)
    return TritonKernels(req, weights, target, req.platform.compute_units, device, share=share)


def bench_config(
    profile: str,
    weight_dtype: str,
    batches: list[int],
    context: int,
    layers: int | None,
    replays: int,
    bandwidth: float,
    device,
    log=print,
    variants: dict | None = None,
    timeline_batches: tuple[int, ...] = (),
    out_dir: Path | None = None,
    stem: str = "",
    timelines: list | None = None,
    baselines: bool = True,
) -> list[dict]:
    """Result rows of one model profile and weight dtype, every batch; timeline summaries are
    appended to ``timelines``."""
    from monodecode.kernels.triton.launch import _Meta
    from monodecode.services.platform import detect_platform

    variants = DEFAULT_VARIANTS if variants is None else variants
    dims = profile_dims(profile)
    n_layers = dims.num_layers if layers is None else min(layers, dims.num_layers)
    t0 = time.monotonic()
    weights = random_weights(dims, seed=1, weight_dtype=weight_dtype, device=device, num_layers=n_layers)
    req = BuildRequest(
        dims=dims,
        weight_dtype=weight_dtype,
        tp_size=1,
        widths=tuple(sorted(set(batches))),
        block_size=BLOCK,
        platform=detect_platform(),
        wait_timeout_s=2.0,
    )
    kernels = {"triton": _triton_kernels(req, weights, {}, device)}
    for name, change in variants.items():
        kernels[f"triton-{name}"] = _triton_kernels(req, weights, change, device, share=kernels["triton"])
    stock = contig = compiled = None
    if baselines:
        stock = StockDecode(dims, weights, context + BLOCK, device)
        contig = ContiguousStockDecode(dims, weights, context, device, share=stock)
        compiled = ContiguousStockDecode(dims, weights, context, device, compiled=True, share=stock)
    stock_path = stock.fp8_path if stock else None
    log(
        f"# {profile} {weight_dtype}: {n_layers}/{dims.num_layers} layers built in {time.monotonic() - t0:.1f}s; "
        f"stock GEMMs: {stock_path}; triton variants: {variants}"
    )
    wbytes = weight_bytes(weights)
    results = []
    for rows in batches:
        blocks = rows * (-(-context // BLOCK)) + 1
        alloc = BlockAllocator(blocks, BLOCK, shuffle_seed=rows)
        for r in range(rows):
            alloc.append_slots(r, context - 1)
        meta = alloc.decode_metadata(list(range(rows)), device=device)
        kv = PagedKVCache.allocate(dims, blocks, BLOCK, device=device, num_layers=n_layers)
        for t in kv.key + kv.value:
            t.normal_()
        if baselines:
            contig.load_cache(kv, meta)
            compiled.key, compiled.value = contig.key, contig.value  # one contiguous cache for (a) and (b)
        x = torch.randn(rows, dims.hidden_size, device=device).to(torch.bfloat16)
        m = _Meta(meta, device)
        x_q = torch.randn(rows, dims.q_size, device=device).to(torch.bfloat16)
        x_i = torch.randn(rows, dims.intermediate_size, device=device).to(torch.bfloat16)

        def stock_step(path):
            def step():
                path.prepare(meta, BLOCK)
                return R.run_layers(weights, x, meta, kv, layer_fn=path.forward_layer)

            return step

        steps = {"reference-graph": lambda: R.run_layers(weights, x, meta, kv)}
        if baselines:
            steps["stock-graph"] = stock_step(stock)
            steps["stock-contig-graph"] = stock_step(contig)
            steps["stock-compiled-graph"] = stock_step(compiled)
            steps["stock-gemm-floor"] = lambda: [stock.gemms_only(l, x, x_q, x_i) for l in range(n_layers)][-1]
        for name, tk in kernels.items():
            steps[name] = lambda tk=tk: R.run_layers(weights, x, m, kv, layer_fn=tk.forward_layer)
        times: dict[str, list[float] | None] = {}
        errors: dict[str, str] = {}
        outs: dict[str, torch.Tensor] = {}
        if baselines:
            t, why = _measure(
                "reference-eager", lambda: _time_eager(steps["reference-graph"], max(3, replays // 8), warmup=1), log
            )
            times["reference-eager"] = t
            if why:
                errors["reference-eager"] = why
        for name, fn in steps.items():

            def one(fn=fn):
                g, out = capture_graph(fn)
                ts = _time_graph(g, replays)
                g.replay()  # leave this backend's output of the same KV state for the error check
                torch.cuda.synchronize()
                return ts, out.clone(), g

            got, why = _measure(name, one, log)
            if why:
                errors[name], times[name] = why, None
                continue
            times[name], outs[name], g = got
            del g
        ref = outs.get("reference-graph")

        def rel(name):
            if ref is None or name not in outs:
                return None
            return float((outs[name].float() - ref.float()).norm() / ref.float().norm())

        health = {name: tk.health() for name, tk in kernels.items()}
        kbytes = kv_bytes(dims, n_layers, context, rows)
        roof = (wbytes + kbytes) / bandwidth
        names = (["reference-eager"] if baselines else []) + list(steps)
        for backend in names:
            ts = times.get(backend)
            med = statistics.median(ts) if ts else None
            h = health.get(backend)
            results.append(
                {
                    "profile": profile,
                    "weight_dtype": weight_dtype,
                    "batch": rows,
                    "context": context,
                    "layers_timed": n_layers,
                    "layers_model": dims.num_layers,
                    "backend": backend,
                    "step_ms": med * 1e3 if med else None,
                    "step_ms_min": min(ts) * 1e3 if ts else None,
                    "step_ms_full_model": med * 1e3 * dims.num_layers / n_layers if med else None,
                    "error": errors.get(backend),
                    "weight_bytes": wbytes,
                    "kv_bytes": kbytes,
                    "roofline_ms": roof * 1e3,
                    "fraction_of_roofline": roof / med if med else None,
                    "rel_error_vs_reference": rel(backend) if backend.startswith(("stock-", "triton")) else None,
                    "stock_gemm_path": stock_path,
                    "triton_health": (decode_health(h).describe() if h else "ok") if h is not None else None,
                    "triton_change": ({} if backend == "triton" else variants.get(backend[7:]))
                    if backend.startswith("triton")
                    else None,
                }
            )
        med = {b: statistics.median(times[b]) * 1e3 for b in names if times.get(b)}
        best = min((b for b in STOCK_BACKENDS if b in med), key=lambda b: med[b], default=None)
        log(
            f"  batch {rows}: "
            + ", ".join(
                f"{b} {med[b]:.3f} ms ({roof * 1e3 / med[b]:.1%})" if b in med else f"{b} FAILED" for b in names
            )
            + f"; fastest stock {best}; triton/stock "
            + (f"{med[best] / med['triton']:.2f}x" if best and "triton" in med else "n/a")
            + "; rel err "
            + ", ".join(f"{b} {rel(b):.2e}" for b in names if rel(b) is not None)
            + f"; health {health}"
        )
        if rows in timeline_batches and out_dir is not None and timelines is not None:
            tl_args = (kernels["triton"], steps["triton"], n_layers, profile, weight_dtype, rows, out_dir, stem, log)
            got, _ = _measure("timeline", lambda: _timeline(*tl_args), log)
            if got:
                timelines.append(got)
        del outs, kv
        torch.cuda.empty_cache()
    for tk in kernels.values():
        tk.close()
    del kernels, weights, stock, contig, compiled
    torch.cuda.empty_cache()
    return results


def _timeline(tk, step, n_layers, profile, weight_dtype, rows, out_dir: Path, stem: str, log) -> dict:
    """Rebuild ``tk`` with stage timestamps, replay one step from a graph, plot and summarise."""
    from monodecode_ops.decode_bench import timeline as TL

    tk.enable_timeline(n_layers)
    g, _ = capture_graph(step)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    stamps = tk.timeline(n_layers)
    prof_ms = _median_ms(_time_graph(g, 5))
    del g
    layer = n_layers // 2
    path = out_dir / f"{stem}_timeline_{profile}_{weight_dtype}_b{rows}.png"
    TL.plot_layer(stamps, layer, f"{profile} {weight_dtype} batch {rows}, layer {layer}", path)
    summ = TL.summarize(stamps)
    log(f"  timeline batch {rows} (step with stamps {prof_ms:.3f} ms): {path.name}")
    for line in TL.describe(summ):
        log(f"    {line}")
    tk.enable_timeline(n_layers, on=False)  # back to the kernels without stamps
    return {
        "profile": profile,
        "weight_dtype": weight_dtype,
        "batch": rows,
        "step_ms_with_stamps": prof_ms,
        "timeline": summ,
        "timeline_png": path.name,
    }


def _find(rows: list[dict], r: dict, backend: str) -> dict | None:
    return next(
        (
            x
            for x in rows
            if x["profile"] == r["profile"]
            and x["weight_dtype"] == r["weight_dtype"]
            and x["batch"] == r["batch"]
            and x["backend"] == backend
        ),
        None,
    )


def _ratio(base: dict | None, r: dict) -> str:
    if not base or not base.get("step_ms") or not r.get("step_ms"):
        return "n/a"
    return f"{base['step_ms'] / r['step_ms']:.2f}x"


def _ms(r: dict | None, digits: int = 3) -> str:
    if not r:
        return "n/a"
    if r.get("step_ms") is None:
        return "failed"
    return f"{r['step_ms']:.{digits}f}"


def markdown_table(doc: dict) -> str:
    """Every backend per configuration; ratios = that baseline's time / this backend's time."""
    lines = [
        f"GPU: {doc['gpu']} ({doc['date']}), read bandwidth {doc['read_bandwidth_gbs']:.0f} GB/s, "
        f"context {doc['context']}, random weights, {doc['layers_note']}",
        "",
        "| model | weights | batch | backend | ms/step | roofline ms | % of roofline | vs stock graph | vs oracle graph |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = doc["results"]
    for r in rows:
        frac = r.get("fraction_of_roofline")
        lines.append(
            f"| {r['profile']} | {r['weight_dtype']} | {r['batch']} | {r['backend']} | {_ms(r)} | "
            f"{r['roofline_ms']:.3f} | {f'{100 * frac:.1f}' if frac else 'n/a'} | "
            f"{_ratio(_find(rows, r, 'stock-graph'), r)} | {_ratio(_find(rows, r, 'reference-graph'), r)} |"
        )
    return "\n".join(lines)


def best_stock(rows: list[dict], r: dict) -> dict | None:
    """The fastest measured stock step graph of ``r``'s configuration ("stock" in every verdict)."""
    got = [x for b in STOCK_BACKENDS if (x := _find(rows, r, b)) and x.get("step_ms")]
    return min(got, key=lambda x: x["step_ms"], default=None)


def summary(doc: dict) -> dict:
    """Triton against the fastest stock step per configuration, and the targets' verdicts."""
    rows = doc["results"]
    out = []
    for r in rows:
        if r["backend"] != "triton":
            continue
        stock = best_stock(rows, r)
        s, t = (stock or {}).get("step_ms"), r.get("step_ms")
        target = TARGETS.get((r["profile"], r["weight_dtype"])) if r["batch"] == 1 else None
        frac = r.get("fraction_of_roofline")
        out.append(
            {
                "profile": r["profile"],
                "weight_dtype": r["weight_dtype"],
                "batch": r["batch"],
                "triton_ms": t,
                "stock_ms": s,
                "stock_backend": (stock or {}).get("backend"),
                "stock_graph_ms": (_find(rows, r, "stock-graph") or {}).get("step_ms"),
                "triton_fraction_of_roofline": frac,
                "stock_over_triton": s / t if s and t else None,
                "triton_not_slower_than_stock": (t <= s) if s and t else None,
                "roofline_target": target,
                "roofline_target_met": (frac >= target) if target and frac else None,
            }
        )
    verdicts = [x["triton_not_slower_than_stock"] for x in out]
    return {"per_config": out, "never_slower_than_stock": all(v is True for v in verdicts) if verdicts else None}


def report_rows(doc: dict) -> list[tuple]:
    """One row per result (profile, weights, batch, backend label, ms, roofline ms, % roofline,
    ratio vs the fastest stock step); a failed measurement shows as 'failed'."""
    rows = []
    for r in doc["results"]:
        frac = r.get("fraction_of_roofline")
        rows.append(
            (
                r["profile"],
                r["weight_dtype"],
                r["batch"],
                LABELS.get(r["backend"], r["backend"]),
                _ms(r),
                f"{r['roofline_ms']:.3f}",
                f"{100 * frac:.1f}%" if frac else "n/a",
                _ratio(best_stock(doc["results"], r), r),
            )
        )
    return rows


def verdict_table(doc: dict) -> str:
    """Per model and batch: ms (% of roofline) of every triton build and stock step, the ratio of
    the fastest stock step over triton (> 1: triton faster), and the batch-1 roofline target."""
    rows = doc["results"]
    tri = sorted({r["backend"] for r in rows if r["backend"].startswith("triton")}, key=lambda b: (b != "triton", b))
    cols = [*tri, *STOCK_BACKENDS]
    lines = [
        "| model | weights | batch | roofline ms | "
        + " | ".join(f"{c} ms (%)" for c in cols)
        + " | stock/triton | "
        + " | ".join(f"stock/{c}" for c in tri[1:])
        + (" | " if tri[1:] else "")
        + "target |",
        "| " + " | ".join(["---"] * (6 + len(cols) + len(tri[1:]))) + " |",
    ]
    for r in rows:
        if r["backend"] != "triton":
            continue
        best = best_stock(rows, r)

        def cell(b):
            x = _find(rows, r, b)
            f = (x or {}).get("fraction_of_roofline")
            return f"{_ms(x, 2)}" + (f" ({100 * f:.0f} %)" if f else "")

        target = TARGETS.get((r["profile"], r["weight_dtype"])) if r["batch"] == 1 else None
        frac = r.get("fraction_of_roofline")
        verdict = "" if not target else f"{'met' if frac and frac >= target else 'not met'} (>= {100 * target:.0f} %)"
        lines.append(
            f"| {r['profile']} | {r['weight_dtype']} | {r['batch']} | {r['roofline_ms']:.2f} | "
            + " | ".join(cell(c) for c in cols)
            + f" | {_ratio(best, r)} | "
            + " | ".join(_ratio(best, _find(rows, r, c) or {}) for c in tri[1:])
            + (" | " if tri[1:] else "")
            + f"{verdict} |"
        )
    return "\n".join(lines)


def summary_table(doc: dict) -> str:
    """One row per configuration against the paged per-op stock graph (the earlier runs' table)."""
    rows = doc["results"]
    lines = [
        "| model | weights | batch | roofline ms | oracle graph ms | stock graph ms (% roofline) | stock GEMMs only ms "
        "| triton ms (% roofline) | triton vs stock | triton vs oracle | K1 / K2 ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["backend"] != "triton":
            continue
        st, orc, floor = (
            _find(rows, r, "stock-graph"),
            _find(rows, r, "reference-graph"),
            _find(rows, r, "stock-gemm-floor"),
        )

        def pct(x):
            f = (x or {}).get("fraction_of_roofline")
            return f" ({100 * f:.0f} %)" if f else ""

        k1, k2 = r.get("triton_k1_only_ms"), r.get("triton_k2_only_ms")
        lines.append(
            f"| {r['profile']} | {r['weight_dtype']} | {r['batch']} | {r['roofline_ms']:.2f} | {_ms(orc, 2)} | "
            f"{_ms(st, 2)}{pct(st)} | {_ms(floor, 2)} | **{_ms(r, 2)}{pct(r)}** | {_ratio(st, r)} | {_ratio(orc, r)} | "
            f"{f'{k1:.2f}' if k1 else 'n/a'} / {f'{k2:.2f}' if k2 else 'n/a'} |"
        )
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    groups = sorted(
        {(r["profile"], r["weight_dtype"], r["batch"]) for r in rows},
        key=lambda k: (list(PROFILES).index(k[0]), k[1], k[2]),
    )
    present = {r["backend"] for r in rows}
    tri = sorted((b for b in present if b.startswith("triton")), key=lambda b: (b != "triton", b))
    shown = [b for b in ("reference-graph", *STOCK_BACKENDS, "stock-gemm-floor") if b in present] + tri
    fig, ax = plt.subplots(figsize=(max(8, 0.25 * len(shown) * len(groups) + 2), 5.2))
    width = 0.8 / len(shown)
    for i, backend in enumerate(shown):
        vals = []
        for g in groups:
            r = next(
                (r for r in rows if (r["profile"], r["weight_dtype"], r["batch"]) == g and r["backend"] == backend),
                None,
            )
            vals.append(100 * ((r or {}).get("fraction_of_roofline") or 0.0))
        ax.bar([j + i * width for j in range(len(groups))], vals, width, label=LABELS.get(backend, backend))
    ax.set_xticks([j + width * (len(shown) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{p}\n{d} b{b}" for p, d, b in groups], fontsize=8)
    ax.set_ylabel("% of memory roofline")
    ax.set_ylim(0, 100)
    ax.axhline(100, color="k", lw=0.5)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"Decode step vs roofline, {doc['gpu']}, context {doc['context']} ({doc['date']})")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def _csv(text: str, kind=str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MonodecodeError(f"bad list {text!r}: expected comma-separated {kind.__name__} values") from None


def run(
    profiles,
    batches,
    context: int,
    layers: int | None,
    fp8_profiles,
    replays: int,
    out_dir: Path,
    log=print,
    variants: dict | None = None,
    timeline_batches=(),
    baselines: bool = True,
) -> dict:
    """Run the benchmark; returns the result document (also written as JSON + PNG under ``out_dir``).

    ``variants``: name -> change of the CUDA launch target, each timed as ``triton-<name>`` next to
    the current target (default ``DEFAULT_VARIANTS``; ``{}`` for none). ``timeline_batches``: batches
    whose triton step is also drawn as a per-stage timeline (kernels rebuilt with timestamps).
    ``baselines=False``: only the oracle graph (for the error) and the triton builds (quick A/B)."""
    for p in list(profiles) + list(fp8_profiles):
        profile_config(p)  # the runtime's check: one line naming the unknown profile and the known ones
    if not batches or any(b < 1 or b > 16 for b in batches):
        raise MonodecodeError(f"batches must be in 1..16, got {batches}")
    if context < 1:
        raise MonodecodeError(f"context must be >= 1, got {context}")
    variants = DEFAULT_VARIANTS if variants is None else variants
    _check_variants(variants)
    if not torch.cuda.is_available():
        raise MonodecodeError("the decode benchmark needs a CUDA or ROCm GPU; torch sees none")
    device = torch.device("cuda")
    bw = read_bandwidth(device)
    log(f"# read bandwidth {bw / 1e9:.0f} GB/s")
    import triton

    gpu = torch.cuda.get_device_name()
    date = _dt.date.today().isoformat()
    doc = {
        "schema": 3,
        "gpu": gpu,
        "date": date,
        "context": context,
        "block_size": BLOCK,
        "read_bandwidth_gbs": bw / 1e9,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers_note": "all layers timed" if layers is None else f"first {layers} layers timed (full-model ms scaled)",
        "method": __doc__.split("\n\n")[1:5],
        "backends": {b: LABELS.get(b, b) for b in (*BACKENDS, *EXTRA_BACKENDS)},
        "variants": variants,
        "results": [],
        "timelines": [],
    }
    stem = f"decode_latency_{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}_{date}"
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, ppath = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    configs = [(p, "bf16") for p in profiles] + [(p, "fp8") for p in fp8_profiles]
    for p, dtype in configs:
        doc["results"] += bench_config(
            p,
            dtype,
            batches,
            context,
            layers,
            replays,
            bw,
            device,
            log,
            variants=variants,
            timeline_batches=tuple(timeline_batches),
            out_dir=out_dir,
            stem=stem,
            timelines=doc["timelines"],
            baselines=baselines,
        )
        doc["summary"] = summary(doc)
        tmp = jpath.with_suffix(".json.tmp")  # saved after every model: a cut-short run keeps what it measured
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(jpath)
    plot(doc, ppath)
    doc["paths"] = [str(jpath), str(ppath)]
    return doc


def _check_variants(variants: dict) -> None:
    import dataclasses

    from monodecode.kernels.triton.config import CUDA

    fields = {f.name for f in dataclasses.fields(CUDA)}
    for name, change in variants.items():
        if not isinstance(change, dict) or set(change) - fields:
            raise MonodecodeError(
                f"variant {name!r}: expected an object of launch-target fields ({', '.join(sorted(fields))})"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default=",".join(DEFAULT_PROFILES))
    ap.add_argument("--fp8-profiles", default="llama3-8b")
    ap.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None, help="time only the first N layers")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument(
        "--variants", default=None, help="JSON: name -> launch-target change (default: the previous target as 'before')"
    )
    ap.add_argument("--timeline-batches", default="", help="batches drawn as per-stage timelines, e.g. 1,8")
    ap.add_argument("--no-baselines", action="store_true", help="triton builds and the oracle only (quick A/B)")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    try:
        try:
            variants = json.loads(a.variants) if a.variants else None
        except json.JSONDecodeError as e:
            raise MonodecodeError(f"--variants is not JSON: {e}") from None
        if variants is not None and not isinstance(variants, dict):
            raise MonodecodeError("--variants must be a JSON object (name -> launch-target change)")
        doc = run(
            _csv(a.profiles),
            _csv(a.batches, int),
            a.context,
            a.layers,
            _csv(a.fp8_profiles),
            a.replays,
            Path(a.out),
            variants=variants,
            timeline_batches=_csv(a.timeline_batches, int),
            baselines=not a.no_baselines,
        )
    except MonodecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(doc))
    print()
    print(verdict_table(doc))
    print(f"\ntriton never slower than the fastest stock step: {doc['summary']['never_slower_than_stock']}")
    print("\n".join(doc["paths"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
