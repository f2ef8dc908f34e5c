"""The ``triton-step`` kernel backend: the step launch (``step_kernel.py``), one persistent Gluon
launch over a range of decoder layers, beside the two-launch ``triton`` backend.

Opt-in: ``backend: triton-step`` selects it; ``backend: auto`` never does
(``registry.OPT_IN``) until it wins every benchmark cell. It runs Llama-style models with BF16 or
FP8 (e4m3fn, per-row scales) weights at TP 1 and widths 1-8 on NVIDIA sm_90 or newer (TMA,
mbarriers, mma.sync); ``step_plan.step_refusals``
holds the model's part of the refusals, this module the platform's. Its ``DecodeKernels``
(``step_launch.StepKernels``) run one layer a launch (``forward_layer``) or every layer of a step
in one launch (``forward_step``, which the runner and the vLLM plugin prefer on a mono step).

Registered lazily in ``monodecode.kernels.registry`` (this module imports triton); the kernels'
module is imported only by ``build``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from monodecode.kernels.base import BuildRequest
from monodecode.kernels.triton.backend import TritonBackend
from monodecode.kernels.triton.step_plan import MAX_WIDTH, WEIGHT_DTYPES, step_refusals
from monodecode.reasons import reason_code
from monodecode.services.platform import Platform
from monodecode.spec import KernelSpec

if TYPE_CHECKING:
    from monodecode.kernels.base import DecodeKernels

MIN_SM = 90  # TMA, mbarriers (Hopper)
# codes where the triton backend's reason and the step launch's say the same thing
_SAME_THING = {"no_gpu", "tp_size", "weight_dtype", "kv_dtype"}


class TritonStepBackend(TritonBackend):
    name: ClassVar[str] = "triton-step"
    needs_artifacts: ClassVar[bool] = False  # compiled just in time by Triton (its own cache)

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        if not platform.is_gpu:
            return (
                "the step launch is a Gluon kernel (TMA, mbarriers, mma.sync), which Triton's CPU "
                f"interpreter cannot run; it needs an NVIDIA GPU of sm_{MIN_SM} or newer, this is {platform.kind}"
            )
        if platform.kind != "cuda":
            return (
                f"the step launch is written for sm_{MIN_SM}'s TMA and mma.sync; AMD GPUs run the flydsl "
                f"or triton backends (this is {platform.arch})"
            )
        if not platform.torch_usable:
            return f"torch cannot launch on {platform.name} ({platform.arch})"
        digits = platform.arch.removeprefix("sm_")
        if not digits.isdigit() or int(digits) < MIN_SM:
            return f"the step launch needs sm_{MIN_SM} or newer (TMA, mbarriers, mma.sync); this is {platform.arch}"
        if importlib.util.find_spec("triton.experimental.gluon") is None:
            return "this triton has no Gluon (triton.experimental.gluon), which the step launch is written in"
        return None

    def kernel_spec(self, platform: Platform, widths: tuple[int, ...]) -> KernelSpec:
        return KernelSpec(
            backend=self.name,
            platform_kinds=("cuda",),
            grid_size=(platform.compute_units or None) if platform.is_gpu else None,
            tp_sizes=(1,),
            weight_dtypes=tuple(WEIGHT_DTYPES),
            block_sizes=None,
            widths=tuple(w for w in widths if w <= MAX_WIDTH),
            families=("llama", "gemma3"),  # Gemma-3 at width 1 (``step_plan.step_refusals``)
            head_dims=(64, 128),
        )

    def refusals(self, req: BuildRequest) -> list[str]:
        """The triton backend's reasons, then the step launch's (``step_refusals``, with whether
        each width's plan fits this GPU's SMs and shared memory) that add something."""
        reasons = super().refusals(req)
        said = {reason_code(r) for r in reasons}
        programs = req.platform.compute_units if req.platform.is_gpu and req.platform.compute_units > 0 else None
        for why in step_refusals(req.dims, req.weight_dtype, req.tp_size, req.widths, programs):
            code = reason_code(why)
            if code in _SAME_THING and code in said:
                continue
            reasons.append(why)
        return reasons

    def build(self, req: BuildRequest, weights: Any, artifacts: Any, allow_jit: bool) -> DecodeKernels:
        self.refuse_unless_buildable(req, allow_jit)
        from monodecode.kernels.triton.step_launch import StepKernels  # lazy: Gluon and the kernel

        device = torch.device(req.platform.torch_device)
        return StepKernels(req, weights, req.platform.compute_units, device)
