"""The ``triton`` kernel backend: persistent K1/K2 on CUDA and ROCm GPUs, compiled just in time.

Registered lazily in ``monodecode.kernels.registry`` (this module imports triton). Supports TP 1,
widths 1..16, bf16 KV, bf16 weights everywhere, FP8 e4m3 weights as the platform has them
(OCP e4m3fn on CUDA and gfx950, FNUZ on gfx942).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import triton

from monodecode.errors import ConfigError, RefusalError
from monodecode.kernels import plan as plan_mod
from monodecode.kernels.base import BuildRequest, KernelBackend
from monodecode.kernels.triton.config import MAX_WIDTH, check_dims, target_for
from monodecode.kernels.triton.launch import TritonKernels, interpreting
from monodecode.services.buildkey import source_digest
from monodecode.services.platform import Platform
from monodecode.spec import KernelSpec

_SOURCE_DIR = Path(__file__).resolve().parent


def fp8_kind_for(platform: Platform) -> str:
    return "fp8_fnuz" if platform.arch == "gfx942" else "fp8"


class TritonBackend(KernelBackend):
    name: ClassVar[str] = "triton"
    needs_artifacts: ClassVar[bool] = False  # compiled just in time by Triton (its own cache)

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        if not platform.is_gpu:
            if interpreting():
                return None  # Triton's CPU interpreter (TRITON_INTERPRET=1): the real kernels, one program at a time
            return f"triton needs a CUDA or ROCm GPU; this is {platform.kind}"
        if not platform.torch_usable:
            return f"torch cannot launch on {platform.name} ({platform.arch})"
        digits = platform.arch.removeprefix("sm_")
        if platform.kind == "cuda" and digits.isdigit() and int(digits) < 80:
            return f"the triton kernels need sm_80 or newer (bf16 matrix instructions); this is {platform.arch}"
        return None

    def kernel_spec(self, platform: Platform, widths: tuple[int, ...]) -> KernelSpec:
        return KernelSpec(
            backend=self.name,
            platform_kinds=("cuda", "rocm", "cpu") if interpreting() else ("cuda", "rocm"),
            grid_size=(platform.compute_units or None) if platform.is_gpu else None,
            tp_sizes=(1,),
            weight_dtypes=("bf16", fp8_kind_for(platform)),
            block_sizes=None,
            widths=tuple(w for w in widths if w <= MAX_WIDTH),
            head_dims=(32, 64, 128, 256),
        )

    def compiler_version(self) -> str:
        return f"triton {triton.__version__}"

    def source_digest(self) -> str:
        return source_digest(_SOURCE_DIR, extra_files=[Path(plan_mod.__file__)])

    def refusals(self, req: BuildRequest) -> list[str]:
        reasons = []
        why = self.unavailable_reason(req.platform)
        if why:
            reasons.append(f"no_gpu: {why}")
        if req.tp_size != 1:
            reasons.append(f"tp_size: the triton kernels run TP 1 only, asked for {req.tp_size}")
        if req.kv_dtype != "bf16":
            reasons.append(f"kv_dtype: the triton kernels read a bf16 KV cache, asked for {req.kv_dtype}")
        if req.weight_dtype not in ("bf16", fp8_kind_for(req.platform)):
            reasons.append(f"weight_dtype: {req.weight_dtype} weights are not supported on {req.platform.arch}")
        try:
            check_dims(req.dims, req.widths)
        except ConfigError as e:
            reasons.append(f"model_dims: {str(e).removeprefix('triton kernels: ')}")
        return reasons

    def refuse_unless_buildable(self, req: BuildRequest, allow_jit: bool) -> None:
        """Raise ``RefusalError`` with every reason this build cannot go ahead (it compiles just in time)."""
        reasons = self.refusals(req)
        if not allow_jit:
            reasons.append(f"no_artifact: the {self.name} backend compiles just in time and allow_jit is off")
        if reasons:
            raise RefusalError(reasons)

    def build(self, req: BuildRequest, weights: Any, artifacts: Any, allow_jit: bool) -> TritonKernels:
        self.refuse_unless_buildable(req, allow_jit)
        on_cpu = not req.platform.is_gpu  # the interpreter plays the CUDA target's programs on the CPU
        target = target_for("cuda" if on_cpu else req.platform.kind)
        device = torch.device("cpu" if on_cpu else req.platform.torch_device)
        return TritonKernels(req, weights, target, req.platform.compute_units, device)
