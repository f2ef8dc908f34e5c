"""The decode benchmark's verdicts, tables and plots, from its result records (no GPU needed).

A result record is one backend in one cell (profile, weight dtype, context, batch): ``step_ms``
(None when it failed or was skipped), ``roofline_ms``, ``fraction_of_roofline`` (against the
fastest read probe), ``fraction_of_spec``, ``rel_error_vs_reference`` and, for a step variant,
``same_bits_as_step`` (its output against the step launch's: plan knobs move bytes, never a sum).

Verdict rules:
- A backend counts only within its tolerance (``tolerance``): the relative error of its output
  after every layer against the reference graph's, the project's whole-stack bound for the
  kernels (``STACK_REL_FRO``, tests/kernels/triton/test_triton_numerics.py) for every backend
  that computes the reference's math, and the W8A8 stock's own bound (``W8A8_REL``,
  tests/benchmarks/test_triton_bench_stock.py) for it.
- "Stock" is the fastest counted stock step of the cell (``STOCK_BACKENDS``). For FP8 cells
  the BF16 stock of the same profile, context and batch is a candidate too: a user with the
  model can run it in BF16, and the W8A8 stock is slower than the BF16 GEMMs.
- The step launch (``STEP_BACKEND``, one launch a step over every layer) is held to triton's
  rules beside it in each cell: it counts only within the same bound, against the same stock;
  the cells it did not run (a width it refuses, a skipped cell) are left out of its verdict. Its
  variants (``triton-step-<name>``), like triton's, are in no verdict: only in the tables, where
  one whose output differs from the step launch's is marked "(bits differ)".
"""

from __future__ import annotations

from pathlib import Path

from monodecode_ops.plots import save_png

# Whole-stack relative error of the kernels (test_triton_numerics.STACK_REL_FRO).
STACK_REL_FRO = 5e-2
# W8A8 stock (e4m3 activations): its bound in test_triton_bench_stock.py.
W8A8_REL = 6e-2
STOCK_BACKENDS = (
    "stock-graph",
    "stock-contig-graph",
    "stock-compiled-graph",
    "stock-fullgraph",
    "stock-fullgraph-cdt",
    "stock-fullgraph-cdt-wide",
    "stock-fullgraph-max",
    "stock-fullgraph-splitk",
)
# The W8A16 stocks of an FP8 cell: inductor's fused dequant (coordinate descent, either search; it
# fuses at one row only, ``--w8a16-batches``) and the split-K Triton GEMM.
W8A16_FUSED = ("stock-fullgraph-cdt", "stock-fullgraph-cdt-wide")
W8A16_BACKENDS = (*W8A16_FUSED, "stock-fullgraph-splitk")
# The step launch (``kernels/triton/step_launch.py``), timed beside ``triton`` where it runs;
# its variants (a changed plan, ``--step-variants``) as ``triton-step-<name>`` beside it.
STEP_BACKEND = "triton-step"
LABELS = {
    "reference-eager": "reference (oracle) eager",
    "reference-graph": "reference (oracle) graph",
    "stock-graph": "stock per-op graph, paged KV",
    "stock-contig-graph": "stock per-op graph, contiguous KV",
    "stock-compiled-graph": "stock compiled halves around attention, one graph",
    "stock-fullgraph": "stock whole-layer fullgraph compile, one graph",
    "stock-fullgraph-cdt": "stock whole-layer fullgraph + coordinate descent tuning",
    "stock-fullgraph-cdt-wide": "stock whole-layer fullgraph + coordinate descent, wider search",
    "stock-fullgraph-max": "stock whole-layer fullgraph + max-autotune GEMMs",
    "stock-fullgraph-splitk": "stock whole-layer fullgraph, split-K W8A16 GEMMs",
    "stock-gemm-floor": "stock GEMMs only (floor)",
    "triton": "triton K1/K2",
    STEP_BACKEND: "triton step launch (every layer one launch)",
}
# Issue 26, "Done when": fraction of the read probe at batch 1, context 1024 ...
TARGETS = {
    ("llama3-1b", "bf16"): 0.70,
    ("llama3-8b", "bf16"): 0.88,
    ("gemma3-27b", "bf16"): 0.90,
    ("llama3-8b", "fp8"): 0.70,
}
TARGET_CONTEXT = 1024
# ... and against the strongest stock: >= 1.00x in every cell, >= 1.10x at batch 1 up to 8k.
SPEED_TARGET, SPEED_TARGET_B1, SPEED_TARGET_B1_MAX_CONTEXT = 1.00, 1.10, 8192


def cell(r: dict) -> tuple:
    return (r["profile"], r["weight_dtype"], r.get("context"), r["batch"])


def is_step_backend(backend: str) -> bool:
    """Whether ``backend`` is the step launch or one of its variants (timed with ``forward_step``)."""
    return backend == STEP_BACKEND or backend.startswith(STEP_BACKEND + "-")


def step_variant_backend(name: str) -> str:
    """The backend a step variant (``--step-variants``' ``name``) is timed and reported as."""
    return f"{STEP_BACKEND}-{name}"


def tolerance(r: dict) -> float | None:
    """The relative error a backend may show and still count; None: not a decode step of its own
    (the oracle, the GEMM floor)."""
    b = r["backend"]
    if b.startswith("reference") or b == "stock-gemm-floor":
        return None
    if r["weight_dtype"] != "bf16" and b in STOCK_BACKENDS and str(r.get("stock_gemm_path") or "").startswith("W8A8"):
        return W8A8_REL
    return STACK_REL_FRO


def counts(r: dict | None) -> tuple[bool, str]:
    """(whether ``r`` counts in a verdict, why not)."""
    if not r or r.get("step_ms") is None:
        return False, (r or {}).get("error") or "not measured"
    tol = tolerance(r)
    if tol is None:
        return True, ""
    err = r.get("rel_error_vs_reference")
    if err is None:
        return False, "no error measured against the reference"
    if not err <= tol:  # NaN fails too
        return False, f"relative error {err:.2e} > tolerance {tol:.0e}"
    return True, ""


def find(rows: list[dict], r: dict, backend: str, weight_dtype: str | None = None) -> dict | None:
    key = (r["profile"], weight_dtype or r["weight_dtype"], r.get("context"), r["batch"])
    return next((x for x in rows if cell(x) == key and x["backend"] == backend), None)


def best_stock(rows: list[dict], r: dict, weight_dtype: str | None = None, timed: str = "step_ms") -> dict | None:
    """The fastest counted stock step of ``r``'s cell (with ``weight_dtype``: of that dtype's cell),
    by its ``timed`` time (``step_ms``, or ``step_ms_back_to_back``)."""
    got = [x for b in STOCK_BACKENDS if (x := find(rows, r, b, weight_dtype)) and counts(x)[0] and x.get(timed)]
    return min(got, key=lambda x: x[timed], default=None)


def strongest_stock(rows: list[dict], r: dict, timed: str = "step_ms") -> dict | None:
    """ "Stock" in every verdict: the fastest counted stock step of the cell; for FP8 also the
    BF16 stock of the same profile, context and batch."""
    got = [best_stock(rows, r, timed=timed)]
    if r["weight_dtype"] != "bf16":
        got.append(best_stock(rows, r, "bf16", timed))
    return min((x for x in got if x), key=lambda x: x[timed], default=None)


def _ratio(base: dict | None, r: dict | None) -> float | None:
    if not base or not r or not base.get("step_ms") or not r.get("step_ms"):
        return None
    return base["step_ms"] / r["step_ms"]


def against_stock(rows: list[dict], r: dict) -> tuple[bool, str, dict | None, float | None, float]:
    """A kernel backend's row ``r`` in its cell's verdict: (whether it counts, why not, the
    strongest stock, stock ms / its ms where it counts, the cell's speed target)."""
    ok, why = counts(r)
    stock = strongest_stock(rows, r)
    ratio = _ratio(stock, r) if ok else None
    speed_target = SPEED_TARGET
    if r["batch"] == 1 and (r.get("context") or 0) <= SPEED_TARGET_B1_MAX_CONTEXT:
        speed_target = SPEED_TARGET_B1
    return ok, why, stock, ratio, speed_target


def _step_verdict(rows: list[dict], r: dict) -> dict:
    """The step launch's row of ``r``'s cell against the same stock (empty: not in this cell)."""
    step = find(rows, r, STEP_BACKEND)
    if step is None:
        return {}
    ok, why, stock, ratio, speed_target = against_stock(rows, step)
    return {
        "step_ms": step.get("step_ms"),
        "step_run": not step.get("skipped"),
        "step_counts": ok,
        "step_not_counted_because": why or None,
        "stock_over_step": ratio,
        "step_not_slower_than_stock": (ratio >= 1.0) if ratio else None,
        "step_speed_target_met": (ratio >= speed_target) if ratio else None,
        "step_fraction_of_roofline": step.get("fraction_of_roofline") if ok else None,
        # the most the step launch's tiling allows against this stock (``StepGeometry.busiest_program_share``)
        "stock_over_step_floor": _ratio(stock, {"step_ms": step.get("step_floor_ms")}),
    }


def summary(doc: dict) -> dict:
    """Per cell: triton (and the step launch, where timed) against the strongest stock, and the
    issue's targets."""
    rows = doc["results"]
    out = []
    for r in rows:
        if r["backend"] != "triton":
            continue
        ok, why, stock, ratio, speed_target = against_stock(rows, r)
        target = None
        if r["batch"] == 1 and r.get("context") == TARGET_CONTEXT:
            target = TARGETS.get((r["profile"], r["weight_dtype"]))
        frac = r.get("fraction_of_roofline") if ok else None
        # the fraction of the read probe the speed target asks of a kernel reading this cell's bytes:
        # the strongest stock's own fraction times the target (above 1: faster than the probe reads)
        stock_frac = (stock or {}).get("fraction_of_roofline")
        item = {
            "profile": r["profile"],
            "weight_dtype": r["weight_dtype"],
            "context": r.get("context"),
            "batch": r["batch"],
            "triton_ms": r.get("step_ms"),
            "triton_counts": ok,
            "triton_not_counted_because": why or None,
            "stock_ms": (stock or {}).get("step_ms"),
            "stock_backend": (stock or {}).get("backend"),
            "stock_weight_dtype": (stock or {}).get("weight_dtype"),
            "stock_over_triton": ratio,
            "triton_not_slower_than_stock": (ratio >= 1.0) if ratio else None,
            "speed_target": speed_target,
            "speed_target_met": (ratio >= speed_target) if ratio else None,
            "stock_fraction_of_roofline": stock_frac,
            "speed_target_needs_fraction": speed_target * stock_frac if stock_frac else None,
            "triton_fraction_of_roofline": frac,
            "triton_fraction_of_spec": r.get("fraction_of_spec") if ok else None,
            "roofline_target": target,
            "roofline_target_met": (frac >= target) if target and frac else (False if target else None),
            **_step_verdict(rows, r),
        }
        if r["weight_dtype"] != "bf16":  # the two FP8 bars, side by side
            got = [x for b in W8A16_BACKENDS if (x := find(rows, r, b)) and counts(x)[0]]
            w8a16 = min(got, key=lambda x: x["step_ms"], default=None)
            bf16 = best_stock(rows, r, "bf16")
            item["stock_w8a16_ms"] = (w8a16 or {}).get("step_ms")
            item["stock_w8a16_backend"] = (w8a16 or {}).get("backend")
            item["stock_bf16_ms"] = (bf16 or {}).get("step_ms")
            item["stock_bf16_backend"] = (bf16 or {}).get("backend")
        out.append(item)
    verdicts = [x["triton_not_slower_than_stock"] for x in out]
    ran = [x for x in out if x.get("step_run")]  # cells the step launch was built for and not skipped
    # issue 26's verdict on mono decode as a whole: each cell with the faster of its two launches
    # (a launch counts only within its error bound); a cell where neither counts is below
    best = [(x, max((v for v in (x["stock_over_triton"], x.get("stock_over_step")) if v), default=None)) for x in out]
    return {
        "per_config": out,
        "never_slower_than_stock": all(v is True for v in verdicts) if verdicts else None,
        "speed_targets_met": all(x["speed_target_met"] is True for x in out) if out else None,
        "step_never_slower_than_stock": all(x["step_not_slower_than_stock"] is True for x in ran) if ran else None,
        "step_speed_targets_met": all(x["step_speed_target_met"] is True for x in ran) if ran else None,
        "faster_launch_below_stock": [f"{_cell_name(x)} {_x3(v)}" for x, v in best if not v or v < 1.0],
        "faster_launch_below_speed_target": [
            f"{_cell_name(x)} {_x3(v)} < {x['speed_target']:.2f}x" for x, v in best if not v or v < x["speed_target"]
        ],
        # cells whose speed target no kernel reading the cell's bytes can meet (it asks more than the probe)
        "speed_targets_beyond_probe": [_cell_name(x) for x in out if (x["speed_target_needs_fraction"] or 0) > 1.0],
    }


def _cell_name(x: dict) -> str:
    return f"{x['profile']} {x['weight_dtype']} ctx {x['context']} b{x['batch']}"


def _ms(r: dict | None, digits: int = 3) -> str:
    if not r:
        return "n/a"
    if r.get("step_ms") is None:
        return "skipped" if r.get("skipped") else "failed"
    wrong = " (bits differ)" if r.get("same_bits_as_step") is False else ""  # a step variant unlike the step
    return f"{r['step_ms']:.{digits}f}{wrong}"


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "n/a"


def _x3(v: float | None) -> str:
    return f"{v:.3f}x" if v else "n/a"


def _pct(v: float | None) -> str:
    return f"{100 * v:.0f} %" if v else "n/a"


def markdown_table(doc: dict) -> str:
    """Every backend per cell; the ratio is the strongest stock's time over this backend's."""
    m, source = doc.get("merged"), ""
    if m and m["documents"] > 1:
        cards = "one card" if m["gpus"] == 1 else f"{m['gpus']} cards (or runs that did not record theirs)"
        source = (
            f"; merged from {m['documents']} runs on {cards}: the first run's probe, each row's roofline its own run's"
        )
    lines = [
        f"GPU: {doc['gpu']} ({doc['date']}), read probe {doc['read_bandwidth_gbs']:.0f} GB/s, random weights, "
        f"{doc['layers_note']}{source}",
        "",
        "| model | weights | context | batch | backend | ms/step | roofline ms | % of probe | rel. error | counts "
        "| stock / this |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = doc["results"]
    for r in rows:
        ok, why = counts(r)
        err = r.get("rel_error_vs_reference")
        lines.append(
            f"| {r['profile']} | {r['weight_dtype']} | {r.get('context')} | {r['batch']} | {r['backend']} | {_ms(r)} | "
            f"{r['roofline_ms']:.3f} | {_pct(r.get('fraction_of_roofline'))} | "
            f"{f'{err:.1e}' if err is not None else '-'} | {'yes' if ok else why} | "
            f"{_x(_ratio(strongest_stock(rows, r), r))} |"
        )
    return "\n".join(lines)


def report_rows(doc: dict) -> list[tuple]:
    """One row per result (profile, weights, context, batch, backend label, ms, roofline ms,
    % of the probe, ratio of the strongest stock over it); a failed measurement shows as 'failed'."""
    rows = []
    for r in doc["results"]:
        rows.append(
            (
                r["profile"],
                r["weight_dtype"],
                r.get("context"),
                r["batch"],
                LABELS.get(r["backend"], r["backend"]),
                _ms(r),
                f"{r['roofline_ms']:.3f}",
                _pct(r.get("fraction_of_roofline")),
                _x(_ratio(strongest_stock(doc["results"], r), r)),
            )
        )
    return rows


def _kernel_backends(present: set[str]) -> list[str]:
    """The triton builds among ``present``: triton first, the step launch next, its variants, then
    triton's variants."""
    return sorted(
        (b for b in present if b.startswith("triton")),
        key=lambda b: (b != "triton", b != STEP_BACKEND, not is_step_backend(b), b),
    )


def _backends(rows: list[dict]) -> list[str]:
    present = {r["backend"] for r in rows}
    return _kernel_backends(present) + [b for b in STOCK_BACKENDS if b in present]


def summary_table(doc: dict) -> str:
    """The table printed last: per (profile, context, batch) the roofline, every triton build's and
    stock step's ms, the strongest stock (name and ms), the fraction of the read probe the cell's
    speed target asks (the stock's fraction times the target), triton's speed-up over it (and the step
    launch's, where it was timed) and its fraction of the read probe (and of the datasheet
    bandwidth)."""
    rows = doc["results"]
    cols = _backends(rows)
    step = STEP_BACKEND in cols
    lines = [
        "| model | weights | context | batch | roofline ms | "
        + " | ".join(f"{c} ms" for c in cols)
        + " | strongest stock | target needs % of probe | stock / triton"
        + (" | stock / step | stock / step floor" if step else "")
        + " | triton % of probe | triton % of spec |",
        "| " + " | ".join(["---"] * (10 + len(cols) + 2 * step)) + " |",
    ]
    summ = {cell(s): s for s in summary(doc)["per_config"]}
    for r in rows:
        if r["backend"] != "triton":
            continue
        s = summ[cell(r)]

        def ms(b):
            x = find(rows, r, b)
            ok, _ = counts(x)
            return _ms(x, 2) + ("" if ok or not x or x.get("step_ms") is None else " (error)")

        stock = "n/a"
        if s["stock_backend"]:
            dt = "" if s["stock_weight_dtype"] == r["weight_dtype"] else f" [{s['stock_weight_dtype']}]"
            stock = f"{s['stock_backend']}{dt} {s['stock_ms']:.2f}"
        verdict = _x(s["stock_over_triton"])
        if s["speed_target_met"] is not None:
            verdict += f" ({'met' if s['speed_target_met'] else 'not met'} >= {s['speed_target']:.2f}x)"
        if step:
            verdict += f" | {_x(s.get('stock_over_step'))}"
            if s.get("step_speed_target_met") is not None:
                verdict += f" ({'met' if s['step_speed_target_met'] else 'not met'} >= {s['speed_target']:.2f}x)"
            verdict += f" | {_x(s.get('stock_over_step_floor'))}"
        frac = _pct(s["triton_fraction_of_roofline"])
        if s["roofline_target"]:
            frac += f" ({'met' if s['roofline_target_met'] else 'not met'} >= {100 * s['roofline_target']:.0f} %)"
        lines.append(
            f"| {r['profile']} | {r['weight_dtype']} | {r.get('context')} | {r['batch']} | {r['roofline_ms']:.2f} | "
            + " | ".join(ms(c) for c in cols)
            + f" | {stock} | {_pct(s['speed_target_needs_fraction'])} | {verdict} | {frac} | {_pct(s['triton_fraction_of_spec'])} |"
        )
    return "\n".join(lines)


def fp8_table(doc: dict) -> str:
    """FP8 triton against its bars: the fastest W8A16 stock (inductor's fused dequant at one row,
    the split-K Triton GEMM) and the BF16 stock of the same cell."""
    items = [s for s in summary(doc)["per_config"] if s["weight_dtype"] != "bf16"]
    if not items:
        return ""
    lines = [
        "| model | context | batch | triton fp8 ms | W8A16 stock ms | BF16 stock ms | bar | stock / triton |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in items:
        w, b = s.get("stock_w8a16_ms"), s.get("stock_bf16_ms")
        wtxt = f"{w:.2f} ({s['stock_w8a16_backend'].removeprefix('stock-fullgraph-')})" if w else "n/a"
        bar = "n/a" if not s["stock_backend"] else f"{s['stock_backend']} ({s['stock_weight_dtype']})"
        tri = f"{s['triton_ms']:.2f}" if s["triton_ms"] else "n/a"
        lines.append(
            f"| {s['profile']} | {s['context']} | {s['batch']} | {tri} | {wtxt} | "
            f"{f'{b:.2f}' if b else 'not run'} | {bar} | {_x(s['stock_over_triton'])} |"
        )
    return "\n".join(lines)


BACK_TO_BACK_MS = "step_ms_back_to_back"  # a row's median step with replays queued back to back


def back_to_back_table(doc: dict) -> str:
    """Each cell's kernels against the strongest stock timed two ways: one replay after a
    synchronize (the verdicts': every step pays its graph's submission, a fixed cost that moves
    the ratios toward 1x) and replays queued back to back (the host ahead of the device, as under
    vLLM's asynchronous scheduling). Each way takes its own strongest stock. Empty where no cell
    has back-to-back times (documents saved before they were recorded)."""
    rows = doc["results"]
    lines = [
        "| model | weights | context | batch | backend | ms, one replay | ms, back to back | stock / this, one replay | stock / this, back to back |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["backend"] != "triton":
            continue
        one, b2b = strongest_stock(rows, r), strongest_stock(rows, r, BACK_TO_BACK_MS)
        if not b2b:
            continue
        for x in (r, find(rows, r, STEP_BACKEND)):
            if not x or not counts(x)[0] or not x.get(BACK_TO_BACK_MS):
                continue
            lines.append(
                f"| {r['profile']} | {r['weight_dtype']} | {r.get('context')} | {r['batch']} | {x['backend']} | "
                f"{x['step_ms']:.3f} | {x[BACK_TO_BACK_MS]:.3f} | {_x3(_ratio(one, x))} | "
                f"{_x3(b2b[BACK_TO_BACK_MS] / x[BACK_TO_BACK_MS])} ({b2b['backend']}) |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def probe_lines(doc: dict) -> list[str]:
    spec = doc.get("spec_bandwidth_gbs")
    out = []
    for name, gbs in sorted((doc.get("read_probes_gbs") or {}).items(), key=lambda kv: -kv[1]):
        out.append(f"read probe {name}: {gbs:.0f} GB/s" + (f" ({100 * gbs / spec:.1f} % of spec)" if spec else ""))
    if spec:
        out.append(f"datasheet bandwidth {spec:.0f} GB/s; roofline uses the fastest probe")
    return out


def plot(doc: dict, path: Path, context: int | None = None) -> None:
    """Bars of % of the roofline per backend and (profile, dtype, batch), for one context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from monodecode.model.profiles import PROFILES

    rows = [r for r in doc["results"] if context is None or r.get("context") == context]
    order = list(PROFILES)
    groups = sorted(
        {(r["profile"], r["weight_dtype"], r["batch"]) for r in rows},
        key=lambda k: (order.index(k[0]) if k[0] in order else len(order), k[1], k[2]),
    )
    present = {r["backend"] for r in rows}
    shown = [b for b in ("reference-graph", *STOCK_BACKENDS, "stock-gemm-floor") if b in present]
    shown += _kernel_backends(present)
    fig, ax = plt.subplots(figsize=(max(8, 0.25 * len(shown) * len(groups) + 2), 5.2))
    width = 0.8 / max(1, len(shown))
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
    ax.set_ylabel("% of memory roofline (fastest read probe)")
    ax.set_ylim(0, 100)
    ax.axhline(100, color="k", lw=0.5)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"Decode step vs roofline, {doc['gpu']}, context {context} ({doc['date']})")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
