"""Prometheus metrics of mono decode (prometheus-client) and a loopback exporter.

Names are a contract (README "Metrics" table; alert rules and the dashboard are tested
against it). Every label value the alerts use is created at zero up front, so a rate() over a
fresh process is 0 rather than absent.

Multiprocess: when ``PROMETHEUS_MULTIPROC_DIR`` is set (vLLM 0.33 sets it itself only with
``--api-server-count`` > 1, so the image entrypoint sets it to an empty directory; vLLM's API
server then aggregates every process into its ``/metrics``), prometheus-client writes values to per-process files there;
gauges use an aggregation that makes sense across TP ranks (``enabled`` = min: 0 if any rank is
degraded; timings and errors = max). ``start_exporter`` then serves the aggregate.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from monodecode.errors import MonodecodeError
from monodecode.reasons import FallbackReason, RefusalReason

PATHS = ("mono", "fallback")
FALLBACK_REASONS = tuple(r.value for r in FallbackReason)
REFUSAL_REASONS = tuple(r.value for r in RefusalReason)
FAILSTOP_SITES = ("wait_timeout", "nonfinite", "kernel_error", "shadow_mismatch")
SHADOW_RESULTS = ("pass", "fail")
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

# name -> (type, labels, help); the README table is generated from / tested against this.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "monodecode_enabled": (
        "gauge",
        (),
        "1 when mono decode runs eligible decode steps on this rank, 0 when off or degraded",
    ),
    "monodecode_build_info": (
        "gauge",
        ("backend", "arch", "build_key", "version"),
        "Always 1; labels name the kernel backend, GPU arch, build key and monodecode version",
    ),
    "monodecode_refusal_info": (
        "gauge",
        ("reason",),
        "1 per refusal reason code while degraded (stock decode running)",
    ),
    "monodecode_steps_total": (
        "counter",
        ("path",),
        "Decode steps by path: mono (megakernel) or fallback (stock layers)",
    ),
    "monodecode_fallback_steps_total": ("counter", ("reason",), "Steps that took the stock path, by reason"),
    "monodecode_step_duration_seconds": ("histogram", ("path",), "Wall time of a step's decoder-layer stack, by path"),
    "monodecode_warmup_duration_seconds": (
        "gauge",
        (),
        "Duration of the last warm-up (build + golden check of every width)",
    ),
    "monodecode_warmup_max_abs_error": (
        "gauge",
        (),
        "Largest absolute difference between kernel and reference in the warm-up golden check (all widths, layers)",
    ),
    "monodecode_failstop_total": (
        "counter",
        ("site",),
        "Fail-stops recorded in this rank's marker (survives restarts), by site",
    ),
    "monodecode_last_failstop_timestamp_seconds": ("gauge", (), "Unix time of the last recorded fail-stop (0 if none)"),
    "monodecode_width_speedup": (
        "gauge",
        ("width", "context", "stock"),
        "Stock step time / mono step time per built width and context, measured at warm-up (> 1: mono faster); "
        "stock names the stock step",
    ),
    "monodecode_width_timing_seconds": (
        "gauge",
        ("stock",),
        "Time warm-up spent timing the widths against the stock step named by stock "
        "(unavailable: it could not run, every width is served untimed)",
    ),
    "monodecode_shadow_max_abs_error": (
        "gauge",
        (),
        "Largest absolute difference of the last shadow check (one layer: kernels vs the stock layer)",
    ),
    "monodecode_shadow_checks_total": ("counter", ("result",), "Shadow checks while serving, by result"),
}

_MP_MODE = {
    "monodecode_enabled": "min",
    "monodecode_build_info": "max",
    "monodecode_refusal_info": "max",
    "monodecode_warmup_duration_seconds": "max",
    "monodecode_warmup_max_abs_error": "max",
    "monodecode_last_failstop_timestamp_seconds": "max",
    "monodecode_width_speedup": "min",
    "monodecode_width_timing_seconds": "max",
    "monodecode_shadow_max_abs_error": "max",
}


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir") or None


def _name_without_total(name: str) -> str:
    # prometheus-client appends _total to counters itself
    return name[: -len("_total")] if name.endswith("_total") else name


class MonoMetrics:
    """The metric objects. Pass a fresh ``CollectorRegistry`` in tests; the default registry
    otherwise (use ``get_metrics()`` so a process creates them once)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        from prometheus_client import REGISTRY

        reg = REGISTRY if registry is None else registry
        self.registry = reg
        mp = multiprocess_dir() is not None

        def gauge(name: str) -> Gauge:
            _, labels, doc = METRICS[name]
            kw = {"multiprocess_mode": _MP_MODE[name]} if mp else {}
            return Gauge(name, doc, labels, registry=reg, **kw)

        def counter(name: str) -> Counter:
            _, labels, doc = METRICS[name]
            return Counter(_name_without_total(name), doc, labels, registry=reg)

        self.enabled = gauge("monodecode_enabled")
        self.build_info = gauge("monodecode_build_info")
        self.refusal_info = gauge("monodecode_refusal_info")
        self.steps = counter("monodecode_steps_total")
        self.fallback_steps = counter("monodecode_fallback_steps_total")
        _, labels, doc = METRICS["monodecode_step_duration_seconds"]
        self.step_duration = Histogram(
            "monodecode_step_duration_seconds", doc, labels, buckets=STEP_BUCKETS, registry=reg
        )
        self.warmup_duration = gauge("monodecode_warmup_duration_seconds")
        self.warmup_max_abs_error = gauge("monodecode_warmup_max_abs_error")
        self.failstops = counter("monodecode_failstop_total")
        self.last_failstop = gauge("monodecode_last_failstop_timestamp_seconds")
        self.width_speedup = gauge("monodecode_width_speedup")
        self.width_timing = gauge("monodecode_width_timing_seconds")
        self.shadow_max_abs_error = gauge("monodecode_shadow_max_abs_error")
        self.shadow_checks = counter("monodecode_shadow_checks_total")
        for result in SHADOW_RESULTS:
            self.shadow_checks.labels(result=result)
        self._failstop_base: dict[str, float] = {}
        self._refusal_codes: set[str] = set()  # every reason label ever set (zeroed when cleared)
        self._build_labels: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()
        for p in PATHS:
            self.steps.labels(path=p)
            self.step_duration.labels(path=p)
        for r in FALLBACK_REASONS:
            self.fallback_steps.labels(reason=r)
        for s in FAILSTOP_SITES:
            self.failstops.labels(site=s)
        self.enabled.set(0)
        self.last_failstop.set(0)

    # ---- lifecycle -------------------------------------------------------------------------

    def set_enabled(self, enabled: bool) -> None:
        self.enabled.set(1 if enabled else 0)

    def set_build(self, backend: str, arch: str, build_key: str, version: str) -> None:
        labels = (backend, arch, build_key, version)
        for old in self._build_labels - {labels}:
            self.build_info.labels(*old).set(0)  # clear() does not reach multiprocess files
        self.build_info.labels(*labels).set(1)
        self._build_labels.add(labels)

    def set_refusals(self, codes: Iterable[str]) -> None:
        """Exactly ``codes`` (``RefusalReason`` values) at 1, every code set before at 0; an
        unknown code is a ValueError. Zeroing, not ``clear()``: under ``PROMETHEUS_MULTIPROC_DIR``
        a label's value lives in this process's file, which ``clear()`` leaves as it was."""
        codes = [str(c) for c in dict.fromkeys(codes)]
        unknown = [c for c in codes if c not in REFUSAL_REASONS]
        if unknown:
            raise ValueError(f"unknown refusal reason code(s) {', '.join(map(repr, unknown))}")
        for old in self._refusal_codes - set(codes):
            self.refusal_info.labels(reason=old).set(0)
        for code in codes:
            self.refusal_info.labels(reason=code).set(1)
        self._refusal_codes |= set(codes)

    def set_warmup(self, duration_s: float, max_abs_error: float) -> None:
        self.warmup_duration.set(duration_s)
        self.warmup_max_abs_error.set(max_abs_error)

    def set_width_timing(self, speedups: dict[tuple[int, int], float], stock: str, seconds: float) -> None:
        """Warm-up timing against the stock step ``stock``: stock / mono step time per (width,
        context), and how long the timing took."""
        for (width, context), ratio in speedups.items():
            self.width_speedup.labels(width=str(width), context=str(context), stock=stock).set(ratio)
        self.width_timing.labels(stock=stock).set(seconds)

    # ---- per step --------------------------------------------------------------------------

    def count_step(self, path: str, reason: str | None = None) -> None:
        if path not in PATHS:
            raise ValueError(f"unknown step path {path!r}")
        self.steps.labels(path=path).inc()
        if path == "fallback":
            if reason not in FALLBACK_REASONS:
                raise ValueError(f"unknown fallback reason {reason!r}")
            self.fallback_steps.labels(reason=reason).inc()

    def observe_step(self, path: str, seconds: float) -> None:
        self.step_duration.labels(path=path).observe(seconds)

    def count_shadow_check(self, max_abs_error: float, passed: bool) -> None:
        self.shadow_max_abs_error.set(max_abs_error)
        self.shadow_checks.labels(result="pass" if passed else "fail").inc()

    # ---- fail-stop -------------------------------------------------------------------------

    def set_failstop_history(self, totals_by_site: dict[str, int], last_timestamp: float) -> None:
        """Export fail-stops read from the marker at start (counters only move up)."""
        with self._lock:
            for site, total in totals_by_site.items():
                have = self._failstop_base.get(site, 0)
                if total > have:
                    self.failstops.labels(site=site).inc(total - have)
                    self._failstop_base[site] = total
            if last_timestamp:
                self.last_failstop.set(last_timestamp)

    def count_failstop(self, site: str, timestamp: float) -> None:
        with self._lock:
            self.failstops.labels(site=site).inc()
            self._failstop_base[site] = self._failstop_base.get(site, 0) + 1
            self.last_failstop.set(timestamp)


_DEFAULT: MonoMetrics | None = None
_DEFAULT_LOCK = threading.Lock()


def get_metrics() -> MonoMetrics:
    """The process-wide metrics on prometheus-client's default registry (created on first use,
    so processes that never run the runner export nothing)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = MonoMetrics()
        return _DEFAULT


@dataclass
class Exporter:
    host: str
    port: int
    server: object
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self.server.shutdown()  # type: ignore[attr-defined]
        self.server.server_close()  # type: ignore[attr-defined]
        self.thread.join(timeout=5)


def exporter_registry(registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """What to serve: the multiprocess aggregate when PROMETHEUS_MULTIPROC_DIR is set."""
    mp_dir = multiprocess_dir()
    if mp_dir:
        from prometheus_client import multiprocess

        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg, path=mp_dir)
        return reg
    if registry is not None:
        return registry
    from prometheus_client import REGISTRY

    return REGISTRY


def start_exporter(port: int = 0, host: str = "127.0.0.1", registry: CollectorRegistry | None = None) -> Exporter:
    """Serve ``/metrics`` on ``host:port`` (0 = a free port) in a daemon thread.

    A port in use or a bad address is a ``MonodecodeError`` (one line), not a traceback.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise MonodecodeError(f"metrics port must be an integer between 0 and 65535, got {port!r}")
    try:
        server, thread = start_http_server(port, addr=host, registry=exporter_registry(registry))
    except OSError as e:
        if e.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            raise MonodecodeError(f"metrics port {port} on {host} is already in use") from None
        raise MonodecodeError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
    return Exporter(host=host, port=server.server_port, server=server, thread=thread)
