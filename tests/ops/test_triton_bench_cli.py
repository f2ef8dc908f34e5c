"""``monodecode-ops bench`` (wrapping monodecode_ops.decode_bench.harness): argument errors are one line,
a machine without a GPU gets one line saying so, and the report table is computed from results."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from monodecode_ops.cli import app
from monodecode_ops.commands.bench import load_harness


def _run(*args):
    return CliRunner().invoke(app, ["bench", *args])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batch", "x"], "error: --batch must be comma-separated integers, got 'x'"),
        (["--batch", ","], "error: --batch must list at least one value"),
        (["--profile", "nope", "--batch", "1"], "error: Invalid value for '--profile': unknown model profile 'nope'"),
        (["--fp8-profile", "tiny,nope"], "error: Invalid value for '--fp8-profile': unknown model profile 'nope'"),
        (["--batch", "1,32", "--profile", "tiny"], "error: batches must be in 1..16, got [1, 32]"),
        (["--replays", "0"], "error: --layers must be >= 0 and --replays >= 1"),
    ],
)
def test_bad_arguments_are_one_line(args, message):
    res = _run(*args)
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), res.output


def test_without_gpu_one_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run for minutes")
    res = _run("--profile", "tiny", "--batch", "1", "--fp8-profile", "")
    assert res.exit_code == 2
    assert res.output.strip() == "error: the decode benchmark needs a CUDA or ROCm GPU; torch sees none"


def _doc(h, times):
    rows = []
    for backend, ms in zip(("reference-graph", "stock-contig-graph", "stock-fullgraph", "triton"), times):
        rows.append(
            dict(
                profile="llama3-8b",
                weight_dtype="bf16",
                context=1024,
                batch=1,
                backend=backend,
                step_ms=ms,
                roofline_ms=1.0,
                fraction_of_roofline=(1.0 / ms) if ms else None,
                rel_error_vs_reference=None if backend.startswith("reference") else 1e-2,
            )
        )
    doc = dict(gpu="G", date="2026-01-01", read_bandwidth_gbs=4000.0, layers_note="all layers timed", results=rows)
    doc["summary"] = h.summary(doc)
    return doc


def test_report_rows_relate_every_backend_to_the_strongest_stock():
    h = load_harness()
    doc = _doc(h, (8.0, 4.0, 3.0, 2.0))
    from monodecode_ops.commands.bench import report_rows

    rows = report_rows(h, doc)
    assert rows[-1] == ("llama3-8b", "bf16", 1024, 1, "triton K1/K2", "2.000", "1.000", "50 %", "1.50x")
    assert rows[1][4:] == ("stock per-op graph, contiguous KV", "4.000", "1.000", "25 %", "0.75x")
    assert doc["summary"]["never_slower_than_stock"] is True


def test_slower_than_stock_and_failed_measurements_are_reported():
    h = load_harness()
    doc = _doc(h, (8.0, 2.0, 1.5, 2.5))
    assert doc["summary"]["never_slower_than_stock"] is False
    assert doc["summary"]["per_config"][0]["stock_over_triton"] == 0.6
    failed = _doc(h, (8.0, None, None, 2.5))
    assert failed["summary"]["never_slower_than_stock"] is False  # no stock number: not proven
    from monodecode_ops.commands.bench import report_rows

    rows = report_rows(h, failed)
    assert rows[1][4:6] == ("stock per-op graph, contiguous KV", "failed") and rows[-1][-1] == "n/a"


# ---- bench --endpoint (monodecode_ops.serving_bench); the live-server runs are in tests/e2e ----


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--endpoint", "ftp://x"],
            "error: --endpoint must be an http(s) URL such as http://127.0.0.1:8000, got 'ftp://x'",
        ),
        (["--endpoint", "http://a:1", "--concurrency", "0"], "error: --concurrency values must be in 1..256, got [0]"),
        (
            ["--endpoint", "http://a:1", "--max-tokens", "1"],
            "error: --requests must be in 1..10000 and --max-tokens in 2..65536, got 8 and 1",
        ),
        (["--endpoint", "http://a:1", "--endpoint", "http://a:1/v1"], "error: the same --endpoint is given twice"),
    ],
)
def test_endpoint_arguments_are_one_line(args, message, tmp_path):
    res = _run(*args, "--out", str(tmp_path))
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith(message), res.output
    assert not list(tmp_path.iterdir())


def test_unreachable_and_non_openai_endpoints_are_one_line(tmp_path):
    import http.server
    import threading

    port = _free_port()
    res = _run("--endpoint", f"http://127.0.0.1:{port}", "--out", str(tmp_path))
    assert res.exit_code == 2
    assert res.output.strip().startswith(f"error: endpoint http://127.0.0.1:{port}: cannot connect ("), res.output

    # a real HTTP server that is not an OpenAI-compatible one
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # the server's access log would land in the captured output
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        res = _run("--endpoint", url, "--out", str(tmp_path))
    finally:
        server.shutdown()
        server.server_close()
    assert res.exit_code == 2
    assert res.output.strip() == (
        f"error: endpoint {url}: GET /v1/models answered HTTP 404: not an OpenAI-compatible server"
    ), res.output
    assert not list(tmp_path.iterdir())


def test_percentiles_match_numpys_linear_interpolation():
    import numpy as np

    from monodecode_ops.serving_bench import percentiles

    xs = [0.004, 0.001, 0.003, 0.010, 0.002, 0.0025, 0.007]
    got = percentiles(xs)
    for p in (50, 90, 99):
        assert got[f"p{p}"] == pytest.approx(1000 * np.percentile(xs, p), rel=1e-12)
    assert all(v != v for v in percentiles([]).values())  # NaN when nothing was measured


def test_mono_fraction_counts_decode_steps_only():
    from monodecode_ops.serving_bench import step_delta

    before = {"mono": 10.0, "fallback": 5.0, "reasons": {"prefill": 5.0, "rows_exceed_width": 0.0}}
    after = {"mono": 40.0, "fallback": 25.0, "reasons": {"prefill": 15.0, "rows_exceed_width": 10.0}}
    d = step_delta(before, after)
    # 30 mono + 10 rows_exceed_width decode steps; the 10 prefill steps are not decode steps
    assert d == {
        "mono": 30.0,
        "decode": 40.0,
        "fraction": 0.75,
        "reasons": {"prefill": 10.0, "rows_exceed_width": 10.0},
    }
    assert step_delta(None, after)["fraction"] is None


def test_base_url_accepts_what_operators_paste():
    from monodecode_ops.serving_bench import base_url

    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/metrics", "http://h:8000/v1/"):
        assert base_url(url) == "http://h:8000"
