"""Serve mono decode only at the widths where it beats the stock step, measured on the node.

At warm-up, after the golden check, the runner times each built width's mono step (every layer
through the kernels) against the stock step (every layer through the stock layers) on the same
inputs: one untimed run each, then a few timed replays within a time bound, the fastest replay
kept. On a CUDA/ROCm device both steps are captured in a graph and the replays time the graph
(vLLM replays graphs too); where capture fails, both are timed eagerly, so the comparison stays
like for like. ``choose_widths`` turns the timings into the served widths.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REPLAYS = 3  # timed replays per step and width (the fastest counts)
BUDGET_S = 2.0  # at most this long timing one width (at least one replay of each step)


@dataclass(frozen=True)
class WidthTiming:
    width: int
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
            f"width {self.width}: mono {self.mono_s * 1e3:.3g} ms vs stock {self.stock_s * 1e3:.3g} ms "
            f"({self.speedup:.2f}x, {self.how}, best of {self.replays})"
        )


def choose_widths(
    widths: tuple[int, ...], timings: dict[int, WidthTiming], policy: str
) -> tuple[tuple[int, ...], dict[int, str]]:
    """The widths to serve and, for each dropped one, why. ``force`` serves every width; ``auto``
    serves a width only when its mono step measured faster than the stock step (an untimed width
    is served: nothing says it loses)."""
    if policy == "force":
        return tuple(widths), {}
    served, dropped = [], {}
    for w in widths:
        t = timings.get(w)
        if t is None or t.speedup > 1.0:
            served.append(w)
        else:
            dropped[w] = f"slower than stock: {t.describe()}"
    return tuple(served), dropped


def time_step(
    run: Callable[[], object], device_type: str, graph: bool = True, budget_s: float = BUDGET_S
) -> tuple[float, int, str]:
    """Seconds of the fastest of up to ``REPLAYS`` runs of ``run`` (after one untimed run), how
    many were timed, and how: "graph" (captured once, replays timed; CUDA/ROCm only) or "eager"
    (when ``graph`` is off, on the CPU, or when the capture fails)."""
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
