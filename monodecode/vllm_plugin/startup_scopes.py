"""Which forwards serve requests: vLLM's start-up and dummy forwards are told apart on the host.

vLLM runs the model many times before (and between) scheduled steps: the memory profile, the
eager warm-up passes before each CUDA graph capture, the capture itself, vLLM 0.33's model-runner
v2 kernel warm-up (synthetic requests through ``execute_model``) and, with data parallelism, idle
dummy batches. Several of these carry real attention metadata (a FULL-graph warm-up builds it so
the captured graph has it), so "the forward context has metadata" alone counts them as served
steps, and an armed fault drill can fire before any request arrives.

Nothing in the forward context marks those passes, so the worker and model-runner methods that
run them are wrapped: while one of them is on the stack (per thread / context), a forward is not
a served step. The wrap is installed only when mono decode is requested (stock serving is never
touched), on the classes of vLLM's worker modules that this process has loaded (the model runner
and worker that vLLM picked for this platform are among them by the time the model is built).
Installing it twice is a no-op.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("monodecode.vllm")

# vLLM's worker and model-runner methods inside which no forward serves a request (0.32-0.33:
# V1 and V2 model runners, GPU / CPU / XPU workers). Nested calls (a worker's warm-up calling
# the runner's _dummy_run) only deepen the scope.
NOT_SERVING_METHODS = (
    "profile_run",
    "_dummy_run",
    "capture_model",
    "compile_or_warm_up_model",
    "determine_available_memory",
)
_WORKER_PACKAGE = "vllm.v1.worker."
_MARK = "__monodecode_not_serving__"

_depth: contextvars.ContextVar[int] = contextvars.ContextVar("monodecode_not_serving_depth", default=0)


def in_startup_scope() -> bool:
    """True while one of vLLM's profile / warm-up / capture / dummy-run methods is running."""
    return _depth.get() > 0


def _not_serving(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        token = _depth.set(_depth.get() + 1)
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.reset(token)

    setattr(wrapper, _MARK, True)
    return wrapper


def _worker_classes() -> list[type]:
    classes = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(_WORKER_PACKAGE) or module is None:
            continue
        for obj in vars(module).values():
            if inspect.isclass(obj) and obj.__module__ == name:
                classes.append(obj)
    return classes


def install() -> list[str]:
    """Wrap every loaded vLLM worker / model-runner class's own start-up methods; returns the
    ``Class.method`` names wrapped now (empty when already installed)."""
    wrapped = []
    for cls in _worker_classes():
        for name in NOT_SERVING_METHODS:
            fn = cls.__dict__.get(name)
            if not inspect.isfunction(fn) or getattr(fn, _MARK, False):
                continue
            setattr(cls, name, _not_serving(fn))
            wrapped.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    if wrapped:
        log.debug("start-up forwards are not counted as steps: wrapped %s", ", ".join(wrapped))
    return wrapped
