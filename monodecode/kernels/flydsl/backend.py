"""The ``flydsl`` kernel backend: baked K1/K2 code for gfx942 / gfx950, loaded without compiling.

Build = look the build key up in the ArtifactStore (sha256 of every file verified), stage the
FlyDSL cache entries into a private writable directory and bind every width's launchers with
``FLYDSL_RUNTIME_RUN_ONLY=1`` (trace + cache hit, never lower). Without an artifact the build
refuses with ``no_artifact`` unless the config allows JIT, in which case the same compile as
``monodecode-ops precompile`` runs (in a subprocess) into that private directory first.

The host side (packed weights, RoPE tables, the plan's scratch buffer, the launches on the
current stream) is ``launch.FlyDSLKernels``. Nothing here imports FlyDSL or AITER until ``build``
runs on a ROCm device.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, ClassVar

from monodecode.errors import RefusalError
from monodecode.kernels.base import BuildRequest, DecodeKernels, KernelBackend
from monodecode.kernels.flydsl.arch import ARCHS
from monodecode.services.platform import Platform


def _fp8_kind_for(arch: str) -> str:
    return ARCHS[arch].fp8_kind


class FlyDSLBackend(KernelBackend):
    name: ClassVar[str] = "flydsl"
    needs_artifacts: ClassVar[bool] = True

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        if platform.kind != "rocm" or platform.arch not in ARCHS:
            return f"flydsl targets gfx942/gfx950 ROCm GPUs; this is {platform.kind} {platform.arch}"
        if not platform.torch_usable:  # e.g. seen only in sysfs by a CPU build of torch: nothing could launch
            return (
                f"torch cannot launch on {platform.name} ({platform.arch}): a CPU build of torch or no "
                "/dev/kfd access; flydsl launches through a ROCm torch"
            )
        if importlib.util.find_spec("flydsl") is None:
            return "the flydsl package is not installed (pip extra 'flydsl')"
        need = ARCHS[platform.arch].compute_units
        if platform.compute_units < need:
            return (
                f"only {platform.compute_units} compute units visible (partition mode "
                f"{platform.partition_mode or 'unknown'}); the persistent grid needs all {need} resident"
            )
        return None

    def kernel_spec(self, platform: Platform, widths: tuple[int, ...]):
        from monodecode.spec import KernelSpec

        spec = ARCHS.get(platform.arch)
        return KernelSpec(
            backend=self.name,
            platform_kinds=("rocm",),
            archs=tuple(ARCHS),
            tp_sizes=(1,),
            grid_size=spec.compute_units if spec else None,
            widths=tuple(widths),
            weight_dtypes=("bf16", spec.fp8_kind) if spec else ("bf16",),
            block_sizes=None,
        )

    def compiler_version(self) -> str:
        from monodecode.kernels.flydsl.bake import compiler_version

        return compiler_version()

    def build_key(self, req: BuildRequest) -> str:
        from monodecode.kernels.flydsl.bake import flydsl_build_key

        return flydsl_build_key(
            req.platform.arch, req.dims, req.weight_dtype, req.widths, req.block_size, req.tp_size, req.kv_dtype
        )

    def _refusals(self, req: BuildRequest) -> list[str]:
        reasons = []
        why = self.unavailable_reason(req.platform)
        if why:
            reasons.append(f"backend_unavailable: {why}")
        if req.tp_size != 1:
            reasons.append(
                f"tp_size: flydsl K1/K2 for TP {req.tp_size} compile (precompile --tp-size), but the "
                "runtime does not yet give the backend its rank and the peer buffers of the other ranks"
            )
        if req.kv_dtype not in ("bf16", "auto", "bfloat16"):
            reasons.append(f"kv_dtype: flydsl reads a bf16 KV cache, not {req.kv_dtype}")
        arch = req.platform.arch
        if arch in ARCHS and req.weight_dtype != "bf16" and req.weight_dtype != _fp8_kind_for(arch):
            reasons.append(f"weight_dtype: {arch} decodes {_fp8_kind_for(arch)} FP8 weights, not {req.weight_dtype}")
        return reasons

    def build(self, req: BuildRequest, weights: Any, artifacts: Any, allow_jit: bool) -> DecodeKernels:
        from monodecode.errors import ArtifactError
        from monodecode.kernels.flydsl import bake

        reasons = self._refusals(req)
        if reasons:
            raise RefusalError(reasons)
        key = self.build_key(req)
        run_dir = Path(tempfile.mkdtemp(prefix="monodecode-flydsl-run-"))
        try:
            entry = None
            if artifacts is not None:
                try:
                    entry = artifacts.lookup(key)
                except ArtifactError as e:
                    raise RefusalError(f"artifact_checksum: {e}") from None
            if entry is not None:
                try:
                    bake.stage_run_cache(entry, run_dir, artifacts)
                except ArtifactError as e:
                    raise RefusalError(f"artifact_checksum: {e}") from None
            elif allow_jit:
                from monodecode.kernels.flydsl.offline import compile_in_subprocess

                compile_in_subprocess(
                    req.platform.arch, req.dims, list(req.widths), req.weight_dtype, req.block_size, run_dir
                )
            else:
                where = f"in {artifacts.root}" if artifacts is not None else "(no artifact_dir configured)"
                raise RefusalError(
                    f"no_artifact: no baked flydsl artifact for build key {key[:16]} {where} and allow_jit is false"
                )
            from monodecode.kernels.flydsl.launch import FlyDSLKernels

            kernels = FlyDSLKernels(req, weights)
            kernels.bind(run_dir)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)  # a refused or failed build leaves nothing behind
            raise
        # the launchers read the run-only cache while the kernels live; gone with them (or at exit)
        weakref.finalize(kernels, shutil.rmtree, run_dir, ignore_errors=True)
        return kernels
