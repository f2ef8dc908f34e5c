"""``monodecode-ops bench`` (wrapping benchmarks/decode_latency.py): argument errors are one line,
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
        (["--profile", "nope", "--batch", "1"], "error: unknown model profile 'nope'"),
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


def test_markdown_table_relates_backends_to_the_stock_graph():
    h = load_harness()
    rows = []
    for backend, ms in zip(h.BACKENDS, (8.0, 4.0, 2.0)):
        rows.append(dict(profile="llama3-8b", weight_dtype="bf16", batch=1, backend=backend, step_ms=ms,
                         roofline_ms=1.0, fraction_of_roofline=1.0 / ms))
    doc = dict(gpu="G", date="2026-01-01", read_bandwidth_gbs=4000.0, context=1024, layers_note="all layers timed",
               results=rows)
    table = h.markdown_table(doc).splitlines()
    assert table[2].startswith("| model | weights | batch | backend |")
    assert table[-1] == "| llama3-8b | bf16 | 1 | triton | 2.000 | 1.000 | 50.0 | 2.00x |"
    assert "| reference-eager | 8.000 | 1.000 | 12.5 | 0.50x |" in table[-3]
