"""``monodecode-ops bench``: decode-step latency of the kernel backends against the roofline.

Wraps the decode-latency harness ``monodecode_ops.decode_bench.harness`` (installed with
the package): the reference oracle replayed in a CUDA graph, the stock steps (per-op, compiled
halves, whole-layer fullgraph compiles; the strongest one within its error tolerance is the
bar), their GEMMs alone, and triton, per model profile, context and batch, with the read
bandwidth probes measured in the same run.
Needs a CUDA or ROCm GPU; anything else is one ``error:`` line.

With ``--endpoint URL`` (once or twice) it benchmarks live OpenAI-compatible servers instead
(mono decode on / off): ``monodecode_ops.serving_bench``.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Optional

import typer

from monodecode.errors import MonodecodeError
from monodecode_ops.endpoint_http import check_timeout
from monodecode_ops.options import ProfileNames, ProfileNamesOpt, parse_profile_names, path_option
from monodecode_ops.output import console, emit_json, json_output, table


def load_harness() -> ModuleType:
    """The decode-latency harness (installed with the CLI; it imports torch, so only on use)."""
    from monodecode_ops.decode_bench import harness

    return harness


DEFAULT_KERNEL_OUT = Path("benchmarks/results")
MAX_REQUESTS = 10_000  # per level: hours of serving; more is a typo, and the prompts are kept in memory
MAX_OUTPUT_TOKENS = 1 << 16


def default_serving_out() -> Path:
    """Outside any checkout: ``$MONODECODE_CACHE_DIR/bench``, else ``~/.cache/monodecode/bench``."""
    root = os.environ.get("MONODECODE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "monodecode") / "bench"


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MonodecodeError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not out:
        raise MonodecodeError(f"{what} must list at least one value")
    return out


def bench(
    profile: ProfileNamesOpt = "llama3-1b,llama3-8b,gemma3-27b",  # text: the option's parser makes it ProfileNames
    fp8_profile: ProfileNames = typer.Option(
        "llama3-8b",
        "--fp8-profile",
        parser=parse_profile_names,
        metavar="P[,P...]",
        help="Profiles also timed with FP8 weights ('' for none).",
    ),
    batch: str = typer.Option("1,8", "--batch", help="Rows per decode step (comma-separated, 1..16)."),
    context: str = typer.Option(
        "1024", "--context", help="Context length(s) of every row (comma-separated, e.g. 1024,8192,32768)."
    ),
    layers: int = typer.Option(0, "--layers", help="Time only the first N layers (0: all)."),
    replays: int = typer.Option(20, "--replays", help="Graph replays per measurement (median reported)."),
    out: Optional[Path] = path_option(
        "--out",
        "Directory for the JSON and PNG (default: benchmarks/results; "
        "with --endpoint: $MONODECODE_CACHE_DIR/bench, else ~/.cache/monodecode/bench).",
    ),
    endpoint: Optional[list[str]] = typer.Option(
        None,
        "--endpoint",
        help="A live OpenAI-compatible server (give two for an A/B, e.g. mono on and off): "
        "benchmark serving instead of the kernels.",
    ),
    model: Optional[str] = typer.Option(None, "--model", help="With --endpoint: the served model name."),
    concurrency: str = typer.Option("1,4", "--concurrency", help="With --endpoint: concurrent requests per level."),
    requests: int = typer.Option(8, "--requests", help="With --endpoint: requests per concurrency level."),
    max_tokens: int = typer.Option(32, "--max-tokens", help="With --endpoint: output tokens per request."),
    timeout_s: float = typer.Option(
        120.0, "--timeout-s", help="With --endpoint: bound on one whole request (connect to last token)."
    ),
) -> None:
    """Decode-step latency per backend, profile and batch, as a fraction of the memory roofline;
    with --endpoint, serving latency and throughput of live servers (A/B)."""
    as_json = json_output()
    if endpoint:
        serving(endpoint, model, concurrency, requests, max_tokens, timeout_s, out, as_json)
        return
    batches = _ints(batch, "--batch")
    contexts = _ints(context, "--context")
    if layers < 0 or replays < 1:
        raise MonodecodeError("--layers must be >= 0 and --replays >= 1")
    out = out or DEFAULT_KERNEL_OUT
    harness = load_harness()
    log = (lambda *_: None) if as_json else (lambda msg: console(stderr=True).print(msg, markup=False))
    doc = harness.run(list(profile), batches, contexts, layers or None, list(fp8_profile), replays, out, log=log)
    if as_json:
        emit_json(doc)
        return
    con = console()
    con.print(
        table(
            f"decode step on {doc['gpu']} ({doc['read_bandwidth_gbs']:.0f} GB/s read probe)",
            ["profile", "weights", "context", "batch", "backend", "ms/step", "roofline ms", "of roofline", "vs stock"],
            report_rows(harness, doc),
        )
    )
    con.print(f"triton never slower than the strongest stock step: {doc['summary']['never_slower_than_stock']}")
    con.print("\n".join(doc["paths"]))


def serving(
    urls: list[str],
    model: str | None,
    concurrency: str,
    requests: int,
    max_tokens: int,
    timeout_s: float,
    out: Path | None,
    as_json: bool,
) -> None:
    """``bench --endpoint``: the A/B of live servers, as a table (or JSON), a JSON file and a PNG."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from monodecode_ops import serving_bench as sb

    levels = _ints(concurrency, "--concurrency")
    if any(c < 1 or c > 256 for c in levels):
        raise MonodecodeError(f"--concurrency values must be in 1..256, got {levels}")
    if not (1 <= requests <= MAX_REQUESTS and 2 <= max_tokens <= MAX_OUTPUT_TOKENS):
        raise MonodecodeError(
            f"--requests must be in 1..{MAX_REQUESTS} and --max-tokens in 2..{MAX_OUTPUT_TOKENS}, "
            f"got {requests} and {max_tokens}"
        )
    check_timeout(timeout_s, "--timeout-s")
    out = out or default_serving_out()
    sb.check_out_dir(out)  # before the run: a run's results are never lost to a bad --out
    sb.require_matplotlib()
    endpoints = sb.resolve_endpoints(urls, model, timeout=timeout_s)
    progress = Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console(stderr=True),
        transient=True,
        disable=as_json,
    )
    with progress:
        doc = sb.run(endpoints, levels, requests, max_tokens, timeout=timeout_s, progress=progress)
    jpath, ppath = sb.write_results(doc, out)
    doc["paths"] = [str(jpath), str(ppath)]
    if as_json:
        emit_json(doc)
        return
    con = console()
    if not con.is_terminal:  # piped: room for the percentile columns instead of 80 columns
        con.width = max(con.width, 150)
    con.print(
        table(
            f"serving A/B of {doc['model']}: {requests} requests per level, {max_tokens} output tokens each",
            sb.COLUMNS,
            sb.table_rows(doc),
        )
    )
    for s in doc["servers"]:
        con.print(f"{s['label']}: {s['url']}")
    con.print("\n".join(doc["paths"]))


def report_rows(harness: ModuleType, doc: dict) -> list[tuple]:
    """One table row per result (the harness's public ``report_rows``); a failed measurement shows as 'failed'."""
    return harness.report_rows(doc)


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
