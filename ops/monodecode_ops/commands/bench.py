"""``monodecode-ops bench``: decode-step latency of the kernel backends against the roofline.

Wraps ``benchmarks/decode_latency.py`` of a source checkout (the harness is not installed with
the package): the reference oracle (eager and replayed in a CUDA graph), a realistic stock
per-op decode replayed in a CUDA graph (the baseline), its GEMMs alone, and triton, per model
profile and batch, with the read bandwidth measured in the same run.
Needs a CUDA or ROCm GPU; anything else is one ``error:`` line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import typer

from monodecode.errors import MonodecodeError
from monodecode_ops.output import console, emit_json, json_output, table

HARNESS = Path(__file__).resolve().parents[3] / "benchmarks" / "decode_latency.py"


def load_harness(path: Path = HARNESS) -> ModuleType:
    if not path.is_file():
        raise MonodecodeError(f"benchmark harness {path} not found: run bench from a monodecode source checkout")
    spec = importlib.util.spec_from_file_location("monodecode_decode_latency", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MonodecodeError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not out:
        raise MonodecodeError(f"{what} must list at least one value")
    return out


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def bench(
    profile: str = typer.Option(
        "llama3-1b,llama3-8b,gemma3-27b", "--profile", help="Model profiles (comma-separated)."
    ),
    fp8_profile: str = typer.Option(
        "llama3-8b", "--fp8-profile", help="Profiles also timed with FP8 weights ('' for none)."
    ),
    batch: str = typer.Option("1,8", "--batch", help="Rows per decode step (comma-separated, 1..16)."),
    context: int = typer.Option(1024, "--context", help="Context length of every row."),
    layers: int = typer.Option(0, "--layers", help="Time only the first N layers (0: all)."),
    replays: int = typer.Option(20, "--replays", help="Graph replays per measurement (median reported)."),
    out: Path = typer.Option(Path("benchmarks/results"), "--out", help="Directory for the JSON and PNG."),
) -> None:
    """Decode-step latency per backend, profile and batch, as a fraction of the memory roofline."""
    as_json = json_output()
    batches = _ints(batch, "--batch")
    if layers < 0 or replays < 1:
        raise MonodecodeError("--layers must be >= 0 and --replays >= 1")
    harness = load_harness()
    log = (lambda *_: None) if as_json else (lambda msg: console(stderr=True).print(msg, markup=False))
    doc = harness.run(_names(profile), batches, context, layers or None, _names(fp8_profile), replays, out, log=log)
    if as_json:
        emit_json(doc)
        return
    con = console()
    con.print(
        table(
            f"decode step on {doc['gpu']} ({doc['read_bandwidth_gbs']:.0f} GB/s read), context {context}",
            ["profile", "weights", "batch", "backend", "ms/step", "roofline ms", "of roofline", "vs stock graph"],
            report_rows(harness, doc),
        )
    )
    con.print(f"triton never slower than the stock graph: {doc['summary']['never_slower_than_stock']}")
    con.print("\n".join(doc["paths"]))


def report_rows(harness: ModuleType, doc: dict) -> list[tuple]:
    """One table row per result; a failed measurement shows as 'failed'."""
    rows = []
    for r in doc["results"]:
        frac = r.get("fraction_of_roofline")
        rows.append(
            (
                r["profile"],
                r["weight_dtype"],
                r["batch"],
                harness.LABELS.get(r["backend"], r["backend"]),
                harness._ms(r),
                f"{r['roofline_ms']:.3f}",
                f"{100 * frac:.1f}%" if frac else "n/a",
                harness._ratio(harness._find(doc["results"], r, "stock-graph"), r),
            )
        )
    return rows


def register(app: typer.Typer) -> None:
    app.command("bench")(bench)
