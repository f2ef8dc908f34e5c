"""Run ``vllm serve`` as a child and exit 70 when a worker fail-stopped.

A worker that fail-stops exits 70, but vLLM's API server then shuts down cleanly and exits 0, so
the container's exit code would hide the fail-stop (and the alert on exit code 70 could never
fire). The supervisor keeps the container's main process: it forwards termination signals to the
server, waits for it, and returns 70 when a fail-stop marker under ``failstop_dir`` gained an
event during the run; otherwise the server's own status (128 + N for a signal N). On Linux the
server is also told to stop (SIGTERM, ``PR_SET_PDEATHSIG``) when the supervisor itself dies, even
by SIGKILL, which no handler can forward: an orphaned server would keep its port and GPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from monodecode.runtime.failstop import EXIT_CODE, FailStopEvent, FailStopRecorder

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def recorded_failstops(failstop_dir: str | Path) -> set[tuple]:
    """Every event recorded in the rank markers under ``failstop_dir`` (unreadable ones: none)."""
    root = Path(failstop_dir).expanduser()
    events: set[tuple] = set()
    for marker in sorted(root.glob("failstop-rank*.json")):
        suffix = marker.stem.removeprefix("failstop-rank")
        if not suffix.isascii() or not suffix.isdigit():
            continue
        for e in FailStopRecorder(root, rank=int(suffix)).read().events:
            events.add(_key(e))
    return events


def _key(e: FailStopEvent) -> tuple:
    return (e.rank, e.step, e.site, e.layer, e.kernel, e.time, e.pid)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _stop_with(parent: int) -> Callable[[], None]:
    """For the child, between fork and exec: SIGTERM when ``parent`` dies (Linux; elsewhere nothing)."""

    def arm() -> None:
        if not sys.platform.startswith("linux"):
            return
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the request was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def run_supervised(cmd: Sequence[str], env: Mapping[str, str], failstop_dir: str | Path) -> int:
    """Run ``cmd``; its exit status, or ``EXIT_CODE`` when a fail-stop was recorded meanwhile."""
    before = recorded_failstops(failstop_dir)
    child = subprocess.Popen(list(cmd), env=dict(env), preexec_fn=_stop_with(os.getpid()))  # noqa: PLW1509

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        rc = child.wait()  # a forwarded signal interrupts nothing: the wait is retried (PEP 475)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    new = recorded_failstops(failstop_dir) - before
    if new:
        print(
            f"monodecode: {len(new)} fail-stop(s) recorded under {Path(failstop_dir).expanduser()} during this run; "
            f"exiting {EXIT_CODE} (server exited {rc})",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_CODE
    return 128 - rc if rc < 0 else rc
