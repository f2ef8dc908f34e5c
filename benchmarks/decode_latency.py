"""Decode-step latency of the kernel backends, against the memory roofline, on one GPU.

For each model profile (random weights with the profile's real dims), step width and weight
dtype, one decode step over every decoder layer (embedding, final norm and LM head excluded:
they stay in vLLM) at a context of ``--context`` tokens per row is timed for:

  reference-eager   REF's reference decode (the numerics oracle), op by op (PyTorch eager)
  reference-graph   the oracle replayed from one CUDA graph (fp32 attention and norms: slow)
  stock-graph       a realistic stock per-op decode (``stock_decode.py``: what vLLM's per-op path
                    runs, in plain PyTorch: cuBLAS / _scaled_mm GEMMs, SDPA attention) replayed
                    from one CUDA graph: THE baseline ("never slower than stock")
  stock-gemm-floor  only that path's GEMMs, from one CUDA graph: no per-op path on these GEMMs is
                    faster
  triton            the persistent K1/K2 per layer, replayed from one CUDA graph

Roofline: the bytes a step must read (every projection weight, scale and norm of every layer,
plus the K/V entries each row attends to) over the read bandwidth measured in the same run
(``sum`` over a 4 GiB fp32 tensor). ``fraction`` = roofline time / measured time.

Timing: device events around each graph replay (a whole step), after warm-up; the median of
``--replays``. The weights of a step are far larger than L2, so replays do not run from cache.

Writes ``<out>/decode_latency_<gpu>_<date>.json`` and ``.png`` and prints a Markdown table.
Usage: ``python benchmarks/decode_latency.py [--profiles ...] [--batches 1,8] [--out DIR]``.
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
from monodecode.model.profiles import PROFILES, profile_dims
from monodecode.model.weights import random_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stock_decode import StockDecode  # noqa: E402

DEFAULT_PROFILES = ("llama3-1b", "llama3-8b", "gemma3-27b")
BACKENDS = ("reference-eager", "reference-graph", "stock-graph", "stock-gemm-floor", "triton")
LABELS = {
    "reference-eager": "reference (oracle) eager",
    "reference-graph": "reference (oracle) graph",
    "stock-graph": "stock per-op graph",
    "stock-gemm-floor": "stock GEMMs only (floor)",
    "triton": "triton K1/K2",
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


def _capture(fn) -> tuple[torch.cuda.CUDAGraph, Any]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


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
) -> list[dict]:
    from monodecode.kernels.triton.backend import TritonBackend
    from monodecode.kernels.triton.launch import _Meta
    from monodecode.services.platform import detect_platform

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
    tk = TritonBackend().build(req, weights, None, allow_jit=True)
    stock = StockDecode(dims, weights, context + BLOCK, device)
    log(
        f"# {profile} {weight_dtype}: {n_layers}/{dims.num_layers} layers built in {time.monotonic() - t0:.1f}s; "
        f"stock GEMMs: {stock.fp8_path}"
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
        x = torch.randn(rows, dims.hidden_size, device=device).to(torch.bfloat16)
        m = _Meta(meta, device)
        x_q = torch.randn(rows, dims.q_size, device=device).to(torch.bfloat16)
        x_i = torch.randn(rows, dims.intermediate_size, device=device).to(torch.bfloat16)

        def step_stock():
            stock.prepare(meta, BLOCK)
            return R.run_layers(weights, x, meta, kv, layer_fn=stock.forward_layer)

        steps = {
            "reference-graph": lambda: R.run_layers(weights, x, meta, kv),
            "stock-graph": step_stock,
            "stock-gemm-floor": lambda: [stock.gemms_only(l, x, x_q, x_i) for l in range(n_layers)][-1],
            "triton": lambda: R.run_layers(weights, x, m, kv, layer_fn=tk.forward_layer),
        }
        times: dict[str, list[float] | None] = {}
        errors: dict[str, str] = {}
        outs: dict[str, torch.Tensor] = {}
        t, why = _measure("reference-eager", lambda: _time_eager(steps["reference-graph"], max(5, replays // 4)), log)
        times["reference-eager"] = t
        if why:
            errors["reference-eager"] = why
        for name, fn in steps.items():

            def one(fn=fn):
                g, out = _capture(fn)
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
        # where the time goes: the K1 launches alone and the K2 launches alone, all layers
        attn_in = torch.randn(rows, dims.q_size, device=device).to(torch.bfloat16)
        k1_only = lambda: [tk._launch_k1(l, x, m, kv, rows) for l in range(n_layers)]  # noqa: E731
        k2_only = lambda: [tk._launch_k2(l, x, attn_in, rows) for l in range(n_layers)]  # noqa: E731
        parts = {}
        for name, fn in (("k1", k1_only), ("k2", k2_only)):

            def part(fn=fn):
                g_part, _ = _capture(fn)
                return _median_ms(_time_graph(g_part, replays))

            parts[name], _ = _measure(f"triton {name} only", part, log)
        ref = outs.get("reference-graph")

        def rel(name):
            if ref is None or name not in outs:
                return None
            return float((outs[name].float() - ref.float()).norm() / ref.float().norm())

        health = tk.health()
        kbytes = kv_bytes(dims, n_layers, context, rows)
        roof = (wbytes + kbytes) / bandwidth
        for backend in BACKENDS:
            ts = times.get(backend)
            med = statistics.median(ts) if ts else None
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
                    "rel_error_vs_reference": rel(backend) if backend in ("stock-graph", "triton") else None,
                    "stock_gemm_path": stock.fp8_path,
                    "triton_health": decode_health(health).describe() if health else "ok",
                    "triton_k1_only_ms": parts["k1"],
                    "triton_k2_only_ms": parts["k2"],
                }
            )
        med = {b: statistics.median(times[b]) * 1e3 for b in BACKENDS if times.get(b)}
        ratio = lambda a, b: f"{med[a] / med[b]:.2f}x" if a in med and b in med else "n/a"  # noqa: E731
        log(
            f"  batch {rows}: "
            + ", ".join(
                f"{b} {med[b]:.3f} ms ({roof * 1e3 / med[b]:.1%})" if b in med else f"{b} FAILED" for b in BACKENDS
            )
            + f"; triton vs stock graph {ratio('stock-graph', 'triton')}, vs oracle graph "
            f"{ratio('reference-graph', 'triton')}; rel err triton {rel('triton')}, stock {rel('stock-graph')}; "
            f"K1 only {parts['k1']} ms, K2 only {parts['k2']} ms; health {health}"
        )
        del outs, kv
        torch.cuda.empty_cache()
    tk.close()
    del tk, weights, stock
    torch.cuda.empty_cache()
    return results


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


def summary(doc: dict) -> dict:
    """Triton against the realistic stock graph per configuration, and the targets' verdicts."""
    rows = doc["results"]
    out = []
    for r in rows:
        if r["backend"] != "triton":
            continue
        stock = _find(rows, r, "stock-graph")
        s, t = (stock or {}).get("step_ms"), r.get("step_ms")
        out.append(
            {
                "profile": r["profile"],
                "weight_dtype": r["weight_dtype"],
                "batch": r["batch"],
                "triton_ms": t,
                "stock_graph_ms": s,
                "triton_fraction_of_roofline": r.get("fraction_of_roofline"),
                "stock_over_triton": s / t if s and t else None,
                "triton_not_slower_than_stock": (t <= s) if s and t else None,
            }
        )
    verdicts = [x["triton_not_slower_than_stock"] for x in out]
    return {"per_config": out, "never_slower_than_stock": all(v is True for v in verdicts) if verdicts else None}


def summary_table(doc: dict) -> str:
    """One row per configuration: the README's table."""
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
    shown = [b for b in BACKENDS if b != "reference-eager"]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 4.8))
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
    ax.legend(fontsize=8)
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
    profiles, batches, context: int, layers: int | None, fp8_profiles, replays: int, out_dir: Path, log=print
) -> dict:
    for p in list(profiles) + list(fp8_profiles):
        if p not in PROFILES:
            raise MonodecodeError(f"unknown model profile {p!r}; known: {', '.join(PROFILES)}")
    if not batches or any(b < 1 or b > 16 for b in batches):
        raise MonodecodeError(f"batches must be in 1..16, got {batches}")
    if context < 1:
        raise MonodecodeError(f"context must be >= 1, got {context}")
    if not torch.cuda.is_available():
        raise MonodecodeError("the decode benchmark needs a CUDA or ROCm GPU; torch sees none")
    device = torch.device("cuda")
    bw = read_bandwidth(device)
    log(f"# read bandwidth {bw / 1e9:.0f} GB/s")
    import triton

    gpu = torch.cuda.get_device_name()
    date = _dt.date.today().isoformat()
    doc = {
        "schema": 2,
        "gpu": gpu,
        "date": date,
        "context": context,
        "block_size": BLOCK,
        "read_bandwidth_gbs": bw / 1e9,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers_note": "all layers timed" if layers is None else f"first {layers} layers timed (full-model ms scaled)",
        "method": __doc__.split("\n\n")[1:4],
        "backends": {b: LABELS[b] for b in BACKENDS},
        "results": [],
    }
    stem = f"decode_latency_{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}_{date}"
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, ppath = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    configs = [(p, "bf16") for p in profiles] + [(p, "fp8") for p in fp8_profiles]
    for p, dtype in configs:
        doc["results"] += bench_config(p, dtype, batches, context, layers, replays, bw, device, log)
        doc["summary"] = summary(doc)
        tmp = jpath.with_suffix(".json.tmp")  # saved after every model: a cut-short run keeps what it measured
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(jpath)
    plot(doc, ppath)
    doc["paths"] = [str(jpath), str(ppath)]
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default=",".join(DEFAULT_PROFILES))
    ap.add_argument("--fp8-profiles", default="llama3-8b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None, help="time only the first N layers")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args(argv)
    try:
        doc = run(
            _csv(a.profiles), _csv(a.batches, int), a.context, a.layers, _csv(a.fp8_profiles), a.replays, Path(a.out)
        )
    except MonodecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(doc))
    print()
    print(summary_table(doc))
    print(f"\ntriton never slower than the stock graph: {doc['summary']['never_slower_than_stock']}")
    print("\n".join(doc["paths"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
