"""The strongest stock decode step over a probe's own weights and caches, timed the probe's way.

``step_probe.py`` times its one-launch layer as 20 launches in one CUDA graph
(``attention_probe._replay_us``); the benchmark harness times each step as one graph replay after
a synchronize. A ratio of the two mixes methods and processes. Here the harness's strongest stock
step (``decode_bench.fullgraph.fullgraph_layer``: each layer one ``torch.compile(fullgraph=True,
dynamic=False)`` function, attention inside; optionally with inductor's coordinate-descent tuning,
the strongest at batch 1) runs over the probe's own bf16 weights, norms, K/V caches and position,
and is timed exactly as the probe is: 20 whole steps in one graph, the same replays. So the
stock/probe ratio comes from one process, one method and the same bytes.

The stock step does the math of the harness's stock (bf16 residual between layers, RoPE with the
sign folded into sin); the probe keeps fp32 residuals. Both are checked against the probe's fp32
torch reference (``step_probe.reference``).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from monodecode_ops.decode_bench.fullgraph import (
    FULLGRAPH_STOCKS,
    fastest_draw,
    fullgraph_layer,
    inductor_options,
    tuning_draws,
)
from monodecode_ops.decode_bench.report import STACK_REL_FRO
from monodecode_ops.decode_bench.stock import raise_recompile_limit

# the harness's fullgraph stocks over BF16 weights, by ``--stock`` name -> torch.compile options
KINDS = {
    name.removeprefix("stock-"): inductor_options(**kw) for name, kw in FULLGRAPH_STOCKS.items() if "splitk" not in kw
}
TUNED_KINDS = tuple(k for k, options in KINDS.items() if options)  # drawn (``time_step``'s draws)
KV_REL = 2e-2  # the new position's K/V against the reference's (bf16 rounding: about 4e-3 to 8e-3)


def build_step(kind: str | None, layer_weights, gin, gpost, x, kc, vc, cs, ctx: int, *, nq: int, eps: float):
    """The stock step of ``len(layer_weights)`` layers at position ``ctx`` for every row of ``x``.

    ``layer_weights``: per layer (wqkv [nq*hd + 2*nkv*hd, H], wo [H, nq*hd], wgu [2I, H] gate rows
    first, wd [H, I]) bf16; ``gin``/``gpost``: the norms' weights [L, H]; ``x``: the rows' residuals
    [rows, H]; ``kc``/``vc``: per layer bf16 [rows, nkv, ctx + 1, hd] (one tensor each, as the
    harness's caches are; SDPA attends to every position, unmasked), written at ``ctx`` by the step; ``cs``:
    fp32 [2, hd] cos and sin at ``ctx`` in rotate-half order. ``kind``: a ``KINDS`` name, compiled;
    None: the same function eager (the CPU check). Returns ``(step, out)``: ``step()`` writes the
    last layer's residuals into ``out`` (bf16 [rows, H])."""
    rows, hd = x.shape[0], cs.shape[1]
    nkv = kc[0].shape[1]
    assert all(c.shape[2] == ctx + 1 for c in [*kc, *vc]), "each cache holds exactly the ctx + 1 positions attended"
    inter = layer_weights[0][3].shape[1]
    consts = dict(eps=eps, one_plus=False, nq=nq, nkv=nkv, hd=hd, inter=inter, gelu=False, scale=hd**-0.5, start=0)
    layer = functools.partial(fullgraph_layer, **consts)
    if kind is not None:
        raise_recompile_limit()
        layer = torch.compile(layer, fullgraph=True, dynamic=False, options=KINDS[kind])
    positions = ctx + 1
    half = torch.ones(hd, device=x.device)
    half[: hd // 2] = -1.0  # rotate-half's sign, folded into sin as the stock's tables have it
    cos_t = cs[0].expand(positions, hd).contiguous()
    sin_t = (cs[1] * half).expand(positions, hd).contiguous()
    pos = torch.full((rows,), ctx, dtype=torch.long, device=x.device)
    xb = x.to(torch.bfloat16)
    out = torch.empty_like(xb)

    def step() -> None:
        h = xb
        for l, (wqkv, wo, wgu, wd) in enumerate(layer_weights):
            h = layer(h, pos, kc[l], vc[l], cos_t, sin_t, gin[l], wqkv, None, None, None, wo, None, None, gpost[l],
                      wgu, None, wd, None, None)  # fmt: skip
        out.copy_(h)

    return step, out


def twenty_steps_us(step, reps: int) -> float:
    """The probe's way: 20 ``step``s captured in one CUDA graph, the median µs of one of them over
    ``reps`` replays (``attention_probe._replay_us``: no launch between steps)."""
    from attention_probe import _replay_us

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):  # what ``_replay_us`` divides by
            step()
    return _replay_us(graph, reps)


def kv_rel_error(kc, ctx: int, news) -> float:
    """The worst relative error of the new position's K in the caches ``kc`` (indexed [layer][row,
    head, position]) against the reference's ``news`` (per row, per layer (k, v)), rounded to bf16."""
    return max(
        float((kc[n][b, :, ctx].float() - k.to(torch.bfloat16).float()).norm() / k.norm())
        for b, row in enumerate(news)
        for n, (k, _) in enumerate(row)
    )


def one_step_us(step, reps: int) -> float:
    """The harness's way, as a served step runs: ``step`` alone captured in a CUDA graph, the median
    µs of ``reps`` replays, each between device events and followed by a synchronize, so each
    includes the graph's launch (a stock step is some 80 kernels a step at 8 layers, the probe one)."""
    from monodecode_ops.decode_bench.probes import time_calls

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return statistics.median(time_calls(graph.replay, reps)) * 1e6


def time_step(step, out, reps: int, draws: int = 1) -> tuple[dict, torch.Tensor]:
    """``step`` warmed (compiled, tuned), then the median µs of one of 20 steps captured in one CUDA
    graph (``twenty_steps_us``, as the probe times its launch) and of one step a replay
    (``one_step_us``); ``draws`` times, tuned afresh after the first (``tuning_draws``),
    each way's fastest draw kept (as the harness keeps its). Returns (those µs, the first way's
    draw's compile seconds, every draw's µs both ways and any failed draw's line; that draw's
    output ``out``)."""

    def draw():
        t = time.perf_counter()
        step()
        step()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t
        return [twenty_steps_us(step, reps)], out.clone(), compile_s, one_step_us(step, reps)

    got, failed = tuning_draws(draw, draws)
    (us,), best, compile_s, _ = fastest_draw(got)
    timed = {"us_per_step": us, "us_per_step_one_replay": min(g[3] for g in got), "compile_s": round(compile_s, 1)}
    if draws > 1:
        timed.update(
            draws_us=[round(g[0][0], 2) for g in got],
            draws_us_one_replay=[round(g[3], 2) for g in got],
            failed_draws=failed,
        )
    return timed, best


def counts(c: dict, tolerance: float = STACK_REL_FRO) -> bool:
    """Whether a timed cell counts: its output within ``tolerance`` of the fp32 reference (the
    harness's bound on a whole step) after its first launch and after the replays (where a race
    between back-to-back launches would show), and its new K/V within ``KV_REL`` (a wrong cache slot
    barely moves the output); a missing or NaN error does not count."""
    errors = [(c.get(k), bound) for k, bound in (("rel_error", tolerance), ("kv_rel_error", KV_REL))]
    if "stock" not in c:  # the probe's kernel: also after the graph's replays
        errors.append((c.get("rel_error_after_replays"), tolerance))
    return "us_per_layer" in c and all(err is not None and err <= bound for err, bound in errors)


def side_by_side(cells: list[dict], tolerance: float = STACK_REL_FRO) -> list[dict]:
    """Per (context, batch): the fastest probe cell and the fastest stock cell that count
    (``counts``), and stock µs / probe µs; the same timed one step a replay (``one_step_us``),
    each side's fastest that way (not necessarily the same cells)."""
    best: dict[tuple, dict] = {}
    one: dict[tuple, dict] = {}
    for c in cells:
        if not counts(c, tolerance):
            continue
        key = (c["context"], c["batch"], "stock" if "stock" in c else "probe")
        if key not in best or c["us_per_layer"] < best[key]["us_per_layer"]:
            best[key] = c
        if "us_per_layer_one_replay" in c and (
            key not in one or c["us_per_layer_one_replay"] < one[key]["us_per_layer_one_replay"]
        ):
            one[key] = c
    out = []
    for ctx, batch in sorted({k[:2] for k in best}):
        p, s = best.get((ctx, batch, "probe")), best.get((ctx, batch, "stock"))
        row = {"context": ctx, "batch": batch}
        if p:
            row["probe_us_per_layer"] = p["us_per_layer"]
        if s:
            row.update(stock=s["stock"], stock_us_per_layer=s["us_per_layer"])
        if p and s:
            row["stock_over_probe"] = round(s["us_per_layer"] / p["us_per_layer"], 3)
        p1, s1 = one.get((ctx, batch, "probe")), one.get((ctx, batch, "stock"))
        if p1 and s1:
            row.update(
                probe_us_per_layer_one_replay=p1["us_per_layer_one_replay"],
                stock_one_replay=s1["stock"],
                stock_us_per_layer_one_replay=s1["us_per_layer_one_replay"],
                stock_over_probe_one_replay=round(s1["us_per_layer_one_replay"] / p1["us_per_layer_one_replay"], 3),
            )
        out.append(row)
    return out


def plot(rows: list[dict], title: str, path) -> None:
    """``side_by_side`` rows as µs a layer per batch, one panel per context (probe and stock bars,
    the ratio above each pair); written whole or not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from monodecode_ops.plots import save_png

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 4.2), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        mine = sorted((r for r in rows if r["context"] == ctx), key=lambda r: r["batch"])
        xs = range(len(mine))
        probe = [r.get("probe_us_per_layer", 0.0) for r in mine]
        stock = [r.get("stock_us_per_layer", 0.0) for r in mine]
        ax.bar([x - 0.2 for x in xs], probe, 0.4, label="one-launch probe")
        ax.bar([x + 0.2 for x in xs], stock, 0.4, label="strongest stock (fastest kind)")
        for x, r in zip(xs, mine):
            if "stock_over_probe" in r:
                ax.annotate(f"{r['stock_over_probe']:.2f}x", (x, max(probe[x], stock[x])), ha="center", va="bottom")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"b{r['batch']}" for r in mine])
        ax.set_title(f"context {ctx}")
        ax.set_ylabel("µs a layer (20 steps a graph)")
        ax.set_ylim(0, 1.15 * max(probe + stock))
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
