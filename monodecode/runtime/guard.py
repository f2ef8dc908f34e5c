"""The fail-stop check before logits, without a blocking host sync on the mono hot path.

Each step, on the device and in stream order, the guard folds the kernels' sticky health word
and (on a mono step) a non-finite test of the residual stream into one int32 ``code`` (0 =
healthy). What happens next depends on where the step runs:

- **GPU** (CUDA / ROCm): ``code`` is copied without blocking into a pinned host slot, an event
  is recorded, then ``torch._assert_async(code == 0)`` is queued. The host never waits. A failed
  step traps the GPU queue at the assert: no later kernel runs (logits, sampling, the copy of the
  sampled token ids), so no client ever receives a token computed in a failed step. A watcher
  thread waits on each step's event (off the hot path; it releases the GIL while waiting) and
  reads the slot the copy filled before the trap: a nonzero code is handed to ``on_failure``
  with the step, which records the cause and ends the process (exit 70).
- **CPU**: there is no device queue to stall, so the folded code is read at once and a failure
  is handled before the logits exist.

Cost on the GPU per step: a reduction over the residual stream, a select, a 4-byte copy, an
event record and the assert kernel (a few microseconds of device time, no host wait). The
trap takes the whole CUDA context down with it: the process is meant to end anyway.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable

import torch

from monodecode.kernels.health import health_code

NONFINITE_CODE = health_code("nonfinite")
_SLOTS = 64  # pinned host slots, reused round-robin (vLLM runs at most a step or two ahead)
ASSERT_MESSAGE = "monodecode fail-stop: the health word is set before logits (the cause is in the marker)"


def folded_code(health_word: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
    """One int32 on the device: the health word, or the nonfinite code when the word is clear and
    ``x`` holds a NaN/Inf. Never reads the value on the host."""
    code = health_word.reshape(()).to(torch.int32)
    if x is None:
        return code
    nonfinite = ~torch.isfinite(x).all()
    return torch.where((code == 0) & nonfinite, torch.full_like(code, NONFINITE_CODE), code)


class HealthGuard:
    """Checks every step's health before logits; ``on_failure(code, step)`` never returns
    normally (it records the fail-stop and exits, or raises in tests)."""

    def __init__(self, health_word: torch.Tensor, on_failure: Callable[[int, int], None]):
        self._word = health_word
        self._on_failure = on_failure
        self._async = health_word.device.type == "cuda"
        self._failure: BaseException | None = None  # raised by the watcher (tests: no exit)
        self._next = 0
        if self._async:
            self._host = torch.zeros(_SLOTS, dtype=torch.int32, pin_memory=True)
            self._pending: queue.SimpleQueue = queue.SimpleQueue()
            self._watcher = threading.Thread(target=self._watch, name="monodecode-health", daemon=True)
            self._watcher.start()
            _give_the_watcher_the_last_word(self)

    def check(self, step: int, x: torch.Tensor | None = None) -> None:
        """Queue (GPU) or run (CPU) the check of ``step``; ``x`` is the residual stream of a
        step the kernels produced (None on a stock step: only the sticky word is checked)."""
        if self._failure is not None:
            raise self._failure
        code = folded_code(self._word, x)
        if not self._async:
            value = int(code)  # a CPU tensor: a memory read, not a device sync
            if value:
                self._on_failure(value, step)
            return
        if torch.cuda.is_current_stream_capturing():
            torch._assert_async(code == 0, ASSERT_MESSAGE)  # the replayed graph traps on its own
            return
        slot = self._next % _SLOTS
        self._next += 1
        self._host[slot : slot + 1].copy_(code.reshape(1), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        torch._assert_async(code == 0, ASSERT_MESSAGE)
        self._pending.put((step, slot, done))

    def _watch(self) -> None:
        while True:
            step, slot, done = self._pending.get()
            try:
                done.synchronize()
            except RuntimeError:
                pass  # the context died after this step's copy; the slot still holds its code
            if slot is None:  # drain()'s marker
                continue
            value = int(self._host[slot])
            if value:
                try:
                    self._on_failure(value, step)
                except BaseException as e:  # exit_on_failstop off (tests): the next check raises
                    self._failure = e
                return

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until the watcher has looked at every queued step (tests, shutdown)."""
        if not self._async:
            return
        finished = threading.Event()
        self._pending.put((-1, None, _Signal(finished)))
        finished.wait(timeout_s)
        if self._failure is not None:
            raise self._failure


class _Signal:
    """A queue item that tells ``drain`` the watcher got this far."""

    def __init__(self, event: threading.Event):
        self._event = event

    def synchronize(self) -> None:
        self._event.set()


def _give_the_watcher_the_last_word(guard: HealthGuard) -> None:
    """After a trap the host sees the device error at its next sync. Where that error is not
    caught (a driver script, ``verify``), let the watcher record the fail-stop before the
    interpreter exits with a traceback. vLLM catches it and takes far longer to shut down."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            guard.drain(timeout_s=5.0)
        except BaseException:
            pass
        previous(kind, value, tb)

    sys.excepthook = hook
