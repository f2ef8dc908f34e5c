"""The kernel-backend interface every backend (flydsl, triton, reference) implements.

A backend turns a ``BuildRequest`` (model dims, dtypes, TP size, step widths, KV block size,
platform) plus the model's weights into ``DecodeKernels``: one callable per decoder layer that
maps the residual stream entering the layer to the one leaving it, reading and writing the
paged KV cache exactly like the reference (``monodecode.model.reference.decode_layer``).

Health: a kernel that detects a failure (an expired bounded wait, a non-finite value) records a
sticky code in its health word and keeps going with wrong data; the runner reads the word
before logits and fail-stops. The code packs (site, kernel, layer) so the cause is reportable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from monodecode.model.weights import WEIGHT_DTYPES
from monodecode.services.buildkey import build_key
from monodecode.services.platform import Platform

if TYPE_CHECKING:  # heavy or optional imports only for annotations
    import torch

    from monodecode.model.dims import ModelDims
    from monodecode.services.artifacts import ArtifactStore
    from monodecode.spec import KernelSpec

KV_DTYPES = ("bf16",)

# ---- build request -------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildRequest:
    """Everything a backend needs to build (and key) the kernels of one model on one rank."""

    dims: ModelDims
    weight_dtype: str  # bf16 | fp8 | fp8_fnuz
    tp_size: int
    widths: tuple[int, ...]  # ascending step widths (rows per decode step) to build
    block_size: int  # paged-KV block size (tokens per block)
    platform: Platform
    kv_dtype: str = "bf16"
    # runtime parameters, not part of the build key: bound on every in-kernel wait
    wait_timeout_s: float = field(default=10.0, compare=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        widths = tuple(int(w) for w in self.widths)
        if not widths or any(w <= 0 for w in widths) or list(widths) != sorted(set(widths)):
            raise ValueError(f"widths must be ascending distinct positive integers, got {self.widths!r}")
        object.__setattr__(self, "widths", widths)
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if self.tp_size < 1 or self.block_size < 1:
            raise ValueError("tp_size and block_size must be >= 1")

    @property
    def max_width(self) -> int:
        return self.widths[-1]


def smallest_width(widths: tuple[int, ...], rows: int) -> int | None:
    """The smallest built width that fits ``rows`` (rows are padded up to it), or None."""
    for w in widths:
        if rows <= w:
            return w
    return None


def kernel_layers(
    forward_layer: Callable[[int, Any, Any, Any], Any],
    x: Any,
    metas: list[Any],
    kv: Any,
    forward_step: Callable[[Any, list[Any], Any], Any] | None = None,
) -> Any:
    """The residual stream through layers ``0 .. len(metas) - 1`` on the kernels, as a mono step
    runs them: one ``forward_step`` launch where there is one (``DecodeKernels.forward_step``;
    None from it means none), else ``forward_layer`` one layer at a time."""
    if forward_step is not None:
        out = forward_step(x, metas, kv)
        if out is not None:
            return out
    for layer, meta in enumerate(metas):
        x = forward_layer(layer, x, meta, kv)
    return x


# ---- backend + kernels ---------------------------------------------------------------------


class DecodeKernels(ABC):
    """Built kernels of one model on one rank: one ``forward_layer`` per decode-step layer (and,
    where the backend has one, ``forward_step`` over every layer in one launch)."""

    widths: tuple[int, ...]

    @abstractmethod
    def forward_layer(self, layer: int, x: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        """Residual stream [rows, hidden] bf16 entering ``layer`` -> the one leaving it.

        ``rows`` <= max(widths); the backend pads to the smallest fitting width with inert rows
        (slot -1). Writes this step's K/V into ``kv`` at ``meta.slot_mapping``. On a detected
        failure it sets the health word and returns (wrong) data rather than raising: the
        runner's check before logits stops the step.
        """

    def forward_step(self, x: torch.Tensor, metas: list[Any], kv: Any) -> torch.Tensor | None:
        """Optional whole-step launch: the residual stream through every decoder layer at once
        (``metas[layer]`` is ``layer``'s ``DecodeMetadata``), with ``forward_layer``'s contract
        for rows, K/V writes and health. Default None: this backend has no whole-step launch,
        and the caller runs ``forward_layer`` per layer (as it also does when this returns None)."""
        return None

    def k1(self, layer: int, x: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        """Optional per-launch entry point (tests): attention output before o_proj."""
        raise NotImplementedError(f"{type(self).__name__} has no separate K1 entry point")

    def k2(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Optional per-launch entry point (tests): o_proj .. MLP residual add."""
        raise NotImplementedError(f"{type(self).__name__} has no separate K2 entry point")

    @abstractmethod
    def health(self) -> int:
        """0 when healthy; otherwise the sticky ``health_code`` of the first failure."""

    @abstractmethod
    def reset_health(self) -> None:
        """Clear the health word (tests only: production fail-stops instead)."""

    def arm_fault(self, fault: Any) -> bool:
        """Fault injection (``monodecode.services.faults.Fault``, kinds stall / nonfinite): make
        the next launch of ``fault.layer`` fail that way, once. The runner arms it right before
        the targeted step. Return False when the backend cannot inject it (the drill is then
        reported as not run)."""
        return False

    def residency_misfits(self, width: int | None = None) -> list[str]:
        """Launches (of ``width``, or all) that hold fewer programs per compute unit on this
        device than their plan is made for: exact, but slower than planned (the runner logs
        them). [] where all fit, or where the backend cannot tell."""
        return []

    def check_kv(self, kv: Any) -> None:
        """Raise ``ConfigError`` when the kernels cannot address ``kv``'s layout (shape, dtype,
        strides, alignment), before any launch: the vLLM plugin calls it when it binds vLLM's
        cache. Default: any layout ``forward_layer`` accepts."""

    def close(self) -> None:
        """Release device resources (scratch, peer buffers). Default: nothing to release."""


class KernelBackend(ABC):
    """A way to build ``DecodeKernels``. Stateless; registered in ``monodecode.kernels.registry``."""

    name: ClassVar[str]
    # True when build() needs a compiled artifact (or JIT) for the request's build key.
    needs_artifacts: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        """None when this backend can run on ``platform``; else one sentence why not."""

    def build_key(self, req: BuildRequest) -> str:
        """Deterministic key over everything the compiled kernels depend on (services.buildkey):
        the request's build fields, ``source_digest()`` and ``compiler_version()``."""
        return build_key(
            self.name,
            req.platform.arch,
            req.dims,
            req.weight_dtype,
            req.kv_dtype,
            req.tp_size,
            req.widths,
            req.block_size,
            self.source_digest(),
            self.compiler_version(),
        )

    def source_digest(self) -> str:
        """Digest of the sources the kernels are generated from (``services.buildkey.source_digest``).
        A backend that keys its builds through the default ``build_key`` overrides this."""
        raise NotImplementedError(f"{type(self).__name__} defines neither source_digest() nor build_key()")

    @abstractmethod
    def build(
        self,
        req: BuildRequest,
        weights: Any,
        artifacts: ArtifactStore | None,
        allow_jit: bool,
    ) -> DecodeKernels:
        """Build (or load) every width. Raise ``RefusalError`` (reasons "code: sentence") to refuse."""

    def kernel_spec(self, platform: Platform, widths: tuple[int, ...]) -> KernelSpec:
        """What this backend's build supports (``monodecode.spec``); override to narrow it."""
        from monodecode.spec import KernelSpec

        return KernelSpec(backend=self.name, widths=tuple(widths))

    def compiler_version(self) -> str:
        """Version string of the compiler that produced the kernels (part of the build key)."""
        return "none"
