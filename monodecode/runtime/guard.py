"""The fail-stop check before logits, without a blocking host sync on the mono hot path.

Each step, on the device and in stream order, the guard folds the kernels' sticky health word
and (on a mono step) a non-finite test of the residual stream into one int32 ``code`` (0 =
healthy). What happens next depends on where the step runs:

- **GPU** (CUDA / ROCm): ``code`` is copied without blocking into a pinned host slot, then
  ``torch._assert_async(code == 0)`` is queued. The host never waits. A failed step traps the GPU
  queue at the assert: no later kernel runs (logits, sampling, the copy of the sampled token
  ids), so no client ever receives a token computed in a failed step. A watcher thread reads the
  pinned slots (the copy filled the failed step's slot before the trap): a nonzero code is
  handed to ``on_failure`` with its step, which records the cause and ends the process (exit 70).
- **CPU**: there is no device queue to stall, so the folded code is read at once and a failure
  is handled before the logits exist.

Cost on the GPU per step: a max over the residual stream, a select, a 4-byte copy and the assert
kernel (a few microseconds of device time, no host wait); the watcher reads the pinned slots
every few milliseconds without any CUDA call. The trap takes the whole CUDA context down with
it: the process is meant to end anyway.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import torch

from monodecode.kernels.health import health_code

NONFINITE_CODE = health_code("nonfinite")
_SLOTS = 64  # pinned host slots, reused round-robin (vLLM runs at most a step or two ahead)
_WATCH_PERIOD_S = 0.002
ASSERT_MESSAGE = "monodecode fail-stop: the health word is set before logits (the cause is in the marker)"


def folded_code(health_word: torch.Tensor, x: torch.Tensor | None, nonfinite_code: torch.Tensor | None = None):
    """One int32 on the device: the health word, or the nonfinite code when the word is clear and
    ``x`` holds a NaN/Inf. Never reads the value on the host."""
    code = health_word.reshape(()).to(torch.int32)
    if x is None:
        return code
    if nonfinite_code is None:
        nonfinite_code = torch.tensor(NONFINITE_CODE, dtype=torch.int32, device=code.device)
    finite = torch.isfinite(x.abs().amax())  # NaN and Inf propagate through the max
    return torch.where(finite | (code != 0), code, nonfinite_code)


class HealthGuard:
    """Checks every step's health before logits; ``on_failure(code, step)`` never returns
    normally (it records the fail-stop and exits, or raises in tests)."""

    def __init__(self, health_word: torch.Tensor, on_failure: Callable[[int, int], None]):
        self._word = health_word
        self._on_failure = on_failure
        self._async = health_word.device.type == "cuda"
        self._failure: BaseException | None = None  # raised by the watcher (tests: no exit)
        self._tripped = threading.Lock()  # on_failure runs once
        self._next = 0
        self._nonfinite = torch.tensor(NONFINITE_CODE, dtype=torch.int32, device=health_word.device)
        if self._async:
            self._host = torch.zeros(_SLOTS, dtype=torch.int32, pin_memory=True)
            self._host_view = self._host.numpy()  # the same pinned bytes, read without torch
            self._step_of = [0] * _SLOTS
            self._watcher = threading.Thread(target=self._watch, name="monodecode-health", daemon=True)
            self._watcher.start()
            _give_the_watcher_the_last_word(self)

    def check(self, step: int, x: torch.Tensor | None = None) -> None:
        """Queue (GPU) or run (CPU) the check of ``step``; ``x`` is the residual stream of a
        step the kernels produced (None on a stock step: only the sticky word is checked)."""
        if self._failure is not None:
            raise self._failure
        code = folded_code(self._word, x, self._nonfinite)
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
        self._step_of[slot] = step
        self._host[slot : slot + 1].copy_(code.reshape(1), non_blocking=True)
        torch._assert_async(code == 0, ASSERT_MESSAGE)

    def _scan(self) -> bool:
        """True when a slot holds a failure (then ``on_failure`` has run, once)."""
        hits = self._host_view.nonzero()[0]
        if not len(hits):
            return False
        slot = int(hits[0])
        with self._tripped:
            if self._failure is None:
                try:
                    self._on_failure(int(self._host_view[slot]), self._step_of[slot])
                except BaseException as e:  # exit_on_failstop off (tests): the next check raises
                    self._failure = e
        return True

    def _watch(self) -> None:
        # A failed step's copy lands in its slot before the assert traps the queue, and no later
        # copy runs after the trap, so a nonzero slot names the failed step. Reading pinned host
        # memory needs no CUDA call; waking every few milliseconds costs the serving thread nothing.
        while not self._scan():
            time.sleep(_WATCH_PERIOD_S)

    def drain(self, timeout_s: float = 10.0) -> None:
        """Let every queued check land and be looked at (tests, and before an uncaught error
        ends the process); raises what ``on_failure`` raised, if anything."""
        if not self._async:
            return
        try:
            torch.cuda.current_stream().synchronize()
        except RuntimeError:
            pass  # the queue trapped: the failed step's slot is already filled
        deadline = time.monotonic() + timeout_s
        while not self._scan() and time.monotonic() < deadline and self._failure is None:
            if not self._host_view.any():
                break
            time.sleep(_WATCH_PERIOD_S)
        if self._failure is not None:
            raise self._failure


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
