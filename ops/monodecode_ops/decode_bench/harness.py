"""Decode-step latency of the kernel backends against the memory roofline and the strongest stock
step, on one GPU.

For each model profile (random weights with the profile's real dims), weight dtype, context
(``--contexts``, every row the same length) and step width, one decode step over every decoder
layer (embedding, final norm and LM head excluded: they stay in vLLM) is timed for:

  reference-graph      the reference decode (the numerics oracle) replayed from one CUDA graph
                       (fp32 attention and norms: slow); every error below is against its output
  reference-eager      (``--stock eager``) the same op by op
  stock-graph          (``--stock paged``) stock per-op decode over the paged KV cache
                       (``stock.StockDecode``: gather + SDPA), one CUDA graph
  stock-contig-graph   (a) per-op over contiguous per-row KV caches (SDPA reads them in place, the
                       KV write one scatter), one CUDA graph
  stock-compiled-graph (``--stock compiled``) (b) as (a) with each layer's two halves around
                       attention ``torch.compile``d (``dynamic=False``, the KV write inside the
                       first half), one CUDA graph
  stock-fullgraph      each layer one ``torch.compile(fullgraph=True, dynamic=False)`` function
                       (``fullgraph.py``: the reference's math, Gemma's included), one CUDA graph
  stock-fullgraph-cdt  the same compiled with inductor's ``coordinate_descent_tuning`` (one-row
                       GEMMs become fused reductions; FP8: W8A16 with the dequant fused, run at
                       ``--w8a16-batches`` only: wider, it does not fuse); its tuning differs from
                       one compile to the next by up to 20 %: ``--tuning-draws N`` compiles it N
                       times a cell (tuned afresh after the first: ``fullgraph.tuning_draws``) and
                       times the fastest, each draw's median in ``tuning_draws_ms``
  stock-fullgraph-cdt-wide  (``--stock fullgraph-cdt-wide``) the cdt stock with coordinate descent's
                       wider search (``fullgraph.WIDE_SEARCH``); tuned, so drawn like it
  stock-fullgraph-max  (``--stock fullgraph-max``, BF16) the same with inductor's ``max_autotune`` too:
                       each projection's GEMM is its fastest of Triton templates and cuBLAS
                       (the skinny batch 2-8 GEMMs above all); tuned, so drawn like the cdt stock
  stock-fullgraph-splitk  FP8 only: the fullgraph step with its projections through a split-K
                       W8A16 Triton GEMM that reads the e4m3 weights once at any batch (``w8a16.py``)
  stock-gemm-floor     only the stock GEMMs, from one CUDA graph (first context only)
  triton               the persistent K1/K2 per layer (current launch target), one CUDA graph
  triton-step          the step launch: every layer in one persistent launch
                       (``kernels/triton/step_launch.py``, ``forward_step``), one CUDA graph; at
                       the widths the ``triton-step`` backend serves (CUDA sm_90+, the model's
                       ``step_plan.step_refusals``; a refused width's cell records why);
                       ``--no-step`` leaves it out
  triton-step-<name>   the step launch with a changed plan (``--step-variants``: name -> knobs of
                       ``step_plan.PLAN_KNOBS``), in the cells where triton-step is timed; a width
                       whose plan does not fit (shared memory) records why
  triton-<variant>     the same as triton with a changed launch target (``--variants``)

"Stock" in every verdict is the fastest stock step of the cell that is within its error tolerance;
for FP8 also the BF16 stock of the same cell (``report.py``). Roofline: the bytes a step must read
(every projection weight, scale and norm of every layer, plus the K/V entries each row attends to)
over the fastest read probe measured in the same run (``probes.py``; its fraction of the datasheet
bandwidth is printed beside it). ``fraction`` = roofline time / measured time.

Timing: device events around each graph replay (a whole step), after warm-up; the median of
``--replays`` (the oracle: 3). Each sample includes the graph-submission latency
(each replay follows a synchronize); the verdicts use these. Every backend but the oracle is also
timed with ``BACK_TO_BACK`` replays queued between two events (``step_ms_back_to_back``, the
median of 3 rounds: the host ahead of the device, each step without its own submission), and the
report sets the two methods' ratios side by side (``report.back_to_back_table``). ``capture_s`` is the wall time of a backend's first run and
capture, compiles included. A cell is skipped, and recorded as skipped, when its KV caches do not
fit in the free GPU memory or the run's ``--deadline-s`` has passed. With ``--timeline-batches`` the
triton kernels, the step launch and each step variant are rebuilt with per-stage ``%globaltimer``
stamps and one step of each is drawn per layer-of-interest (``timeline.py``, ``timeline_backends``).

Public interface (used by ``monodecode-ops bench``): ``run``, ``summary``, ``report_rows``,
``markdown_table``, ``summary_table``, ``plot``.
Writes ``<out>/decode_latency_<gpu>_<date>.json`` (after every cell) and a PNG per context.
Usage: ``python benchmarks/decode_latency.py [--profiles ...] [--batches 1,2,4,8]
[--contexts 1024,8192,32768] [--out DIR]``; ``--report JSON...`` prints the tables of saved runs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import re
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from monodecode.errors import MonodecodeError, exception_line
from monodecode.kernels.base import BuildRequest
from monodecode.kernels.health import decode_health
from monodecode.kernels.triton.step_plan import PLAN_KNOBS, SUM_KNOBS, StepGeometry, checked_plan
from monodecode.model import reference as R
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_config, profile_dims
from monodecode.model.weights import random_weights
from monodecode.runtime.width_policy import capture_graph
from monodecode_ops.decode_bench.fullgraph import FULLGRAPH_STOCKS, FullgraphStockDecode, fastest_draw, tuning_draws
from monodecode_ops.decode_bench.hang import exit_if_stuck
from monodecode_ops.decode_bench.probes import read_probes, spec_bandwidth, time_back_to_back, time_calls
from monodecode_ops.decode_bench.report import (  # noqa: F401 - the harness's public interface
    LABELS,
    STEP_BACKEND,
    STOCK_BACKENDS,
    TARGETS,
    W8A16_FUSED,
    back_to_back_table,
    fp8_table,
    is_step_backend,
    markdown_table,
    plot,
    probe_lines,
    report_rows,
    step_variant_backend,
    summary,
    summary_table,
)
from monodecode_ops.decode_bench.stock import ContiguousKV, ContiguousStockDecode, StockDecode

DEFAULT_PROFILES = ("llama3-1b", "llama3-8b", "gemma3-27b")
DEFAULT_BATCHES = (1, 2, 4, 8)
DEFAULT_CONTEXTS = (1024, 8192, 32768)
RESULTS_DIR = "benchmarks/results"  # where a run writes without --out (a --report: beside its first JSON)
# --stock names -> backends
STOCK_PATHS = {
    "eager": "reference-eager",
    "paged": "stock-graph",
    "contig": "stock-contig-graph",
    "compiled": "stock-compiled-graph",
    "fullgraph": "stock-fullgraph",
    "fullgraph-cdt": "stock-fullgraph-cdt",
    "fullgraph-cdt-wide": "stock-fullgraph-cdt-wide",
    "fullgraph-max": "stock-fullgraph-max",
    "fullgraph-splitk": "stock-fullgraph-splitk",
    "floor": "stock-gemm-floor",
}
# Left out by default, to keep a run inside one device phase (``--stock`` adds them): the paged
# per-op step (its gather copies every row's KV each layer: slower than the contiguous per-op step
# in every cell of runs 40-43, and at long contexts device time for nothing) and the compiled
# halves (the fullgraph step is the same compile without the break at attention; its two or three
# compiles per cell are the largest share of a run's device time), and the max-autotune step (its
# GEMM template search takes the longest compiles of all; not yet timed against the others).
DEFAULT_STOCK = ("contig", "fullgraph", "fullgraph-cdt", "fullgraph-splitk", "floor")
DEFAULT_W8A16_BATCHES = (1,)
# Batches timed at the contexts after the first by default: the corners of the long-context
# cells, so that one default run stays inside the ~420 s bench phase of device_run.sh
# (``--long-context-batches 1,2,4,8`` times the whole matrix).
DEFAULT_LONG_BATCHES = (1, 8)
COMPILED = (
    "stock-compiled-graph",
    "stock-fullgraph",
    "stock-fullgraph-cdt",
    "stock-fullgraph-cdt-wide",
    "stock-fullgraph-max",
    "stock-fullgraph-splitk",
)
# Stocks whose compile searches kernel configurations by timing them: coordinate descent lands on
# different ones from one compile to the next (run 104, 1B at 1k batch 1: 53.7, 62.2 and 64.8 µs a
# layer in three fresh tunings, the untuned step within 0.5 %), so one draw is not the strongest.
TUNED = ("stock-fullgraph-cdt", "stock-fullgraph-cdt-wide", "stock-fullgraph-max")
# Tuned stocks whose choices are made while compiling (max-autotune's GEMMs): the prewarm leaves them
# to the benchmark's process, whose idle GPU times the candidates (prewarm.py: tuning stays there).
TUNED_WHILE_COMPILING = ("stock-fullgraph-max",)


# Launch-target changes measured next to the current target in the same run: "before" is the
# launch target of runs 50-53 (every launch started by the stream after the one before has
# drained, no programmatic dependent launch); "runs6-8" an older one (tagged words at width 1, FP8 weights widened to bf16
# at widths > 1, K chunks that divide K, the rows chooser's whole-wave model, no split-K, the
# attention loop pipelined 3 deep). Kernel code changes (run 19: relaxed exit atomics, the fused
# norm's weight pipelined) apply to every variant.
DEFAULT_VARIANTS = {
    "before": {"pdl": ""},
    "runs6-8": {
        "pdl": "",
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
        "wide_min_rows": 0,
        "split_k_merge": "",
        "wide_attn_stages": 0,
        "whole_attn_tile": 0,
        "wide_even_waves": False,
    },
}
# Plan changes of the step launch measured next to its default plan (``--step-variants``): none by
# default, since run 106 settled the ones it had (the default plan now holds what won).
DEFAULT_STEP_VARIANTS: dict[str, dict[str, int]] = {}
# A step variant's name (its backend is ``triton-step-<name>``).
STEP_VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]*(?:-[A-Za-z0-9_]+)*")
BLOCK = 16
# replays a step's graph is timed over queued back to back (``step_ms_back_to_back``)
BACK_TO_BACK = 20
DEVICE = "cuda"  # the device the benchmark runs on (a CPU smoke test sets "cpu")
MEMORY_MARGIN = 4 << 30  # left free for the graphs' pools and the oracle's fp32 attention chunks


def read_bandwidth(device, gib: float = 4.0, reps: int = 20) -> float:
    """Bytes/s of the fastest read probe (``probes.read_probes``): the roofline's denominator."""
    return max(read_probes(device, gib, reps).values())


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


def paged_kv_bytes(dims, layers: int, rows: int, context: int) -> int:
    """Bytes of the paged cache a cell allocates (every layer holds every row's blocks)."""
    blocks = rows * (-(-context // BLOCK)) + 1
    return layers * blocks * BLOCK * dims.num_kv_heads * dims.head_dim * 2 * 2


def contiguous_kv_bytes(dims, layers: int, rows: int, context: int) -> int:
    """Bytes of the contiguous caches (``stock.ContiguousKV``: sliding layers hold their window)."""
    per_position = rows * dims.num_kv_heads * dims.head_dim * 2 * 2
    return sum((context - ContiguousKV.first_position(dims, l, context)) * per_position for l in range(layers))


def gpu_identity() -> tuple[str, str | None]:
    """The GPU's name, and its uuid so that a report merged from several calls can say whether
    they ran on one card."""
    uuid = getattr(torch.cuda.get_device_properties(0), "uuid", None)
    return torch.cuda.get_device_name(), str(uuid) if uuid else None


def _time_eager(fn, replays: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``replays`` calls of ``fn`` (CUDA events around each), after ``warmup`` calls."""
    return time_calls(fn, replays, warmup)


def _time_graph(graph: torch.cuda.CUDAGraph, replays: int, warmup: int = 3) -> list[float]:
    return _time_eager(graph.replay, replays, warmup=warmup)


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def _measure(name: str, fn, log) -> tuple[Any, str | None]:
    """Run one measurement; a failure is recorded (and logged) instead of ending the run."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - one backend failing must not lose the others' numbers
        why = exception_line(e, 300)
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


def step_refusals_by_width(req: BuildRequest) -> dict[int, str]:
    """Width -> why the step launch (``STEP_BACKEND``) is not timed at it: the ``triton-step``
    backend's refusals of ``req`` at that width (the platform: CUDA sm_90 or newer; the model:
    ``step_plan.step_refusals``; the plan on this GPU's SMs); {} when it serves every width."""
    import dataclasses

    from monodecode.kernels.triton.step_backend import TritonStepBackend

    backend = TritonStepBackend()
    out = {}
    for w in req.widths:
        if why := backend.refusals(dataclasses.replace(req, widths=(w,))):
            out[w] = "; ".join(why)
    return out


def _step_kernels(req, widths: tuple[int, ...], weights):
    """The step launch of ``req``'s model at ``widths``, built as the ``triton-step`` backend builds it."""
    import dataclasses

    from monodecode.kernels.triton.step_backend import TritonStepBackend

    return TritonStepBackend().build(dataclasses.replace(req, widths=widths), weights, None, allow_jit=True)


def _build_step(req, weights, log) -> tuple[Any, dict[int, tuple[str, bool]]]:
    """(the step launch's kernels or None, width -> (the error its cells record, whether that is a
    skip)): refused widths are skipped cells; a failed build (or refusal check) fails the cells of
    the widths it was for, without ending the run."""
    refused, why = _measure(f"{STEP_BACKEND} refusals", lambda: step_refusals_by_width(req), log)
    if refused is None:
        return None, {w: (f"build failed: {why}", False) for w in req.widths}
    for w, reason in refused.items():
        log(f"  {STEP_BACKEND} not timed at width {w}: {reason}")
    out = {w: (f"skipped: the step launch refuses width {w}: {reason}", True) for w, reason in refused.items()}
    widths = tuple(w for w in req.widths if w not in refused)
    if not widths:
        return None, out
    tk, why = _measure(f"{STEP_BACKEND} build", lambda: _step_kernels(req, widths, weights), log)
    if tk is None:
        out.update({w: (f"build failed: {why}", False) for w in widths})
    return tk, out


def step_variant_widths(
    dims, widths, programs: int, plan: dict, weight_dtype: str = "bf16"
) -> tuple[tuple[int, ...], dict[int, str]]:
    """(the ``widths`` at which the step launch's geometry with ``plan`` fits on ``programs`` SMs
    and differs from the default plan's, width -> why not for the others): ``StepGeometry.check``
    (e.g. a longer weight ring does not fit shared memory above 1 row), or the same compile-time
    constants as the default's (a knob of width 1 above 1 row: the default's kernel, timed already)."""
    fits, why = [], {}
    for w in widths:
        g = StepGeometry(dims, w, programs, weight_dtype=weight_dtype, **checked_plan(plan))
        try:
            g.check()
        except ValueError as e:
            why[w] = f"does not fit width {w}: {e}"
            continue
        if g.constexprs(BLOCK) == StepGeometry(dims, w, programs, weight_dtype=weight_dtype).constexprs(BLOCK):
            why[w] = f"builds the default plan's kernel at width {w} (nothing in it applies there)"
        else:
            fits.append(w)
    return tuple(fits), why


def _step_variant_kernels(req, widths: tuple[int, ...], weights, plan: dict, base):
    """The step launch at ``widths`` with ``plan``, built as the ``triton-step`` backend builds it
    (its refusals first), reading ``base``'s packed weights."""
    import dataclasses

    from monodecode.kernels.triton.step_backend import TritonStepBackend
    from monodecode.kernels.triton.step_launch import StepKernels

    req_w = dataclasses.replace(req, widths=widths)
    TritonStepBackend().refuse_unless_buildable(req_w, allow_jit=True)
    device = torch.device(req.platform.torch_device)
    return StepKernels(req_w, weights, req.platform.compute_units, device, plan=plan, share=base)


def _build_step_variant(req, weights, base, backend: str, plan: dict, log) -> tuple[Any, dict[int, tuple[str, bool]]]:
    """(a step variant's kernels or None, width -> (the error its cells record, whether that is a
    skip)) at the widths ``base`` (the ``triton-step`` build) serves: the widths its plan does not
    fit are skipped cells; a failed build fails the cells of the others, without ending the run."""
    got, why = _measure(
        f"{backend} plan",
        lambda: step_variant_widths(req.dims, base.widths, req.platform.compute_units, plan, req.weight_dtype),
        log,
    )
    if got is None:
        return None, {w: (f"build failed: {why}", False) for w in base.widths}
    widths, misfits = got
    for w, reason in misfits.items():
        log(f"  {backend} not timed at width {w}: {reason}")
    out = {w: (f"skipped: the step plan {plan} {r}", True) for w, r in misfits.items()}
    if not widths:
        return None, out
    tk, why = _measure(f"{backend} build", lambda: _step_variant_kernels(req, widths, weights, plan, base), log)
    if tk is None:
        out.update({w: (f"build failed: {why}", False) for w in widths})
    return tk, out


def _not_run(ctx, backend: str) -> dict[int, tuple[str, bool]]:
    """Width -> (error, skipped) of a step-launch backend's cells that are not timed."""
    if backend == STEP_BACKEND:
        return ctx["step_not_run"]
    return ctx.get("step_variants_not_run", {}).get(backend, {})


def _step_refused(ctx, rows: int, context: int, wanted: list[str]) -> tuple[list[str], list[dict]]:
    """(the backends of ``wanted`` to time, the rows recording why the step launch, or one of its
    variants, is not timed at this width)."""
    timed, recorded = [], []
    for b in wanted:
        got = _not_run(ctx, b).get(rows) if is_step_backend(b) else None
        if got is None:
            timed.append(b)
            continue
        error, skipped = got
        recorded.append(_row(ctx, rows, context, b, None, error, None, None, skipped=skipped))
    return timed, recorded


def stock_runs(backend: str, fp8: bool, rows: int | None, w8a16_batches) -> bool:
    """Whether a selected stock ``backend`` is timed in a cell of this weight dtype and batch
    (``rows`` None: in any batch)."""
    if backend in ("stock-fullgraph", "stock-fullgraph-max"):
        return not fp8  # W8A16 without coordinate descent widens every weight first
    if backend == "stock-fullgraph-splitk":
        return fp8
    if backend in W8A16_FUSED and fp8:
        return rows is None or rows in w8a16_batches  # wider, inductor does not fuse the dequant
    return True


def cell_plan(contexts, batches, long_batches) -> list[tuple[int, int]]:
    """(context, batch) of every cell of one profile, in run order: every batch at the first
    context, at the later ones only those in ``long_batches`` (None: every batch)."""
    return [
        (c, b) for i, c in enumerate(contexts) for b in batches if i == 0 or long_batches is None or b in long_batches
    ]


def _stock_paths(dims, weights, stock: tuple[str, ...], max_context: int, device, fp8: bool, log):
    """backend -> stock decode object of the selected ``--stock`` paths (sharing one set of merged
    weights and RoPE tables)."""
    want = [STOCK_PATHS[s] for s in stock]
    merged = [b for b in want if b not in ("reference-eager", "stock-gemm-floor")]
    if not merged and "stock-gemm-floor" not in want:
        return {}, None
    base = StockDecode(dims, weights, max_context + BLOCK, device)
    paths: dict[str, Any] = {}
    if "stock-graph" in want:
        paths["stock-graph"] = base
    if "stock-contig-graph" in want:
        paths["stock-contig-graph"] = ContiguousStockDecode(dims, weights, max_context, device, share=base)
    if "stock-compiled-graph" in want:
        paths["stock-compiled-graph"] = ContiguousStockDecode(
            dims, weights, max_context, device, compiled=True, share=base
        )
    for b, kw in FULLGRAPH_STOCKS.items():
        if b in want and stock_runs(b, fp8, None, ()):
            paths[b] = FullgraphStockDecode(dims, weights, max_context, device, share=base, **kw)
        elif b in want:
            log(f"  {b} left out for {'FP8' if fp8 else 'BF16'} weights")
    return paths, base


def bench_config(
    profile: str,
    weight_dtype: str,
    batches: list[int],
    contexts: list[int],
    layers: int | None,
    replays: int,
    bandwidth: float,
    device,
    log=print,
    *,
    variants: dict | None = None,
    step_variants: dict | None = None,
    stock: tuple[str, ...] = DEFAULT_STOCK,
    w8a16_batches: tuple[int, ...] = DEFAULT_W8A16_BATCHES,
    timeline_batches: tuple[int, ...] = (),
    timeline_contexts: tuple[int, ...] = (),
    out_dir: Path | None = None,
    stem: str = "",
    timelines: list | None = None,
    deadline: float | None = None,
    spec: float | None = None,
    long_batches: tuple[int, ...] | None = None,
    results: list | None = None,
    on_cell=None,
    tuning_draws: int = 1,
    step: bool = True,
) -> list[dict]:
    """Result rows of one model profile and weight dtype, every context and batch (at contexts after
    the first only the batches also in ``long_batches``, when given), appended to ``results``
    (``on_cell()`` after each cell); timeline summaries are appended to ``timelines``. ``step``:
    the step launch is timed too (``STEP_BACKEND``) at the widths it runs, and records why not at
    the others; with each of ``step_variants`` (name -> plan) beside it, where it was built."""
    from monodecode.services.platform import detect_platform

    results = [] if results is None else results
    variants = DEFAULT_VARIANTS if variants is None else variants
    step_variants = DEFAULT_STEP_VARIANTS if step_variants is None else step_variants
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
    paths, base = _stock_paths(dims, weights, stock, max(contexts), device, weight_dtype != "bf16", log)
    if base is not None:
        base.alias_model_weights(weights)  # one copy of the merged projections, before triton packs
    kernels = {"triton": _triton_kernels(req, weights, {}, device)}
    for name, change in variants.items():
        kernels[f"triton-{name}"] = _triton_kernels(req, weights, change, device, share=kernels["triton"])
    step_not_run: dict[int, tuple[str, bool]] = {}
    variants_not_run: dict[str, dict[int, tuple[str, bool]]] = {}
    if step:
        step_kernels, step_not_run = _build_step(req, weights, log)
        if step_kernels is not None:
            kernels[STEP_BACKEND] = step_kernels
            for name, plan in step_variants.items():
                b = step_variant_backend(name)
                tk, variants_not_run[b] = _build_step_variant(req, weights, step_kernels, b, plan, log)
                if tk is not None:
                    kernels[b] = tk
    tried = step_variants if STEP_BACKEND in kernels else {}  # the step variants built or tried
    for name, tk in kernels.items():  # a build whose launches do not fit its plan times another plan
        for misfit in tk.residency_misfits():
            log(f"  ! {name}: {misfit} (registers / shared memory); its timings are of a plan that does not fit")
    stock_path = base.fp8_path if base else None
    log(
        f"# {profile} {weight_dtype}: {n_layers}/{dims.num_layers} layers built in {time.monotonic() - t0:.1f}s; "
        f"stock GEMMs: {stock_path}; stock steps: {', '.join(paths) or 'none'}; triton variants: {variants}; "
        f"step variants: {tried}"
    )
    ctx = {
        "profile": profile,
        "weight_dtype": weight_dtype,
        "dims": dims,
        "n_layers": n_layers,
        "weights": weights,
        "kernels": kernels,
        "paths": paths,
        "base": base,
        "stock": stock,
        "stock_path": stock_path,
        "variants": variants,
        "step_variants": tried,
        "step_variants_not_run": variants_not_run,
        "wbytes": weight_bytes(weights),
        "bandwidth": bandwidth,
        "spec": spec,
        "replays": replays,
        "device": device,
        "log": log,
        "tuning_draws": tuning_draws,
        "step": step,
        "step_not_run": step_not_run,
    }
    for context, rows in cell_plan(contexts, batches, long_batches):
        wanted = _cell_backends(ctx, rows, floor=context == contexts[0], w8a16_batches=w8a16_batches)
        why = None
        if deadline is not None and time.monotonic() > deadline:
            why = "skipped: the run's time budget (--deadline-s) is spent"
        else:
            need = paged_kv_bytes(dims, n_layers, rows, context)
            if any(b in paths and b != "stock-graph" for b in wanted):
                need += contiguous_kv_bytes(dims, n_layers, rows, context)
            free = torch.cuda.mem_get_info(device)[0]
            if need + MEMORY_MARGIN > free:
                why = f"skipped: its KV caches need {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        if why:
            log(f"  context {context} batch {rows}: {why}")
            results += [_row(ctx, rows, context, b, None, why, None, None, skipped=True) for b in wanted]
        else:
            tl = rows in timeline_batches and context in timeline_contexts
            timed, refused = _step_refused(ctx, rows, context, wanted)
            results += _bench_cell(ctx, rows, context, timed, tl, out_dir, stem, timelines) + refused
        if on_cell:
            on_cell()
    for tk in kernels.values():
        tk.close()
    ctx.clear()
    del kernels, weights, paths, base
    gc.collect()
    torch.cuda.empty_cache()
    return results


def _cell_backends(ctx, rows: int, floor: bool, w8a16_batches) -> list[str]:
    """The backends timed in one cell, in order (the oracle first: every error is against it)."""
    out = ["reference-graph"]
    if "eager" in ctx["stock"]:
        out.append("reference-eager")
    out += [b for b in ctx["paths"] if stock_runs(b, ctx["weight_dtype"] != "bf16", rows, w8a16_batches)]
    if "floor" in ctx["stock"] and floor:
        out.append("stock-gemm-floor")
    out += [b for b in ctx["kernels"] if b == STEP_BACKEND or not is_step_backend(b)]
    if ctx.get("step") and STEP_BACKEND not in out:  # refused or failed at every width: its cells say why
        out.append(STEP_BACKEND)
    step = ctx["kernels"].get(STEP_BACKEND)
    if step is not None and rows in step.widths:  # its variants beside it (a misfit or failure says why)
        out += [step_variant_backend(name) for name in ctx.get("step_variants", {})]
    return out


def _row(
    ctx, rows, context, backend, times, error, rel, capture_s, skipped=False, health=None, draws: dict | None = None,
    same_bits: bool | None = None, back_to_back: list[float] | None = None,
) -> dict:  # fmt: skip
    dims, n_layers = ctx["dims"], ctx["n_layers"]
    kbytes = kv_bytes(dims, n_layers, context, rows)
    nbytes = ctx["wbytes"] + kbytes
    roof = nbytes / ctx["bandwidth"]
    med = statistics.median(times) if times else None
    spec = ctx["spec"]
    tk = ctx["kernels"].get(backend)
    if tk is not None and rows not in tk.widths:  # a build without this width (the step launch's refused ones)
        tk = None
    # the step launch's floor in its tiling (its builds alone have a geometry a width): the weights
    # at the busiest program's share, the K/V as they are
    geometry = getattr(tk, "geometry", {}).get(rows)
    floor = (ctx["wbytes"] * geometry.busiest_program_share() + kbytes) / ctx["bandwidth"] if geometry else None
    return {
        "profile": ctx["profile"],
        "weight_dtype": ctx["weight_dtype"],
        "batch": rows,
        "context": context,
        "layers_timed": n_layers,
        "layers_model": dims.num_layers,
        "backend": backend,
        "step_ms": med * 1e3 if med else None,
        "step_ms_min": min(times) * 1e3 if times else None,
        "step_ms_full_model": med * 1e3 * dims.num_layers / n_layers if med else None,
        "step_ms_back_to_back": statistics.median(back_to_back) * 1e3 if back_to_back else None,
        "replays": len(times) if times else 0,
        "capture_s": capture_s,
        "tuning_draws_ms": (draws or {}).get("ms"),
        "tuning_draws_failed": (draws or {}).get("failed"),  # one line each (a sticky CUDA error spoils the rest)
        "error": error,
        "skipped": skipped or None,
        "weight_bytes": ctx["wbytes"],
        "kv_bytes": kbytes,
        "roofline_ms": roof * 1e3,
        "fraction_of_roofline": roof / med if med else None,
        "fraction_of_spec": nbytes / spec / med if med and spec else None,
        "step_floor_ms": floor * 1e3 if floor else None,
        "rel_error_vs_reference": rel,
        "same_bits_as_step": same_bits,
        "stock_gemm_path": (ctx["paths"][backend].fp8_path if backend in ctx["paths"] else ctx["stock_path"])
        if backend.startswith("stock")
        else None,
        "triton_health": (decode_health(health).describe() if health else "ok") if health is not None else None,
        "triton_change": _triton_change(ctx, backend) if backend.startswith("triton") else None,
        # programs per SM each launch of this width held (k1, k2, ka), and where that is fewer than planned
        "triton_programs_per_sm": (getattr(tk, "residency", None) or {}).get(rows) if tk is not None else None,
        "triton_misfits": tk.residency_misfits(rows) if tk is not None else None,
    }


def _triton_change(ctx, backend: str) -> dict | None:
    """A triton build's change: {} for triton and the step launch, a variant's launch-target
    change, a step variant's plan."""
    if backend in ("triton", STEP_BACKEND):
        return {}
    if is_step_backend(backend):
        return ctx.get("step_variants", {}).get(backend[len(STEP_BACKEND) + 1 :])
    return ctx["variants"].get(backend.removeprefix("triton-"))


def _bench_cell(ctx, rows: int, context: int, wanted: list[str], timeline: bool, out_dir, stem, timelines):
    """Time every wanted backend in one (context, batch) cell; returns its result rows."""
    from monodecode.kernels.triton.launch import _Meta

    dims, n_layers, weights, device, log = ctx["dims"], ctx["n_layers"], ctx["weights"], ctx["device"], ctx["log"]
    replays, paths, kernels = ctx["replays"], ctx["paths"], ctx["kernels"]
    blocks = rows * (-(-context // BLOCK)) + 1
    alloc = BlockAllocator(blocks, BLOCK, shuffle_seed=rows)
    for r in range(rows):
        alloc.append_slots(r, context - 1)
    meta = alloc.decode_metadata(list(range(rows)), device=device)
    kv = PagedKVCache.allocate(dims, blocks, BLOCK, device=device, num_layers=n_layers)
    for t in kv.key + kv.value:
        t.normal_()
    contig = [b for b in wanted if isinstance(paths.get(b), ContiguousStockDecode)]
    if contig:
        cache = ContiguousKV.from_paged(dims, kv, meta, context)  # one set of caches for every contiguous path
        for b in contig:
            paths[b].cache = cache
        del cache
    x = torch.randn(rows, dims.hidden_size, device=device).to(torch.bfloat16)
    m = _Meta(meta, device)

    def step_of(backend):
        if backend == "reference-graph":
            return lambda: R.run_layers(weights, x, meta, kv)
        if backend == "stock-gemm-floor":
            x_q = torch.randn(rows, dims.q_size, device=device).to(torch.bfloat16)
            x_i = torch.randn(rows, dims.intermediate_size, device=device).to(torch.bfloat16)
            base = ctx["base"]
            return lambda: [base.gemms_only(l, x, x_q, x_i) for l in range(n_layers)][-1]
        if is_step_backend(backend):  # every layer in one launch (the step launch and its variants)
            tk, metas = kernels[backend], [meta] * n_layers
            return lambda: tk.forward_step(x, metas, kv)
        if backend in kernels:
            tk = kernels[backend]
            return lambda: R.run_layers(weights, x, m, kv, layer_fn=tk.forward_layer)
        path = paths[backend]

        def step():
            path.prepare(meta, BLOCK)
            return R.run_layers(weights, x, meta, kv, layer_fn=path.forward_layer)

        return step

    times: dict[str, list[float] | None] = {}
    errors: dict[str, str] = {}
    outs: dict[str, torch.Tensor] = {}
    capture: dict[str, float] = {}
    draws: dict[str, dict] = {}  # tuned stock -> each draw's median ms and failed draws (tuning_draws > 1)
    back_to_back: dict[str, list[float] | None] = {}  # seconds a step, replays queued back to back
    steps = {}
    for name in wanted:
        if name == "reference-eager":
            fn = step_of("reference-graph")
            t, why = _measure(name, lambda fn=fn: _time_eager(fn, max(3, replays // 8), warmup=1), log)
            times[name] = t
            if why:
                errors[name] = why
            continue
        fn = steps[name] = step_of(name)
        # the oracle is there for the errors (its time is only informative; at 32k a step of it
        # takes ~0.3 s): 3 replays after 1 warm-up
        n, warm = (3, 1) if name == "reference-graph" else (replays, 3)

        def one(fn=fn, name=name, n=n, warm=warm):
            def draw():
                t0 = time.monotonic()
                g, out = capture_graph(fn)
                torch.cuda.synchronize()
                capture_s = time.monotonic() - t0
                ts = _time_graph(g, n, warm)
                # the oracle's steps take up to 0.3 s (32k): timed one way only
                b2b = time_back_to_back(g.replay, BACK_TO_BACK) if name != "reference-graph" else None
                g.replay()  # leave this backend's output of the same KV state for the error check
                torch.cuda.synchronize()
                return ts, out.clone(), capture_s, b2b

            # a compiled path's own compiles (and no stale entry of another); a tuned one drawn
            got, failed = tuning_draws(draw, ctx["tuning_draws"] if name in TUNED else 1, reset=name in COMPILED)
            for why in failed:
                log(f"  ! {name} {why}")
            if len(got) > 1 or failed:
                draws[name] = {"ms": [round(_median_ms(d[0]), 4) for d in got], "failed": failed}
            ts, out, capture[name], back_to_back[name] = fastest_draw(got)
            return ts, out, None

        # our launches: one that hangs is named and ends the run (``hang.py``)
        watch = (
            exit_if_stuck(f"{name} at batch {rows}, context {context}", log=log) if name in kernels else nullcontext()
        )
        with watch:
            got, why = _measure(name, one, log)
        if why:
            errors[name], times[name] = why, None
            continue
        times[name], outs[name], g = got
        del g, got
    ref = outs.get("reference-graph")

    def rel(name):
        if ref is None or name not in outs or name == "stock-gemm-floor":
            return None
        return float((outs[name].float() - ref.float()).norm() / ref.float().norm())

    health = {name: tk.health() for name, tk in kernels.items()}
    same = step_variants_same_bits(outs, ctx.get("step_variants", {}))
    for b, eq in same.items():
        if not eq:
            log(f"  ! {b}'s output differs from {STEP_BACKEND}'s bit for bit (its plan's knobs should move bytes only)")
    out_rows = [
        _row(
            ctx,
            rows,
            context,
            b,
            times.get(b),
            errors.get(b),
            rel(b),
            capture.get(b),
            health=health.get(b),
            draws=draws.get(b),
            same_bits=same.get(b),
            back_to_back=back_to_back.get(b),
        )  # fmt: skip
        for b in wanted
    ]
    med = {r["backend"]: r["step_ms"] for r in out_rows if r["step_ms"]}
    roof = out_rows[0]["roofline_ms"]
    log(
        f"  context {context} batch {rows}: "
        + ", ".join(
            f"{b} {med[b]:.3f} ms ({roof / med[b]:.1%})"
            + (f" [{capture[b]:.1f}s to capture]" if b in COMPILED and b in capture else "")
            if b in med
            else f"{b} FAILED"
            for b in wanted
        )
        + "; rel err "
        + ", ".join(f"{b} {rel(b):.2e}" for b in wanted if rel(b) is not None)
        + f"; health {health}"
    )
    if timeline and out_dir is not None and timelines is not None:
        for b in timeline_backends(kernels, steps, med):
            tl_args = (kernels[b], steps[b], n_layers, ctx["profile"], ctx["weight_dtype"], rows)
            got, _ = _measure(
                f"{b} timeline", lambda a=tl_args, b=b: _timeline(*a, out_dir, stem, log, context, b), log
            )
            if got:
                timelines.append(got)
    for b in contig:
        paths[b].cache = None
    del outs, kv, ref, steps, m, meta
    gc.collect()
    torch.cuda.empty_cache()
    return out_rows


def step_variants_same_bits(outs: dict, plans: dict | None = None) -> dict[str, bool]:
    """For each step variant timed in a cell, whether its output is bit for bit the step launch's
    (a plan knob moves bytes, never a sum: a variant that differs is a bug its error may hide,
    as run 111's wrong head_dim-128 tiles did at 3.7e-2, inside the stack's tolerance). A variant
    whose plan (``plans``: name -> knobs) has a knob of ``step_plan.SUM_KNOBS`` is left out: its
    sums differ by design, and its error is gated against the reference like any backend's."""
    base = outs.get(STEP_BACKEND)
    if base is None:
        return {}
    bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731 - NaN's bits equal themselves
    sums = {step_variant_backend(n) for n, plan in (plans or {}).items() if SUM_KNOBS & set(plan)}
    return {
        name: out.shape == base.shape and bool(torch.equal(bits(out), bits(base)))
        for name, out in outs.items()
        if is_step_backend(name) and name != STEP_BACKEND and name not in sums
    }


def timeline_backends(kernels: dict, steps: dict, timed_ms: dict) -> list[str]:
    """The backends a timeline cell draws, in order: the two-launch kernels, the step launch and
    each step variant (a knob's timeline says where its time went), each where it was timed."""
    order = ["triton", STEP_BACKEND] + [b for b in kernels if is_step_backend(b) and b != STEP_BACKEND]
    return [b for b in order if b in kernels and b in steps and b in timed_ms]


def timeline_png(stem: str, profile: str, weight_dtype: str, context: int, rows: int, backend: str) -> str:
    """A timeline plot's file name: the two-launch kernels' with no tail, the step launch's ending
    in ``_step``, a step variant's in ``_step-<name>``."""
    tail = "" if backend == "triton" else "_" + backend.removeprefix("triton-")
    return f"{stem}_timeline_{profile}_{weight_dtype}_c{context}_b{rows}{tail}.png"


def _timeline(
    tk, step, n_layers, profile, weight_dtype, rows, out_dir: Path, stem: str, log, context: int, backend="triton"
) -> dict:
    """Rebuild ``tk`` with stage timestamps, replay one step from a graph, plot and summarise
    (``backend``: the two-launch kernels, the step launch or a step variant, ``timeline_png``)."""
    from monodecode_ops.decode_bench import timeline as TL

    layout = TL.STEP if is_step_backend(backend) else TL.TRITON
    tk.enable_timeline(n_layers)
    g, _ = capture_graph(step)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    stamps = tk.timeline(n_layers, rows)
    prof_ms = _median_ms(_time_graph(g, 5))
    del g
    layer = n_layers // 2
    path = out_dir / timeline_png(stem, profile, weight_dtype, context, rows, backend)
    title = f"{backend}: {profile} {weight_dtype} context {context} batch {rows}, layer {layer}"
    TL.plot_layer(stamps, layer, title, path, layout)
    # the raw stamps too ([layer, kernel, program, stage, slot] ns): a later summary can be run on them
    raw = path.with_name(f"{path.stem}{TL.STAMPS_SUFFIX}")
    TL.save_stamps(stamps, raw)
    summ = TL.summarize(stamps, layout)
    log(f"  {backend} timeline batch {rows} (step with stamps {prof_ms:.3f} ms): {path.name}")
    for line in TL.describe(summ):
        log(f"    {line}")
    tk.enable_timeline(n_layers, on=False)  # back to the kernels without stamps
    return {
        "backend": backend,
        "profile": profile,
        "weight_dtype": weight_dtype,
        "batch": rows,
        "context": context,
        "step_ms_with_stamps": prof_ms,
        "timeline": summ,
        "timeline_png": path.name,
        "timeline_stamps": raw.name,
    }


def _check_variants(variants: dict, step: bool = False) -> None:
    import dataclasses

    from monodecode.kernels.triton.config import CUDA

    fields = {f.name for f in dataclasses.fields(CUDA)}
    for name, change in variants.items():
        if step and f"triton-{name}" == STEP_BACKEND:
            raise MonodecodeError(
                f"variant {name!r}: its name is the step launch's ({STEP_BACKEND}); name it otherwise"
            )
        if is_step_backend(f"triton-{name}"):  # triton-step-<name>: a step variant's (timed with forward_step)
            raise MonodecodeError(
                f"variant {name!r}: its name is a step variant's ({STEP_BACKEND}-<name>); name it otherwise"
            )
        # a step launch plan's knob where launch targets go (as the variant's name, or a field)
        knobs = ((set(change) if isinstance(change, dict) else {name}) - fields) & set(PLAN_KNOBS)
        if knobs:
            raise MonodecodeError(
                f"variant {name!r}: {', '.join(sorted(knobs))} is a step launch plan knob: time it with"
                " --step-variants (name -> knobs)"
            )
        if not isinstance(change, dict) or set(change) - fields:
            raise MonodecodeError(
                f"variant {name!r}: expected an object of launch-target fields ({', '.join(sorted(fields))})"
            )


def check_step_variants(step_variants) -> None:
    """One ``MonodecodeError`` line for the first bad step variant (name -> plan: knobs of
    ``step_plan.PLAN_KNOBS``, ``step_plan.checked_plan``'s check)."""
    if not isinstance(step_variants, dict):
        raise MonodecodeError("--step-variants must be a JSON object (name -> step launch plan)")
    for name, plan in step_variants.items():
        if not isinstance(name, str) or len(name) > 40 or not STEP_VARIANT_NAME.fullmatch(name):
            raise MonodecodeError(
                f"step variant {name!r}: a name is letters, digits, '_' and inner '-', at most 40 "
                f"(the backend is {STEP_BACKEND}-<name>)"
            )
        if not isinstance(plan, dict):
            raise MonodecodeError(
                f"step variant {name!r}: expected an object of step launch plan knobs ({', '.join(PLAN_KNOBS)})"
            )
        try:
            checked_plan(plan)
        except ValueError as e:
            raise MonodecodeError(f"step variant {name!r}: {e}") from None


def _csv(text: str, kind=str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MonodecodeError(f"bad list {text!r}: expected comma-separated {kind.__name__} values") from None


def check_arguments(
    profiles, batches, contexts, fp8_profiles, stock=DEFAULT_STOCK, w8a16_batches=(), tuning_draws: int = 1
) -> None:
    """One ``MonodecodeError`` line naming the first bad argument (before anything touches the GPU)."""
    for p in list(profiles) + list(fp8_profiles):
        profile_config(p)  # the runtime's check: one line naming the unknown profile and the known ones
    if not batches or any(b < 1 or b > 16 for b in batches):
        raise MonodecodeError(f"batches must be in 1..16, got {batches}")
    if not contexts or any(c < 1 for c in contexts):
        raise MonodecodeError(f"contexts must be >= 1, got {contexts}")
    for p in list(profiles) + list(fp8_profiles):
        longest = profile_dims(p).max_position_embeddings
        if max(contexts) > longest:
            raise MonodecodeError(f"context {max(contexts)} exceeds {p}'s max_position_embeddings ({longest})")
    bad = [s for s in stock if s not in STOCK_PATHS]
    if bad:
        raise MonodecodeError(f"unknown stock path {bad[0]!r}; known: {', '.join(STOCK_PATHS)}")
    if any(b < 1 for b in w8a16_batches):
        raise MonodecodeError(f"--w8a16-batches must be >= 1, got {list(w8a16_batches)}")
    if not (isinstance(tuning_draws, int) and tuning_draws >= 1):
        raise MonodecodeError(f"--tuning-draws must be >= 1, got {tuning_draws}")


def run(
    profiles,
    batches,
    contexts,
    layers: int | None,
    fp8_profiles,
    replays: int,
    out_dir: Path,
    log=print,
    variants: dict | None = None,
    timeline_batches=(),
    baselines: bool = True,
    stock=DEFAULT_STOCK,
    w8a16_batches=DEFAULT_W8A16_BATCHES,
    deadline_s: float | None = None,
    timeline_contexts=None,
    long_batches=DEFAULT_LONG_BATCHES,
    tuning_draws: int = 1,
    step: bool = True,
    step_variants: dict | None = None,
) -> dict:
    """Run the benchmark; returns the result document (also written as JSON after every cell, and
    a PNG per context, under ``out_dir``).

    ``contexts``: context lengths (an int: one). ``variants``: name -> change of the CUDA launch
    target, each timed as ``triton-<name>`` next to the current target (default
    ``DEFAULT_VARIANTS``; ``{}`` for none). ``stock``: the ``STOCK_PATHS`` names to time.
    ``timeline_batches`` / ``timeline_contexts`` (default: the first context): cells whose triton,
    step-launch and step-variant steps are also drawn as per-stage timelines. ``long_batches``: the batches timed at the contexts
    after the first (None: every batch; the default keeps a run inside one device phase).
    ``deadline_s``: cells not started this many seconds
    after the start are recorded as skipped. ``baselines=False``: only the oracle and the triton
    builds (quick A/B). ``tuning_draws``: compiles of each tuned stock per cell (``TUNED``), the
    fastest timed (``fullgraph.fastest_draw``). ``step``: the step launch is timed beside triton
    (``STEP_BACKEND``; on CUDA sm_90+ at the widths it accepts, a skipped cell with the reason at
    the others); False leaves it out. ``step_variants``: name -> plan of the step launch
    (``step_plan.PLAN_KNOBS``), each timed as ``triton-step-<name>`` where the step launch is
    (default ``DEFAULT_STEP_VARIANTS``; ``{}`` for none)."""
    contexts = [contexts] if isinstance(contexts, int) else list(contexts)
    stock = tuple(stock) if baselines else ()
    check_arguments(profiles, batches, contexts, fp8_profiles, stock, tuple(w8a16_batches), tuning_draws)
    variants = DEFAULT_VARIANTS if variants is None else variants
    _check_variants(variants, step)
    step_variants = DEFAULT_STEP_VARIANTS if step_variants is None else step_variants
    check_step_variants(step_variants)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise MonodecodeError("the decode benchmark needs a CUDA or ROCm GPU; torch sees none")
    start = time.monotonic()
    deadline = start + deadline_s if deadline_s else None
    device = torch.device(DEVICE)
    gpu, uuid = gpu_identity()
    probes = read_probes(device)
    bw = max(probes.values())
    spec = spec_bandwidth(gpu)
    import triton

    date = _dt.date.today().isoformat()
    doc = {
        "schema": 4,
        "gpu": gpu,
        "gpu_uuid": uuid,
        "date": date,
        "contexts": contexts,
        "block_size": BLOCK,
        "read_bandwidth_gbs": bw / 1e9,
        "read_probes_gbs": {k: v / 1e9 for k, v in probes.items()},
        "spec_bandwidth_gbs": spec / 1e9 if spec else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers_note": "all layers timed" if layers is None else f"first {layers} layers timed (full-model ms scaled)",
        "method": __doc__.split("\n\n")[1:6],
        "backends": dict(LABELS),
        "stock": list(stock),
        "variants": variants,
        "step": step,
        "step_variants": step_variants if step else {},
        "results": [],
        "timelines": [],
    }
    for line in probe_lines(doc):
        log(f"# {line}")
    stem = f"decode_latency_{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}_{date}"
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath = out_dir / f"{stem}.json"

    def save():
        doc["summary"] = summary(doc)
        doc["elapsed_s"] = time.monotonic() - start
        tmp = jpath.with_suffix(".json.tmp")  # saved after every cell: a cut-short run keeps what it measured
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(jpath)

    for p, dtype in config_order(profiles, fp8_profiles):
        if deadline is not None and time.monotonic() > deadline:
            log(f"# {p} {dtype}: skipped, the run's time budget (--deadline-s) is spent")
            doc.setdefault("skipped_configs", []).append(f"{p} {dtype}")
            continue
        bench_config(
            p,
            dtype,
            batches,
            contexts,
            layers,
            replays,
            bw,
            device,
            log,
            variants=variants,
            step_variants=step_variants,
            stock=stock,
            w8a16_batches=tuple(w8a16_batches),
            timeline_batches=tuple(timeline_batches),
            timeline_contexts=tuple(contexts[:1] if timeline_contexts is None else timeline_contexts),
            out_dir=out_dir,
            stem=stem,
            timelines=doc["timelines"],
            deadline=deadline,
            spec=spec,
            long_batches=None if long_batches is None else tuple(long_batches),
            results=doc["results"],
            on_cell=save,
            tuning_draws=tuning_draws,
            step=step,
        )
    save()
    doc["paths"] = [str(jpath)] + write_plots(doc, out_dir, stem)
    return doc


def config_order(profiles, fp8_profiles) -> list[tuple[str, str]]:
    """(profile, weight dtype) in run order: each FP8 profile right after the same profile's BF16
    one (its bar is that BF16 stock; a run cut short by its deadline keeps both), then the rest."""
    out = []
    for p in profiles:
        out.append((p, "bf16"))
        if p in fp8_profiles:
            out.append((p, "fp8"))
    return out + [(p, "fp8") for p in fp8_profiles if p not in profiles]


def write_plots(doc: dict, out_dir: Path, stem: str) -> list[str]:
    """One PNG per context of the document's results; returns their paths."""
    out = []
    for context in sorted({r.get("context") for r in doc["results"]}, key=lambda c: c or 0):
        path = out_dir / f"{stem}_ctx{context}.png"
        plot(doc, path, context)
        out.append(str(path))
    return out


def load_reports(paths: list[str]) -> dict:
    """Saved result documents merged into one (the first one's probes and GPU), for ``--report``.
    A cell (profile, weights, context, batch) comes whole from the last document that timed it, so
    every ratio in the merged report is between backends timed side by side in one run, never a
    backend of one run against the stock of another."""
    docs = []
    for p in paths:
        try:
            docs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:
            raise MonodecodeError(f"--report {p}: cannot read a result document ({e.__class__.__name__})") from None
        if not isinstance(docs[-1], dict) or not isinstance(docs[-1].get("results"), list):
            raise MonodecodeError(f"--report {p}: not a decode_latency result document")
    doc = dict(docs[0])
    cells: dict[tuple, list[dict]] = {}
    for d in docs:
        rows: dict[tuple, list[dict]] = {}
        for r in d["results"]:
            r.setdefault("context", d.get("context"))  # schema 3: one context per document
            rows.setdefault((r["profile"], r["weight_dtype"], r["context"], r["batch"]), []).append(r)
        cells.update(rows)  # a later run's cell replaces the earlier one's, every backend of it
    doc["results"] = [r for rows in cells.values() for r in rows]
    # documents saved before the uuid was recorded count as a card of their own each
    doc["merged"] = {
        "documents": len(docs),
        "gpus": len({d.get("gpu_uuid") or f"unknown {i}" for i, d in enumerate(docs)}),
    }
    doc.setdefault("read_bandwidth_gbs", 0.0)
    doc.setdefault("layers_note", "")
    doc["summary"] = summary(doc)
    return doc


def print_report(doc: dict) -> None:
    """The tables, the summary table last."""
    print(markdown_table(doc))
    print()
    for line in probe_lines(doc):
        print(line)
    fp8 = fp8_table(doc)
    if fp8:
        print("\nFP8 triton against its bars (W8A16 fused-dequant stock; BF16 stock of the same cell):\n")
        print(fp8)
    b2b = back_to_back_table(doc)
    if b2b:
        print(
            f"\nEach step timed two ways (one replay after a synchronize; {BACK_TO_BACK} replays queued back to back):\n"
        )
        print(b2b)
    s = doc["summary"]
    if doc.get("skipped_configs"):
        print(f"\nnot run (time budget): {', '.join(doc['skipped_configs'])}")
    print(f"\ntriton never slower than the strongest stock: {s['never_slower_than_stock']}")
    print(f"speed targets (>= 1.00x every cell, >= 1.10x at batch 1 up to 8k) met: {s['speed_targets_met']}")
    if s.get("speed_targets_beyond_probe"):
        print(
            "speed targets asking more than the read probe of a kernel reading the cell's bytes "
            f"(the strongest stock's fraction times the target): {', '.join(s['speed_targets_beyond_probe'])}"
        )
    if any(x.get("step_run") for x in s["per_config"]):  # both launches timed: the faster of each cell
        below, short = s["faster_launch_below_stock"], s["faster_launch_below_speed_target"]
        print(
            f"mono decode with the faster launch of each cell: below the strongest stock in {len(below)} of "
            f"{len(s['per_config'])} cells{': ' + ', '.join(below) if below else ''}; "
            f"below the speed target in {len(short)}{': ' + ', '.join(short) if short else ''}"
        )
    if s.get("step_never_slower_than_stock") is not None:
        print(
            f"{STEP_BACKEND} (the cells it ran) never slower than the strongest stock: "
            f"{s['step_never_slower_than_stock']}; speed targets met: {s['step_speed_targets_met']}"
        )
    print("\n".join(doc.get("paths", [])))
    print()
    print(summary_table(doc))


def _prewarm(a, contexts: list[int]) -> int:
    from monodecode_ops.decode_bench import prewarm

    profiles, fp8, batches, stock = _csv(a.profiles), _csv(a.fp8_profiles), _csv(a.batches, int), _csv(a.stock)
    w8a16 = _csv(a.w8a16_batches, int)
    check_arguments(profiles, batches, contexts, fp8, stock, tuple(w8a16))
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise MonodecodeError("the decode benchmark needs a CUDA or ROCm GPU; torch sees none")
    long_batches = None if a.long_context_batches == "all" else _csv(a.long_context_batches, int)
    jobs = prewarm.jobs(profiles, fp8, batches, contexts, long_batches, stock, w8a16, device=DEVICE)
    workers = a.prewarm_workers
    if workers is None:
        workers = prewarm.default_workers(
            os.cpu_count() or 1, torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else None
        )
        print(
            f"prewarm: {workers} workers (one a CPU, at most one per {prewarm.WORKER_GPU_BYTES >> 30} GiB of free GPU memory)"
        )
    failed = prewarm.prewarm(jobs, workers)
    print(f"prewarm: {len(jobs) - failed}/{len(jobs)} cells compiled")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profiles", default=",".join(DEFAULT_PROFILES))
    ap.add_argument("--fp8-profiles", default="llama3-8b")
    ap.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)), help="context lengths, e.g. 1024,8192")
    ap.add_argument("--context", type=int, default=None, help="one context (same as --contexts N)")
    ap.add_argument("--layers", type=int, default=None, help="time only the first N layers")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument(
        "--tuning-draws",
        type=int,
        default=1,
        help=f"compiles of each tuned stock ({', '.join(TUNED)}) per cell, each tuned afresh after the first; "
        "the fastest is timed (3 for a batch-1 verdict: its tunings vary by 20 %%)",
    )
    ap.add_argument(
        "--stock",
        default=",".join(DEFAULT_STOCK),
        help=f"stock paths to time, of: {', '.join(STOCK_PATHS)} (default: {','.join(DEFAULT_STOCK)})",
    )
    ap.add_argument(
        "--long-context-batches",
        default=",".join(map(str, DEFAULT_LONG_BATCHES)),
        help="batches timed at the contexts after the first ('all': every batch of --batches)",
    )
    ap.add_argument(
        "--w8a16-batches",
        default=",".join(map(str, DEFAULT_W8A16_BATCHES)),
        help="FP8 batches of the W8A16 coordinate-descent stocks (stock-fullgraph-cdt, -cdt-wide); wider they do not fuse",
    )
    ap.add_argument(
        "--variants", default=None, help="JSON: name -> launch-target change (default: the previous target as 'before')"
    )
    ap.add_argument(
        "--step-variants",
        default=None,
        help=f"JSON: name -> step launch plan ({', '.join(f'{k}: {lo}-{hi}' for k, (_, lo, hi) in PLAN_KNOBS.items())}), "
        f"each timed as {STEP_BACKEND}-<name> beside {STEP_BACKEND} (default: {json.dumps(DEFAULT_STEP_VARIANTS)}; "
        "{} for none)",
    )
    ap.add_argument(
        "--timeline-batches",
        default="",
        help="batches drawn as per-stage timelines, e.g. 1,8 (triton, triton-step and each step variant)",
    )
    ap.add_argument("--timeline-contexts", default=None, help="contexts of the timelines (default: the first)")
    ap.add_argument("--deadline-s", type=float, default=None, help="record cells not started by then as skipped")
    ap.add_argument("--no-baselines", action="store_true", help="triton builds and the oracle only (quick A/B)")
    ap.add_argument(
        "--no-step",
        action="store_true",
        help=f"leave out the step launch ({STEP_BACKEND}: every layer one launch; on CUDA sm_90+ at the widths it accepts)",
    )
    ap.add_argument(
        "--out",
        help=f"the folder a run writes to (default {RESULTS_DIR}); with --report, its plots' (default: the "
        "first JSON's folder, so that a merge of one day's runs never overwrites another's)",
    )
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the tables of saved runs (merged) and exit")
    ap.add_argument(
        "--prewarm-only",
        action="store_true",
        help="compile the run's compiled stock steps into inductor's and Triton's caches in parallel, then exit",
    )
    ap.add_argument(
        "--prewarm-workers", type=int, help="processes compiling at once (default: one a CPU, as GPU memory allows)"
    )
    a = ap.parse_args(argv)
    try:
        if a.report:
            doc = load_reports(a.report)
            out = Path(a.out) if a.out else Path(a.report[0]).parent
            out.mkdir(parents=True, exist_ok=True)
            doc["paths"] = write_plots(doc, out, Path(a.report[0]).stem + "_report")
            print_report(doc)
            return 0
        try:
            variants = json.loads(a.variants) if a.variants else None
        except json.JSONDecodeError as e:
            raise MonodecodeError(f"--variants is not JSON: {e}") from None
        if variants is not None and not isinstance(variants, dict):
            raise MonodecodeError("--variants must be a JSON object (name -> launch-target change)")
        try:
            step_variants = json.loads(a.step_variants) if a.step_variants else None
        except json.JSONDecodeError as e:
            raise MonodecodeError(f"--step-variants is not JSON: {e}") from None
        if step_variants is not None:
            check_step_variants(step_variants)  # the prewarm too: a bad one fails before any GPU work
        if a.replays < 1:
            raise MonodecodeError(f"--replays must be >= 1, got {a.replays}")
        if a.deadline_s is not None and not a.deadline_s > 0:
            raise MonodecodeError(f"--deadline-s must be > 0, got {a.deadline_s}")
        contexts = [a.context] if a.context is not None else _csv(a.contexts, int)
        if a.prewarm_only:
            return _prewarm(a, contexts)
        doc = run(
            _csv(a.profiles),
            _csv(a.batches, int),
            contexts,
            a.layers,
            _csv(a.fp8_profiles),
            a.replays,
            Path(a.out or RESULTS_DIR),
            variants=variants,
            timeline_batches=_csv(a.timeline_batches, int),
            baselines=not a.no_baselines,
            stock=_csv(a.stock),
            w8a16_batches=_csv(a.w8a16_batches, int),
            deadline_s=a.deadline_s,
            long_batches=None if a.long_context_batches == "all" else _csv(a.long_context_batches, int),
            timeline_contexts=None if a.timeline_contexts is None else _csv(a.timeline_contexts, int),
            tuning_draws=a.tuning_draws,
            step=not a.no_step,
            step_variants=step_variants,
        )
    except MonodecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_report(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
