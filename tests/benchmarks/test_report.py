"""The benchmark's verdicts (``monodecode_ops.decode_bench.report``) on synthetic result records:
"stock" is the fastest stock step of the same cell that is within its error tolerance (for FP8
also the BF16 stock of the same cell), a backend outside its tolerance never counts, and the
targets apply where issue 26 sets them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from monodecode_ops.decode_bench import report as RP

ROOT = Path(__file__).resolve().parents[2]


def rec(backend, ms, err=1e-2, profile="llama3-8b", dtype="bf16", context=1024, batch=1, **kw):
    roof = 3.0
    return {
        "profile": profile,
        "weight_dtype": dtype,
        "context": context,
        "batch": batch,
        "backend": backend,
        "step_ms": ms,
        "roofline_ms": roof,
        "fraction_of_roofline": roof / ms if ms else None,
        "fraction_of_spec": 0.9 * roof / ms if ms else None,
        "rel_error_vs_reference": None if backend.startswith("reference") else err,
        **kw,
    }


def doc_of(rows):
    d = {"gpu": "G", "date": "2026-12-03", "read_bandwidth_gbs": 4400.0, "layers_note": "all", "results": rows}
    d["summary"] = RP.summary(d)
    return d


def per_cell(d, **key):
    return next(s for s in d["summary"]["per_config"] if all(s[k] == v for k, v in key.items()))


def test_stock_is_the_fastest_stock_of_the_same_cell():
    rows = [
        rec("reference-graph", 30.0),
        rec("stock-contig-graph", 6.0),
        rec("stock-compiled-graph", 5.5),
        rec("stock-fullgraph", 4.6),
        rec("stock-fullgraph-cdt", 4.2),
        rec("stock-gemm-floor", 3.5),  # not a decode step: never "stock"
        rec("triton", 4.4),
        # another context of the same profile and batch: its faster stock must not leak in
        rec("stock-fullgraph", 2.0, context=8192),
        rec("triton", 5.0, context=8192),
    ]
    d = doc_of(rows)
    s = per_cell(d, context=1024)
    assert (s["stock_backend"], s["stock_ms"]) == ("stock-fullgraph-cdt", 4.2)
    assert s["stock_over_triton"] == pytest.approx(4.2 / 4.4)
    assert s["triton_not_slower_than_stock"] is False and d["summary"]["never_slower_than_stock"] is False
    assert per_cell(d, context=8192)["stock_ms"] == 2.0


def test_a_backend_outside_its_tolerance_does_not_count():
    rows = [
        rec("reference-graph", 30.0),
        rec("stock-fullgraph-cdt", 4.0, err=0.2),  # fast but wrong: not the bar
        rec("stock-fullgraph", 4.6, err=4.9e-2),
        rec("triton", 4.5, err=3e-2),
        rec("reference-graph", 30.0, batch=2),
        rec("stock-fullgraph", 4.6, batch=2),
        rec("triton", 4.0, batch=2, err=float("nan")),  # a NaN error never counts
    ]
    d = doc_of(rows)
    s1, s2 = per_cell(d, batch=1), per_cell(d, batch=2)
    assert s1["stock_backend"] == "stock-fullgraph" and s1["triton_not_slower_than_stock"] is True
    assert s2["triton_counts"] is False and "relative error nan" in s2["triton_not_counted_because"]
    assert s2["stock_over_triton"] is None and d["summary"]["never_slower_than_stock"] is False
    table = RP.summary_table(d)
    assert "| stock-fullgraph-cdt ms |" in table.splitlines()[0]
    assert "4.00 (error)" in table.splitlines()[2]  # shown, marked, not the bar


def test_tolerances_are_the_projects_bounds():
    """The whole-stack bound of the kernels' numerics tests, and the W8A8 stock's own bound."""
    spec = importlib.util.spec_from_file_location("tnum", ROOT / "tests/kernels/triton/test_triton_numerics.py")
    tnum = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tnum)
    assert RP.STACK_REL_FRO == tnum.STACK_REL_FRO
    stock_tests = (ROOT / "tests/benchmarks/test_triton_bench_stock.py").read_text()
    assert f'("tiny", "fp8", "auto", 2, {RP.W8A8_REL:.0e})'.replace("e-0", "e-") in stock_tests
    w8a8 = rec("stock-compiled-graph", 5.0, dtype="fp8", stock_gemm_path="W8A8: per-row e4m3 activations")
    w8a16 = rec("stock-fullgraph-cdt", 3.2, dtype="fp8", stock_gemm_path="W8A16: e4m3 weights widened")
    assert RP.tolerance(w8a8) == RP.W8A8_REL and RP.tolerance(w8a16) == RP.STACK_REL_FRO
    assert RP.tolerance(rec("triton-before", 1.0)) == RP.STACK_REL_FRO
    assert RP.tolerance(rec("stock-gemm-floor", 1.0)) is None and RP.tolerance(rec("reference-graph", 1.0)) is None


def test_fp8_bar_is_the_faster_of_w8a16_and_the_bf16_stock():
    fp8 = {"dtype": "fp8"}
    rows = [
        rec("stock-fullgraph-cdt", 4.1, batch=1),
        rec("stock-fullgraph-cdt", 3.24, batch=1, **fp8),  # W8A16 fused: the bar at batch 1
        rec("stock-compiled-graph", 5.6, batch=1, err=0.14, stock_gemm_path="W8A8", **fp8),  # W8A8: out
        rec("triton", 3.23, batch=1, **fp8),
        rec("stock-fullgraph", 4.8, batch=8),
        rec("stock-compiled-graph", 5.7, batch=8, err=0.05, stock_gemm_path="W8A8", **fp8),
        rec("triton", 4.78, batch=8, **fp8),  # no W8A16 at batch 8: the BF16 stock is the bar
        rec("stock-fullgraph", 4.8, batch=4),
        rec("stock-fullgraph-splitk", 2.9, batch=4, **fp8),  # the split-K W8A16 GEMMs: the bar
        rec("stock-fullgraph-cdt", 9.0, batch=4, **fp8),
        rec("triton", 4.4, batch=4, **fp8),
    ]
    d = doc_of(rows)
    b1, b8 = per_cell(d, batch=1, weight_dtype="fp8"), per_cell(d, batch=8, weight_dtype="fp8")
    assert (b1["stock_backend"], b1["stock_weight_dtype"], b1["stock_ms"]) == ("stock-fullgraph-cdt", "fp8", 3.24)
    assert b1["stock_w8a16_ms"] == 3.24 and b1["stock_bf16_ms"] == 4.1
    assert (b8["stock_backend"], b8["stock_weight_dtype"], b8["stock_ms"]) == ("stock-fullgraph", "bf16", 4.8)
    assert b8["stock_w8a16_ms"] is None and b8["stock_over_triton"] == pytest.approx(4.8 / 4.78)
    b4 = per_cell(d, batch=4, weight_dtype="fp8")
    assert (b4["stock_backend"], b4["stock_ms"], b4["stock_w8a16_backend"]) == ("stock-fullgraph-splitk", 2.9) + (
        "stock-fullgraph-splitk",
    )
    lines = RP.fp8_table(d).splitlines()
    assert lines[2] == "| llama3-8b | 1024 | 1 | 3.23 | 3.24 (cdt) | 4.10 | stock-fullgraph-cdt (fp8) | 1.00x |"
    assert lines[3] == "| llama3-8b | 1024 | 8 | 4.78 | n/a | 4.80 | stock-fullgraph (bf16) | 1.00x |"
    assert lines[4] == "| llama3-8b | 1024 | 4 | 4.40 | 2.90 (splitk) | 4.80 | stock-fullgraph-splitk (fp8) | 0.66x |"
    assert "stock-fullgraph [bf16] 4.80" in RP.summary_table(d)


def test_targets_apply_where_issue_26_sets_them():
    rows = [
        rec("stock-fullgraph", 4.5, context=1024, batch=1),
        rec("triton", 4.0, context=1024, batch=1),  # 1.125x, 75 % of the probe: speed met, fraction not
        rec("stock-fullgraph", 6.0, context=8192, batch=1),
        rec("triton", 5.6, context=8192, batch=1),  # 1.07x < 1.10x at batch 1 up to 8k
        rec("stock-fullgraph", 6.0, context=32768, batch=1),
        rec("triton", 5.6, context=32768, batch=1),  # 1.07x >= 1.00x beyond 8k
        rec("stock-fullgraph", 6.0, context=1024, batch=4),
        rec("triton", 6.0, context=1024, batch=4),  # parity meets >= 1.00x
    ]
    d = doc_of(rows)
    c1 = per_cell(d, context=1024, batch=1)
    assert c1["speed_target"] == 1.10 and c1["speed_target_met"] is True
    assert c1["roofline_target"] == 0.88 and c1["roofline_target_met"] is False
    assert per_cell(d, context=8192)["speed_target_met"] is False
    c32 = per_cell(d, context=32768)
    assert c32["speed_target"] == 1.00 and c32["speed_target_met"] is True and c32["roofline_target"] is None
    assert per_cell(d, batch=4)["speed_target_met"] is True and per_cell(d, batch=4)["roofline_target"] is None
    assert d["summary"]["speed_targets_met"] is False


def test_each_speed_target_says_what_it_asks_of_the_read_probe(capsys):
    """The fraction of the probe a cell's speed target asks is the strongest (counted) stock's
    own fraction times the target; a target asking more than the probe is named as such."""
    from monodecode_ops.decode_bench.harness import print_report

    rows = [
        rec("stock-fullgraph-cdt", 3.2),  # 94 % of the probe: 1.10x asks 103 %
        rec("triton", 3.3),
        rec("stock-fullgraph-cdt", 2.5, batch=8, err=0.3),  # fast but wrong: not what the target asks of
        rec("stock-fullgraph", 3.2, batch=8),  # 94 %: 1.00x asks 94 %
        rec("triton", 3.3, batch=8),
        rec("stock-fullgraph", 4.0, context=8192),  # 75 %: 1.10x asks 82.5 %
        rec("triton", 3.5, context=8192),
    ]
    d = doc_of(rows)
    b1, b8, c8 = per_cell(d, context=1024, batch=1), per_cell(d, batch=8), per_cell(d, context=8192)
    assert b1["stock_fraction_of_roofline"] == pytest.approx(3.0 / 3.2)
    assert b1["speed_target_needs_fraction"] == pytest.approx(1.10 * 3.0 / 3.2)
    assert b8["speed_target_needs_fraction"] == pytest.approx(3.0 / 3.2)
    assert c8["speed_target_needs_fraction"] == pytest.approx(1.10 * 0.75)
    assert d["summary"]["speed_targets_beyond_probe"] == ["llama3-8b bf16 ctx 1024 b1"]
    table = RP.summary_table(d).splitlines()
    assert "| strongest stock | target needs % of probe | stock / triton |" in table[0]
    assert "| stock-fullgraph-cdt 3.20 | 103 % | 0.97x" in table[2]
    assert "| stock-fullgraph 4.00 | 82 % | 1.14x" in table[4]
    assert len({line.count("|") for line in table}) == 1
    print_report(d)
    assert "more than the read probe of a kernel reading the cell's bytes" in capsys.readouterr().out
    assert doc_of(rows[2:])["summary"]["speed_targets_beyond_probe"] == []


def test_skipped_and_failed_cells_show_as_such():
    rows = [
        rec("stock-fullgraph", None, error="skipped: its KV caches need 140.0 GiB", skipped=True),
        rec("triton", None, error="skipped: its KV caches need 140.0 GiB", skipped=True),
        rec("stock-fullgraph", None, batch=2, error="RuntimeError: boom"),
        rec("triton", 4.0, batch=2),
    ]
    d = doc_of(rows)
    assert per_cell(d, batch=1)["triton_counts"] is False and per_cell(d, batch=2)["stock_ms"] is None
    assert d["summary"]["never_slower_than_stock"] is False  # nothing proven where nothing was measured
    table = RP.markdown_table(d)
    assert "| stock-fullgraph | skipped |" in table and "| stock-fullgraph | failed |" in table
    assert "skipped: its KV caches need 140.0 GiB" in table


def test_report_merges_saved_runs_and_prints_the_summary_table_last(tmp_path, capsys):
    """``decode_latency.py --report`` merges runs (one per context, and a schema-3 document whose
    rows carry no context), writes a plot per context and prints the summary table last."""
    from monodecode_ops.decode_bench import harness

    old = doc_of([rec("stock-compiled-graph", 5.3), rec("triton", 4.2)])
    for r in old["results"]:
        del r["context"]
    old["context"] = 1024
    new = doc_of([rec("stock-fullgraph", 11.9, context=32768, batch=8), rec("triton", 17.5, context=32768, batch=8)])
    paths = []
    for i, d in enumerate((old, new)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(d))
    assert harness.main(["--report", *map(str, paths), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert (
        out[-1].startswith("| llama3-8b | bf16 | 32768 | 8 | 3.00 |")
        and "stock-fullgraph 11.90 | 25 % | 0.68x" in out[-1]
    )
    assert out[-2].startswith("| llama3-8b | bf16 | 1024 | 1 | 3.00 |") and "stock-compiled-graph 5.30" in out[-2]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "run0_report_ctx1024.png",
        "run0_report_ctx32768.png",
    ]
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert harness.main(["--report", str(bad)]) == 2
    assert "not a decode_latency result document" in capsys.readouterr().err


def test_a_report_without_out_writes_its_plots_beside_its_first_run(tmp_path, monkeypatch, capsys):
    """Without ``--out`` a merged report's plots go to the first JSON's folder: two merges of one
    day's runs (whose plot names carry only the GPU and the date) never overwrite each other, and
    nothing lands in the working directory's ``benchmarks/results``."""
    from monodecode_ops.decode_bench import harness

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "2026-12-07_run1"
    run.mkdir()
    path = run / "decode_latency_X_2026-12-07.json"
    path.write_text(json.dumps(doc_of([rec("stock-fullgraph", 4.6), rec("triton", 4.2)])))
    assert harness.main(["--report", str(path)]) == 0
    capsys.readouterr()
    assert (run / "decode_latency_X_2026-12-07_report_ctx1024.png").is_file()
    assert not (tmp_path / "benchmarks").exists()


def test_a_merged_report_says_how_many_runs_and_cards_it_holds(tmp_path, capsys):
    """Runs split over several calls count as one machine's only where every document names the
    same card; a document without a card's uuid (saved before it was recorded) is a card of its own."""
    from monodecode_ops.decode_bench import harness

    def header(*uuids):
        paths = []
        for i, u in enumerate(uuids):
            d = doc_of([rec("stock-fullgraph", 5.0, batch=i + 1), rec("triton", 4.0, batch=i + 1)])
            if u:
                d["gpu_uuid"] = u
            paths.append(tmp_path / f"h{len(uuids)}{i}{u}.json")
            paths[-1].write_text(json.dumps(d))
        assert harness.main(["--report", *map(str, paths), "--out", str(tmp_path / "out")]) == 0
        return capsys.readouterr().out.splitlines()[0]

    assert "merged" not in header("a")
    assert "merged from 3 runs on one card:" in header("a", "a", "a")
    assert "merged from 2 runs on 2 cards" in header("a", "b")
    assert "merged from 2 runs on 2 cards" in header("a", None)
    assert "merged from 2 runs on 2 cards" in header(None, None)


def test_a_merged_cell_comes_whole_from_the_last_run_that_timed_it(tmp_path):
    """Two runs of one cell: the merged cell is the later run's, every backend of it, so a ratio
    never sets one run's kernels against another run's stock (here run 1's slow stock draw would
    have made run 2's triton look 1.25x) and a variant only the earlier run timed is not compared
    with the later run's stock."""
    from monodecode_ops.decode_bench import harness

    run1 = doc_of(
        [rec("stock-fullgraph", 5.0), rec("triton", 4.4), rec("triton-kal", 4.5), rec("triton", 5.0, batch=8)]
    )
    run2 = doc_of([rec("stock-fullgraph", 4.0), rec("triton", 4.0)])
    paths = []
    for i, d in enumerate((run1, run2)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(d))
    merged = harness.load_reports([str(p) for p in paths])
    got = {(r["batch"], r["backend"]): r["step_ms"] for r in merged["results"]}
    assert got == {(1, "stock-fullgraph"): 4.0, (1, "triton"): 4.0, (8, "triton"): 5.0}
    assert per_cell(merged, batch=1)["stock_over_triton"] == pytest.approx(1.0)


def test_mono_decodes_verdict_takes_the_faster_counted_launch_of_each_cell():
    """The issue's verdict on mono decode as a whole: a cell is below the stock only where neither
    launch that counts reaches it (the step launch rescues batch 1, not batch 8), a launch outside
    its tolerance never counts (batch 4: nothing counts, so it is below), and batch 1 up to 8k is
    held to 1.10x."""
    S = RP.STEP_BACKEND
    rows = [
        rec("stock-fullgraph", 4.0), rec("triton", 4.2), rec(S, 3.9),
        rec("stock-fullgraph", 4.0, batch=8), rec("triton", 4.1, batch=8), rec(S, 4.2, batch=8),
        rec("stock-fullgraph", 4.0, batch=2), rec("triton", 3.5, batch=2),
        rec("stock-fullgraph", 4.0, batch=4), rec("triton", 3.0, err=0.5, batch=4),
    ]  # fmt: skip
    s = doc_of(rows)["summary"]
    assert s["faster_launch_below_stock"] == ["llama3-8b bf16 ctx 1024 b8 0.976x", "llama3-8b bf16 ctx 1024 b4 n/a"]
    assert s["faster_launch_below_speed_target"] == [
        "llama3-8b bf16 ctx 1024 b1 1.026x < 1.10x",
        "llama3-8b bf16 ctx 1024 b8 0.976x < 1.00x",
        "llama3-8b bf16 ctx 1024 b4 n/a < 1.00x",
    ]


def test_the_back_to_back_table_sets_both_methods_side_by_side():
    """Each way takes its own strongest counted stock (here a different one each way), a backend
    outside its tolerance is left out, and documents without back-to-back times print no table."""
    b2b = "step_ms_back_to_back"
    rows = [
        rec("stock-fullgraph", 5.0, **{b2b: 4.0}),
        rec("stock-fullgraph-cdt", 4.6, **{b2b: 4.4}),
        rec("stock-contig-graph", 3.0, err=0.5, **{b2b: 2.0}),  # outside its tolerance: never the bar
        rec("triton", 4.6, **{b2b: 4.5}),
        rec(RP.STEP_BACKEND, 4.0, **{b2b: 3.2}),
    ]
    table = RP.back_to_back_table(doc_of(rows)).splitlines()
    assert len(table) == 4
    assert table[2].endswith("| triton | 4.600 | 4.500 | 1.000x | 0.889x (stock-fullgraph) |")
    assert table[3].endswith(f"| {RP.STEP_BACKEND} | 4.000 | 3.200 | 1.150x | 1.250x (stock-fullgraph) |")
    assert RP.back_to_back_table(doc_of([rec("stock-fullgraph", 5.0), rec("triton", 4.6)])) == ""


def test_the_step_launch_is_held_to_tritons_rules_beside_it(tmp_path, capsys):
    """The step launch (``STEP_BACKEND``) counts only within the kernels' bound, against the same
    strongest stock as triton in its cell; a width it refused (a skipped cell) is left out of its
    verdict instead of failing it; the summary table, the printed verdict and the plots show it."""
    from monodecode_ops.decode_bench import harness

    step = RP.STEP_BACKEND
    refused = "skipped: the step launch refuses width 8: model_dims: above 1 row ..."
    rows = [
        rec("stock-fullgraph", 4.6),
        rec("triton", 4.4),
        rec(step, 4.0),  # faster than the stock: 1.15x, batch 1 at 1k: the 1.10x target met
        rec("stock-fullgraph", 4.6, batch=2),
        rec("triton", 4.4, batch=2),
        rec(step, 3.0, batch=2, err=6e-2),  # fastest but outside the bound: does not count
        rec("stock-fullgraph", 4.6, batch=8),
        rec("triton", 4.4, batch=8),
        rec(step, None, batch=8, error=refused, skipped=True),
    ]
    d = doc_of(rows)
    b1, b2, b8 = (per_cell(d, batch=b) for b in (1, 2, 8))
    assert b1["stock_over_step"] == pytest.approx(4.6 / 4.0) and b1["step_speed_target_met"] is True
    assert b1["stock_backend"] == "stock-fullgraph"  # the step launch is never the bar
    assert b2["step_counts"] is False and "relative error 6.00e-02 > tolerance 5e-02" in b2["step_not_counted_because"]
    assert b2["stock_over_step"] is None and b2["step_not_slower_than_stock"] is None
    assert b8["step_run"] is False and b8["step_not_counted_because"] == refused
    # batch 2 ran and did not count: the step launch's verdict is not proven; batch 8 is not in it
    assert d["summary"]["step_never_slower_than_stock"] is False
    d2 = doc_of(rows[:3] + rows[6:])
    assert d2["summary"]["step_never_slower_than_stock"] is True and d2["summary"]["step_speed_targets_met"] is True
    assert doc_of(rows[:2])["summary"]["step_never_slower_than_stock"] is None  # no step launch in the run

    table = RP.summary_table(d).splitlines()
    assert f"| triton ms | {step} ms | stock-fullgraph ms |" in table[0]
    assert "| stock / step | stock / step floor |" in table[0]
    assert len({line.count("|") for line in table}) == 1  # every row has the header's columns
    assert "| 1.05x (not met >= 1.10x) | 1.15x (met >= 1.10x) | n/a |" in table[2]  # no floor recorded
    # the floor (the busiest program's share of the weights, ``StepGeometry``) against the same stock
    floored = [dict(r, step_floor_ms=3.5) if r["backend"] == step else r for r in rows]
    assert per_cell(doc_of(floored), batch=1)["stock_over_step_floor"] == pytest.approx(4.6 / 3.5)
    assert "| 1.15x (met >= 1.10x) | 1.31x |" in RP.summary_table(doc_of(floored)).splitlines()[2]
    assert "| skipped |" in table[4]
    assert "stock / step" not in RP.summary_table(doc_of(rows[:2]))
    assert step in RP.LABELS

    path = tmp_path / "d.json"
    path.write_text(json.dumps(d))
    assert harness.main(["--report", str(path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"{step} (the cells it ran) never slower than the strongest stock: False" in out


def test_step_variants_sit_after_the_step_launch_and_stay_out_of_its_verdict():
    """The summary table's triton columns: triton, the step launch, its variants
    (``triton-step-<name>``), then triton's variants, whatever their names; a faster step variant
    changes no verdict (only ``triton-step`` is held to the stock)."""
    step = RP.STEP_BACKEND
    assert RP.is_step_backend(step) and RP.is_step_backend(f"{step}-pf8")
    assert not RP.is_step_backend("triton") and not RP.is_step_backend("triton-stepwise")
    present = {"triton-zeta", "triton-before", f"{step}-ring4", step, "triton", f"{step}-pf8", "stock-fullgraph"}
    assert RP._kernel_backends(present) == [
        "triton",
        step,
        f"{step}-pf8",
        f"{step}-ring4",
        "triton-before",
        "triton-zeta",
    ]
    rows = [
        rec("stock-fullgraph", 4.6),
        rec("triton", 4.4),
        rec(step, 5.0),  # slower than the stock
        rec(f"{step}-pf8", 3.0),  # faster: informational only
        rec("triton-zeta", 4.5),
    ]
    d = doc_of(rows)
    cell1 = per_cell(d, batch=1)
    assert cell1["stock_over_step"] == pytest.approx(4.6 / 5.0) and cell1["step_ms"] == 5.0
    assert cell1["stock_backend"] == "stock-fullgraph"
    assert d["summary"]["step_never_slower_than_stock"] is False
    table = RP.summary_table(d).splitlines()
    assert f"| triton ms | {step} ms | {step}-pf8 ms | triton-zeta ms | stock-fullgraph ms |" in table[0]
    assert len({line.count("|") for line in table}) == 1
    assert f"| {step}-pf8 |" in RP.markdown_table(d)  # every backend in the detailed table


def test_a_step_variant_whose_bits_differ_is_marked():
    """The harness compares each step variant's output with the step launch's, bit for bit
    (``harness.step_variants_same_bits``: plan knobs move bytes, never a sum), and the summary
    table marks a variant that differs, whatever its error."""
    import torch

    from monodecode_ops.decode_bench.harness import step_variants_same_bits

    step = RP.STEP_BACKEND
    base = torch.randn(2, 8).to(torch.bfloat16)
    wrong = base.clone()
    wrong[1, 3] = wrong[1, 3] + 1
    outs = {step: base, f"{step}-ring4": base.clone(), f"{step}-wrong": wrong, "triton": wrong}
    assert step_variants_same_bits(outs) == {f"{step}-ring4": True, f"{step}-wrong": False}
    assert step_variants_same_bits({f"{step}-ring4": base}) == {}  # no step launch to compare with
    nan = base.clone()
    nan[0, 0] = float("nan")  # the same NaN in both: the same bits
    assert step_variants_same_bits({step: nan, f"{step}-ring4": nan.clone()}) == {f"{step}-ring4": True}
    # a plan that changes sums by design (step_plan.SUM_KNOBS) is not held to the bits
    plans = {"ring4": {"ring": 4}, "wrong": {"kv_step": 2}}
    assert step_variants_same_bits(outs, plans) == {f"{step}-ring4": True}
    rows = [
        rec("stock-fullgraph", 4.6),
        rec("triton", 4.4),
        rec(step, 4.0),
        rec(f"{step}-ring4", 3.9, same_bits_as_step=True),
        rec(f"{step}-wrong", 3.8, same_bits_as_step=False),
    ]
    table = RP.summary_table(doc_of(rows))
    assert "| 3.80 (bits differ) |" in table and "| 3.90 |" in table
