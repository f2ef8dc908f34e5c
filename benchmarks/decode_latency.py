"""Decode-step latency of the kernel backends, against the memory roofline, on one GPU.

For each model profile (random weights with the profile's real dims), step width and weight
dtype, one decode step over every decoder layer (embedding, final norm and LM head excluded:
they stay in vLLM) at a context of ``--context`` tokens per row is timed for:

  reference-eager   the reference decode, op by op (PyTorch eager)
  reference-graph   the same ops replayed from one CUDA graph: the stock per-op baseline
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
from monodecode.kernels.base import BuildRequest, decode_health
from monodecode.model import reference as R
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import PROFILES, profile_dims
from monodecode.model.weights import random_weights

DEFAULT_PROFILES = ("llama3-1b", "llama3-8b", "gemma3-27b")
BACKENDS = ("reference-eager", "reference-graph", "triton")
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


def _time_graph(graph: torch.cuda.CUDAGraph, replays: int) -> list[float]:
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def _time_eager(fn, replays: int) -> list[float]:
    for _ in range(2):
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


def _write_kv_capturable(cache: torch.Tensor, slot_mapping: torch.Tensor, new: torch.Tensor) -> None:
    """``paged_kv.write_kv`` without its host sync: it indexes with a 0-d device tensor
    (``valid[donor]``), which PyTorch turns into ``.item()``, so the reference cannot be captured
    in a CUDA graph as is. Same semantics (slot -1 rows write nothing) through index_select."""
    flat = cache.view(-1, cache.shape[2], cache.shape[3])
    valid = slot_mapping >= 0
    donor = torch.argmax(valid.to(torch.int32)).view(1)
    donor_valid = valid.index_select(0, donor)
    donor_slot = torch.where(donor_valid, slot_mapping.index_select(0, donor), torch.zeros_like(donor))
    donor_value = torch.where(donor_valid[:, None, None], new.index_select(0, donor).to(cache.dtype),
                              flat.index_select(0, donor_slot))
    index = torch.where(valid, slot_mapping, donor_slot)
    value = torch.where(valid[:, None, None], new.to(cache.dtype), donor_value)
    flat.index_copy_(0, index, value)


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


def bench_config(profile: str, weight_dtype: str, batches: list[int], context: int, layers: int | None,
                 replays: int, bandwidth: float, device, log=print) -> list[dict]:
    from monodecode.kernels.triton.backend import TritonBackend
    from monodecode.kernels.triton.launch import _Meta
    from monodecode.runtime.platform import detect_platform

    dims = profile_dims(profile)
    n_layers = dims.num_layers if layers is None else min(layers, dims.num_layers)
    t0 = time.monotonic()
    weights = random_weights(dims, seed=1, weight_dtype=weight_dtype, device=device, num_layers=n_layers)
    req = BuildRequest(dims=dims, weight_dtype=weight_dtype, tp_size=1, widths=tuple(sorted(set(batches))),
                       block_size=BLOCK, platform=detect_platform(), wait_timeout_s=2.0)
    tk = TritonBackend().build(req, weights, None, allow_jit=True)
    log(f"# {profile} {weight_dtype}: {n_layers}/{dims.num_layers} layers built in {time.monotonic() - t0:.1f}s")
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
        step_ref = lambda: R.run_layers(weights, x, meta, kv)  # noqa: E731
        step_tri = lambda: R.run_layers(weights, x, m, kv, layer_fn=tk.forward_layer)  # noqa: E731
        times = {"reference-eager": _time_eager(step_ref, max(5, replays // 4))}
        g_ref, out_ref = _capture(step_ref)
        times["reference-graph"] = _time_graph(g_ref, replays)
        g_tri, out_tri = _capture(step_tri)
        times["triton"] = _time_graph(g_tri, replays)
        # where the time goes: the K1 launches alone and the K2 launches alone, all layers
        attn_in = torch.randn(rows, dims.q_size, device=device).to(torch.bfloat16)
        k1_only = lambda: [tk._launch_k1(l, x, m, kv, rows) for l in range(n_layers)]  # noqa: E731
        k2_only = lambda: [tk._launch_k2(l, x, attn_in, rows) for l in range(n_layers)]  # noqa: E731
        parts = {}
        for name, fn in (("k1", k1_only), ("k2", k2_only)):
            g_part, _ = _capture(fn)
            parts[name] = statistics.median(_time_graph(g_part, replays)) * 1e3
            del g_part
        g_ref.replay()
        g_tri.replay()
        torch.cuda.synchronize()
        rel = float((out_tri.float() - out_ref.float()).norm() / out_ref.float().norm())
        health = tk.health()
        kbytes = kv_bytes(dims, n_layers, context, rows)
        roof = (wbytes + kbytes) / bandwidth
        for backend in BACKENDS:
            med = statistics.median(times[backend])
            results.append({
                "profile": profile, "weight_dtype": weight_dtype, "batch": rows, "context": context,
                "layers_timed": n_layers, "layers_model": dims.num_layers, "backend": backend,
                "step_ms": med * 1e3, "step_ms_min": min(times[backend]) * 1e3,
                "step_ms_full_model": med * 1e3 * dims.num_layers / n_layers,
                "weight_bytes": wbytes, "kv_bytes": kbytes, "roofline_ms": roof * 1e3,
                "fraction_of_roofline": roof / med,
                "triton_vs_reference_rel_error": rel, "triton_health": decode_health(health).describe()
                if health else "ok", "triton_k1_only_ms": parts["k1"], "triton_k2_only_ms": parts["k2"],
            })
        base = statistics.median(times["reference-graph"])
        log(f"  batch {rows}: " + ", ".join(
            f"{b} {statistics.median(times[b]) * 1e3:.3f} ms ({roof / statistics.median(times[b]):.1%})" for b in BACKENDS
        ) + f"; triton/graph {base / statistics.median(times['triton']):.2f}x; rel err {rel:.1e}; "
            f"K1 only {parts['k1']:.3f} ms, K2 only {parts['k2']:.3f} ms; health {health}")
        del g_ref, g_tri, out_ref, out_tri, kv
    tk.close()
    del tk, weights
    torch.cuda.empty_cache()
    return results


def markdown_table(doc: dict) -> str:
    lines = [
        f"GPU: {doc['gpu']} ({doc['date']}), read bandwidth {doc['read_bandwidth_gbs']:.0f} GB/s, "
        f"context {doc['context']}, random weights, {doc['layers_note']}",
        "",
        "| model | weights | batch | backend | ms/step | roofline ms | % of roofline | vs stock graph |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = doc["results"]
    for r in rows:
        base = next(x for x in rows if x["profile"] == r["profile"] and x["weight_dtype"] == r["weight_dtype"]
                    and x["batch"] == r["batch"] and x["backend"] == "reference-graph")
        lines.append(
            f"| {r['profile']} | {r['weight_dtype']} | {r['batch']} | {r['backend']} | {r['step_ms']:.3f} | "
            f"{r['roofline_ms']:.3f} | {100 * r['fraction_of_roofline']:.1f} | "
            f"{base['step_ms'] / r['step_ms']:.2f}x |"
        )
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    groups = sorted({(r["profile"], r["weight_dtype"], r["batch"]) for r in rows},
                    key=lambda k: (list(PROFILES).index(k[0]), k[1], k[2]))
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(groups)), 4.5))
    width = 0.8 / len(BACKENDS)
    for i, backend in enumerate(BACKENDS):
        vals = [next(r["fraction_of_roofline"] for r in rows if (r["profile"], r["weight_dtype"], r["batch"]) == g
                     and r["backend"] == backend) * 100 for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], vals, width, label=backend)
    ax.set_xticks([j + width for j in range(len(groups))])
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


def run(profiles, batches, context: int, layers: int | None, fp8_profiles, replays: int, out_dir: Path,
        log=print) -> dict:
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
    R.write_kv = _write_kv_capturable  # the stock baseline must replay from a CUDA graph
    bw = read_bandwidth(device)
    log(f"# read bandwidth {bw / 1e9:.0f} GB/s")
    import triton

    gpu = torch.cuda.get_device_name()
    date = _dt.date.today().isoformat()
    doc = {
        "schema": 1, "gpu": gpu, "date": date, "context": context, "block_size": BLOCK,
        "read_bandwidth_gbs": bw / 1e9, "torch": torch.__version__, "triton": triton.__version__,
        "layers_note": "all layers timed" if layers is None else f"first {layers} layers timed (full-model ms scaled)",
        "method": __doc__.split("\n\n")[1:4],
        "results": [],
    }
    stem = f"decode_latency_{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}_{date}"
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, ppath = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    configs = [(p, "bf16") for p in profiles] + [(p, "fp8") for p in fp8_profiles]
    for p, dtype in configs:
        doc["results"] += bench_config(p, dtype, batches, context, layers, replays, bw, device, log)
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
        doc = run(_csv(a.profiles), _csv(a.batches, int), a.context, a.layers, _csv(a.fp8_profiles), a.replays,
                  Path(a.out))
    except MonodecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(doc))
    print("\n".join(doc["paths"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
