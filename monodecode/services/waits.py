"""Bounded waits: every host-side wait for a device or a peer ends, with an answer, in bounded time."""

from __future__ import annotations

import time
from collections.abc import Callable


def bounded_wait(ready: Callable[[], bool], timeout_s: float, poll_s: float = 0.0005) -> bool:
    """Poll ``ready`` until it is true (True) or ``timeout_s`` passes (False). Never unbounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        if ready():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
