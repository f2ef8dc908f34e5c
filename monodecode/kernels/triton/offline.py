"""Compile the Triton K1/K2 without a GPU and read their resource use.

``triton.compile(ASTSource(...), target=GPUTarget(...))`` lowers the same kernels the launcher
runs, with the same compile-time constants (``config.constexprs``) and argument order
(``launch.k1_args`` / ``k2_args`` over meta tensors), for ``hip`` gfx942/gfx950 (wave64) or
``cuda`` sm_90. Resource figures come from the code object's AMDGPU metadata (``amdgcn`` text)
or from ``ptxas -v`` on the PTX.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from monodecode.kernels.triton.config import Target, compile_options, cuda_programs_per_sm, plan_for
from monodecode.kernels.triton.sources import kernel_sources
from monodecode.model.dims import ModelDims

# LDS per CU / shared memory per SM that one workgroup may use.
LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024, "sm_90": 227 * 1024}
# Registers: CDNA3/4 have 512 VGPRs (arch + acc) per SIMD lane; a wave64 workgroup of 4 waves
# puts one wave on each of the 4 SIMDs. Hopper: ``config.cuda_programs_per_sm``.
VGPRS_PER_SIMD = 512


@dataclass
class Resources:
    kernel: str
    arch: str
    width: int
    num_warps: int
    regs: int  # VGPR+AGPR per lane (AMD) / registers per thread (CUDA)
    sgprs: int
    spills: int  # VGPR + SGPR spills (AMD) / spill stores + loads bytes (CUDA)
    scratch_bytes: int
    lds_bytes: int
    lds_limit: int
    workgroups_per_cu: int
    vector_spills: int = 0  # VGPR spills (AMD) / spill bytes (CUDA); SGPR spills only in ``spills``

    def to_dict(self) -> dict:
        return asdict(self)


def _amd_field(text: str, name: str) -> int:
    m = re.search(rf"^\s*\.{re.escape(name)}:\s*(\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def amd_resources(kernel: str, arch: str, width: int, num_warps: int, compiled) -> Resources:
    text = compiled.asm["amdgcn"]
    vgpr = _amd_field(text, "vgpr_count")
    agpr = _amd_field(text, "agpr_count")
    sgpr = _amd_field(text, "sgpr_count")
    vspills = _amd_field(text, "vgpr_spill_count")
    spills = vspills + _amd_field(text, "sgpr_spill_count")
    # static LDS plus what Triton asks for at launch (its shared-memory allocation)
    lds = _amd_field(text, "group_segment_fixed_size") + int(compiled.metadata.shared)
    scratch = _amd_field(text, "private_segment_fixed_size")
    # waves of this workgroup per SIMD (4 SIMDs per CU), register file of 512 per lane
    waves_per_simd = -(-num_warps // 4)
    regs = vgpr + agpr
    by_regs = VGPRS_PER_SIMD // max(1, -(-regs // 8) * 8) // waves_per_simd
    by_lds = LDS_LIMIT[arch] // lds if lds else 99
    return Resources(
        kernel, arch, width, num_warps, regs, sgpr, spills, scratch, lds, LDS_LIMIT[arch], min(by_regs, by_lds), vspills
    )


def cuda_resources(kernel: str, width: int, num_warps: int, compiled) -> Resources:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    # a file of this call's own: compiles of the same kernel run side by side (test workers)
    with tempfile.TemporaryDirectory(prefix="monodecode-ptxas-") as tmp:
        src = Path(tmp) / f"{kernel}-{width}.ptx"
        src.write_text(compiled.asm["ptx"])
        res = subprocess.run(
            [ptxas, "--gpu-name", "sm_90a", "-v", str(src), "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        )
    info = res.stderr + res.stdout
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill", info))
    stack = int(re.search(r"(\d+) bytes stack frame", info).group(1)) if "stack frame" in info else 0
    lds = int(compiled.metadata.shared)
    per_sm = cuda_programs_per_sm(regs, num_warps, lds)
    return Resources(kernel, "sm_90", width, num_warps, regs, 0, spill, stack, lds, LDS_LIMIT["sm_90"], per_sm, spill)


def compile_width(
    dims: ModelDims,
    weight_dtype: str,
    width: int,
    arch: str,
    target: Target,
    block_size: int = 16,
    num_programs: int = 304,
    kernels: tuple[str, ...] = (),
) -> list[Resources]:
    """Compile K1 and K2 of one width (and the attention launch where the target has one) for
    ``arch`` (gfx942 | gfx950 | sm_90); their resources. ``kernels``: only these (k1, k2, ka)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if arch.startswith("gfx"):
        gpu = GPUTarget("hip", arch, 64)
    else:
        gpu = GPUTarget("cuda", 90, 32)
    out = []
    mplan = plan_for(dims, [width], num_programs, target, fp8=weight_dtype != "bf16")
    for name, src in kernel_sources(dims, weight_dtype, width, block_size, mplan, target):
        if kernels and name not in kernels:
            continue
        options = compile_options(target, width, name, weight_dtype != "bf16")
        warps = options["num_warps"]  # what it was compiled with, for the occupancy figures
        compiled = triton.compile(src, target=gpu, options=options)
        if arch.startswith("gfx"):
            out.append(amd_resources(name, arch, width, warps, compiled))
        else:
            out.append(cuda_resources(name, width, warps, compiled))
    return out
