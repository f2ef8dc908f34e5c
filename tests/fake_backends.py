"""Test kernel backends, selected by name through the real registry and ``MonoConfig``: the
reference math with a fake cost (the width policy's tests on the runner alone, on vLLM's real
layers and on the ROCm pair under Triton's interpreter)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from monodecode.kernels.reference_backend import ReferenceBackend, ReferenceKernels


class SlowAtTwo(ReferenceKernels):
    """The reference math, but a width-2 step costs ``delay_s`` (30 ms) more per layer."""

    delay_s: ClassVar[float] = 0.03

    def forward_layer(self, layer, x, meta, kv):
        if self._width(x.shape[0]) == 2:
            time.sleep(self.delay_s)
        return super().forward_layer(layer, x, meta, kv)


class SlowAtTwoBackend(ReferenceBackend):
    name: ClassVar[str] = "test_slow_at_two"

    def build(self, req, weights, artifacts, allow_jit):
        return SlowAtTwo(req, weights)


def register(cls) -> Callable[[], None]:
    """Make ``cls`` selectable as ``MonoConfig(backend=cls.name)``; returns the undo."""
    import monodecode.config as config_mod
    from monodecode.kernels import registry

    registry.register_backend(cls)
    validator = config_mod._VALIDATORS["backend"]
    known = config_mod.BACKENDS + tuple(n for n in registry.known_backends() if n not in config_mod.BACKENDS)
    config_mod._VALIDATORS["backend"] = config_mod._choice(known)

    def undo() -> None:
        config_mod._VALIDATORS["backend"] = validator
        registry._LAZY.pop(cls.name, None)
        registry._LOADED.pop(cls.name, None)

    return undo


class Misfit(ReferenceKernels):
    """The reference math, reporting one launch that holds fewer programs per SM than planned
    (what ``TritonKernels.residency_misfits`` finds on a GPU)."""

    def residency_misfits(self, width=None):
        return ["width 1 ka: 3 programs per SM, planned for 4"]


class MisfitBackend(ReferenceBackend):
    name: ClassVar[str] = "test_misfit"

    def build(self, req, weights, artifacts, allow_jit):
        return Misfit(req, weights)
