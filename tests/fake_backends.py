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


class StepReference(ReferenceKernels):
    """The reference math with a whole-step launch: ``forward_step`` runs the reference layers
    (``decode_layer``) over every layer in one call, like ``triton-step``'s one launch; each
    entry point counts its calls (``calls``)."""

    def __init__(self, req, weights):
        super().__init__(req, weights)
        self.calls = {"forward_layer": 0, "forward_step": 0}

    def forward_layer(self, layer, x, meta, kv):
        self.calls["forward_layer"] += 1
        return super().forward_layer(layer, x, meta, kv)

    def forward_step(self, x, metas, kv):
        from monodecode.model.reference import decode_layer

        self.calls["forward_step"] += 1
        assert len(metas) == len(self.weights.layers)
        for layer, lw in enumerate(self.weights.layers):
            x = decode_layer(self.dims, layer, lw, x, metas[layer], kv)
        return x


class NoStepReference(StepReference):
    """Counts like ``StepReference`` but has no whole-step launch after all: ``forward_step``
    returns None (the caller runs ``forward_layer`` per layer)."""

    def forward_step(self, x, metas, kv):
        self.calls["forward_step"] += 1
        return None


class StepSkipsLayer(StepReference):
    """Every layer right one at a time, but the whole-step launch skips the last layer."""

    def forward_step(self, x, metas, kv):
        self.calls["forward_step"] += 1
        from monodecode.model.reference import decode_layer

        for layer, lw in enumerate(self.weights.layers[:-1]):
            x = decode_layer(self.dims, layer, lw, x, metas[layer], kv)
        return x


class StepReferenceBackend(ReferenceBackend):
    name: ClassVar[str] = "test_step_reference"
    kernels: ClassVar[type[StepReference]] = StepReference

    def build(self, req, weights, artifacts, allow_jit):
        return self.kernels(req, weights)


class NoStepReferenceBackend(StepReferenceBackend):
    name: ClassVar[str] = "test_no_step_reference"
    kernels: ClassVar[type[StepReference]] = NoStepReference


class StepSkipsLayerBackend(StepReferenceBackend):
    name: ClassVar[str] = "test_step_skips_layer"
    kernels: ClassVar[type[StepReference]] = StepSkipsLayer
