"""Serve mono decode only at the widths where it beats the stock step, measured on the node.

At warm-up, after the golden check, the runner times each built width's mono step (every layer
through the kernels) against the stock step (every layer through the stock side) at several
contexts (``timing_contexts``: 1024, the longest context the deployment serves as far as the
timing's KV budget holds it, and one between), on the same inputs: one untimed run each, then a
few timed replays within a time bound, the fastest replay kept. On a CUDA/ROCm device both steps
are captured in a graph and the replays time the graph (vLLM replays graphs too); where capture
fails, both are timed eagerly, so the comparison stays like for like. ``choose_widths`` turns the
timings into the served widths: a width is served only where mono wins at every timed context.

Warm-up stays bounded: every width is timed at its longest context first, the shorter ones only
while ``TOTAL_BUDGET_S`` lasts, and a width that lost once is not timed again; each step's
replays stop after ``BUDGET_S``. The time taken is logged and exported
(``monodecode_width_timing_seconds``).

The stock side is a ``StockBench``: in vLLM, vLLM's own decoder layers on the bound attention
backend over a private cache (``vllm_plugin.stock.VllmStockBench``, named ``vllm_layers``);
outside vLLM (``monodecode-ops verify``, the runtime tests) the runner's stock layer, the
reference unless one is given (``LayerBench``, named ``reference`` / ``stock_layer``). Where the
stock side cannot run, nothing is timed (``STOCK_UNAVAILABLE``): every width is served, as with
``force``, and the log, ``verify`` and the metrics' ``stock`` label say so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

REPLAYS = 3  # timed replays per step and width (the fastest counts)
BUDGET_S = 2.0  # at most this long timing one step at one context (at least one replay of it)
TOTAL_BUDGET_S = 90.0  # all widths and contexts: pairs not reached by then stay untimed
SHORT_CONTEXT = 1024  # the shortest context timed (shorter only where the longest is < 2 x this)
KV_BUDGET_BYTES = 4 << 30  # the timing's own KV cache, all layers (at most half the free device memory)
STOCK_UNAVAILABLE = "unavailable"  # the metric's stock label when nothing could be timed


@dataclass(frozen=True)
class WidthTiming:
    width: int
    context: int  # tokens in each row's KV before the step's own
    mono_s: float
    stock_s: float
    replays: int
    how: str  # "graph" | "eager"

    @property
    def speedup(self) -> float:
        """Stock time / mono time: > 1 means the kernels are faster."""
        return self.stock_s / self.mono_s if self.mono_s > 0 else float("inf")

    def describe(self) -> str:
        return (
            f"width {self.width} at context {self.context}: mono {self.mono_s * 1e3:.3g} ms vs stock "
            f"{self.stock_s * 1e3:.3g} ms ({self.speedup:.2f}x, {self.how}, best of {self.replays})"
        )


class StockBench(Protocol):
    """The stock side of the width timing, and the inputs both sides run on."""

    name: str  # what the stock step is (the metrics' ``stock`` label)

    def contexts(self, width: int) -> tuple[int, ...]:
        """The contexts to time ``width`` at (ascending)."""

    def steps(self, width: int, context: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """(mono step, stock step) of ``width`` rows at ``context``: each runs every layer on the
        same inputs and KV, returning the output (graph-capturable where the device allows)."""

    def close(self) -> None:
        """Free what the timing allocated."""


def timing_contexts(max_context: int, budget_context: int) -> tuple[int, ...]:
    """Contexts to time: ``SHORT_CONTEXT``, the longest a row serves (``max_context``, capped by
    ``budget_context``, what the timing's KV budget holds per row) and their geometric mean;
    below ``2 * SHORT_CONTEXT`` a quarter of the longest, its mean and the longest."""
    top = max(1, min(max_context, budget_context))
    low = SHORT_CONTEXT if top >= 2 * SHORT_CONTEXT else max(1, top // 4)
    mid = round(math.sqrt(low * top))
    return tuple(sorted({low, mid, top}))


@dataclass
class TimingRun:
    """What ``time_widths`` measured: the timings per width (ascending context) and the
    (width, context) pairs the total budget left untimed."""

    timings: dict[int, tuple[WidthTiming, ...]]
    skipped: list[tuple[int, int]]
    duration_s: float


def time_widths(
    bench: StockBench, widths: tuple[int, ...], device_type: str, total_budget_s: float | None = None
) -> TimingRun:
    """Each width's mono step against ``bench``'s stock step at each of its contexts: every width
    at its longest context first (where mono's margin is smallest; always timed), then the next
    longest while ``total_budget_s`` (``TOTAL_BUDGET_S``) lasts, so a spent budget leaves only
    shorter contexts untimed (reported in ``skipped``). A width that loses at one context is
    dropped whatever the others say: its shorter contexts are not timed."""
    t0 = time.perf_counter()
    deadline = t0 + (TOTAL_BUDGET_S if total_budget_s is None else total_budget_s)
    pending = {w: sorted(bench.contexts(w), reverse=True) for w in widths}
    timings: dict[int, list[WidthTiming]] = {w: [] for w in widths}
    skipped = []
    for rank in range(max(len(c) for c in pending.values())):
        for width in widths:
            if rank >= len(pending[width]) or any(not t.speedup > 1.0 for t in timings[width]):
                continue  # no context left, or lost already: dropped
            context = pending[width][rank]
            if rank > 0 and time.perf_counter() > deadline:
                skipped.append((width, context))
                continue
            mono, stock = bench.steps(width, context)
            m_s, m_n, m_how = time_step(mono, device_type)
            s_s, s_n, s_how = time_step(stock, device_type)
            if m_how != s_how:  # one step could not be captured: both eager, like for like
                m_s, m_n, m_how = time_step(mono, device_type, graph=False)
                s_s, s_n, s_how = time_step(stock, device_type, graph=False)
            timings[width].append(WidthTiming(width, context, m_s, s_s, min(m_n, s_n), m_how))
            del mono, stock  # this pair's inputs go before the next pair's are allocated
    ordered = {w: tuple(sorted(ts, key=lambda t: t.context)) for w, ts in timings.items() if ts}
    return TimingRun(ordered, skipped, time.perf_counter() - t0)


def choose_widths(
    widths: tuple[int, ...], timings: dict[int, tuple[WidthTiming, ...]], policy: str
) -> tuple[tuple[int, ...], dict[int, str]]:
    """The widths to serve and, for each dropped one, why. ``force`` serves every width; ``auto``
    serves a width only when its mono step measured faster than the stock step at every timed
    context (an untimed width is served: nothing says it loses)."""
    if policy == "force":
        return tuple(widths), {}
    served, dropped = [], {}
    for w in widths:
        lost = [t for t in timings.get(w, ()) if not t.speedup > 1.0]
        if not lost:
            served.append(w)
        else:
            dropped[w] = "slower than stock: " + "; ".join(t.describe() for t in lost)
    return tuple(served), dropped


def timing_table(timings: dict[int, tuple[WidthTiming, ...]]) -> list[str]:
    """One line per width: the speedup at each timed context (``verify`` and the startup log)."""
    return [
        f"width {w}: " + ", ".join(f"{t.context}: {t.speedup:.2f}x" for t in ts) for w, ts in sorted(timings.items())
    ]


def kv_budget_bytes(device: Any) -> int:
    """What the timing's KV may take: ``KV_BUDGET_BYTES``, at most half the device's free memory."""
    if getattr(device, "type", "cpu") != "cuda":
        return KV_BUDGET_BYTES
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return min(KV_BUDGET_BYTES, free // 2)


class LayerBench:
    """The stock side outside vLLM: ``stock_layer`` (the runner's: the reference unless one is
    given) against ``forward_layer`` (the kernels; their ``forward_step`` where they launch
    every layer at once, as a mono step serves), on the runner's plain paged KV; each side gets
    its own copy of the same random context (``inputs(width, context)``)."""

    def __init__(
        self,
        name: str,
        inputs: Callable[[int, int], tuple[Any, Any, Any, Any]],
        forward_layer: Callable[[int, Any, Any, Any], Any],
        stock_layer: Callable[[int, Any, Any, Any], Any],
        num_layers: int,
        max_context: int,
        budget_tokens: int,
        forward_step: Callable[[Any, list[Any], Any], Any] | None = None,
    ):
        self.name = name
        self._inputs, self._forward, self._stock = inputs, forward_layer, stock_layer
        self._forward_step = forward_step  # the kernels' whole-step launch, where they have one
        self._n, self._max_context, self._budget_tokens = num_layers, max_context, budget_tokens

    def contexts(self, width: int) -> tuple[int, ...]:
        return timing_contexts(self._max_context, self._budget_tokens // width - 1)

    def steps(self, width: int, context: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
        meta, kv_stock, kv_mono, x = self._inputs(width, context)

        def mono():  # as a mono step serves: one launch where the kernels have one
            from monodecode.kernels.base import kernel_layers

            return kernel_layers(self._forward, x, [meta] * self._n, kv_mono, self._forward_step)

        def stock():
            y = x
            for layer in range(self._n):
                y = self._stock(layer, y, meta, kv_stock)
            return y

        return mono, stock

    def close(self) -> None:
        pass


def time_step(
    run: Callable[[], object], device_type: str, graph: bool = True, budget_s: float | None = None
) -> tuple[float, int, str]:
    """Seconds of the fastest of up to ``REPLAYS`` runs of ``run`` (after one untimed run), how
    many were timed, and how: "graph" (captured once, replays timed; CUDA/ROCm only) or "eager"
    (when ``graph`` is off, on the CPU, or when the capture fails). ``budget_s``: ``BUDGET_S``."""
    budget_s = BUDGET_S if budget_s is None else budget_s
    if device_type == "cuda" and graph:
        timed = _time_graph(run, budget_s)
        if timed is not None:
            return timed
    run()  # untimed: first-touch, caches, lazy compiles
    return (*_best_of(run, budget_s, device_type), "eager")


def _best_of(run: Callable[[], object], budget_s: float, device_type: str) -> tuple[float, int]:
    sync = _sync(device_type)
    best, n, t_end = float("inf"), 0, time.perf_counter() + budget_s
    while n < REPLAYS and (n == 0 or time.perf_counter() < t_end):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return best, n


def _sync(device_type: str) -> Callable[[], None]:
    if device_type == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def capture_graph(run: Callable[[], Any]) -> tuple[Any, Any]:
    """``run`` once, untimed, on a side stream (as vLLM warms up before capture), then captured
    into a CUDA graph: (the graph, the output tensors its replays write)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def _time_graph(run: Callable[[], object], budget_s: float) -> tuple[float, int, str] | None:
    import torch

    try:
        graph, _ = capture_graph(run)
    except Exception:  # a step that cannot be captured: time both eagerly instead
        torch.cuda.synchronize()
        return None
    best, n = _best_of(graph.replay, budget_s, "cuda")
    del graph
    return best, n, "graph"
