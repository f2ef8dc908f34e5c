"""A launch that never returns (a persistent kernel whose warps parted at a barrier, or that waits
on a word no program writes past its bounded polls) cannot be stopped from the host. The benchmark
then names the backend and cell that hung and exits with ``HANG_EXIT``: the cells before it are
already in the JSON (saved after every cell), and the run's log says what hung, where the phase's
``timeout`` would only have killed an unnamed wait (run 118, 2026-12-05: 270 s, no cell, no name)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

HANG_EXIT = 3
# a backend's first launch in a cell includes its compile (a few seconds for the step launch's
# variants on an H100/H200); nothing of ours takes a minute
HANG_S = 120.0


@contextlib.contextmanager
def exit_if_stuck(what: str, seconds: float = HANG_S, log=print) -> Iterator[None]:
    """Run the body; if it has not finished after ``seconds``, log that ``what`` hung and exit the
    process with ``HANG_EXIT`` (no Python cleanup: a CUDA call stuck behind the launch would block it)."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            log(
                f"  ! {what} has not returned in {seconds:g} s: a launch that never ends cannot be stopped from "
                "the host, so the run stops here (the cells before it are saved)"
            )
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(HANG_EXIT)

    watcher = threading.Thread(target=watch, name="decode-bench-hang", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
