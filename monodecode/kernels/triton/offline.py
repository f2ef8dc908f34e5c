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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from monodecode.kernels.plan import ModelPlan, plan_model
from monodecode.kernels.triton.config import Target, constexprs
from monodecode.model.dims import ModelDims

# LDS per CU / shared memory per SM that one workgroup may use.
LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024, "sm_90": 227 * 1024}
# Registers: CDNA3/4 have 512 VGPRs (arch + acc) per SIMD lane; a wave64 workgroup of 4 waves
# puts one wave on each of the 4 SIMDs. Hopper: 64K 32-bit registers per SM.
VGPRS_PER_SIMD = 512
REGS_PER_SM = 65536

_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e4m3fnuz: "*fp8e4b8",
}


def _meta_layer(dims: ModelDims, weight_dtype: str):
    from monodecode.kernels.triton.launch import _Layer

    wdt = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_fnuz": torch.float8_e4m3fnuz}[weight_dtype]

    def t(dtype):
        return torch.empty(16, dtype=dtype, device="meta")

    return _Layer(
        attn_norm=t(torch.bfloat16),
        wqkv=t(wdt),
        sqkv=t(torch.float32),
        q_norm=t(torch.bfloat16),
        k_norm=t(torch.bfloat16),
        inv_freq=t(torch.float32),
        window=0,
        wo=t(wdt),
        so=t(torch.float32),
        post_norm=t(torch.bfloat16),
        mlp_norm=t(torch.bfloat16),
        wg=t(wdt),
        sg=t(torch.float32),
        wu=t(wdt),
        su=t(torch.float32),
        wd=t(wdt),
        sd=t(torch.float32),
        mlp_post_norm=t(torch.bfloat16),
    )


def _signature(fn, args: list, consts: dict) -> tuple[dict, dict]:
    from monodecode.kernels.triton.launch import KV_STRIDE_ARGS

    names = list(fn.arg_names)
    sig: dict[str, str] = {}
    attrs: dict = {}
    it = iter(args)
    for i, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        v = next(it)
        if isinstance(v, torch.Tensor):
            sig[name] = _TYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # every buffer is 256-byte aligned
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32"
            if name in KV_STRIDE_ARGS:  # the launcher checks these are multiples of 16 (kv_strides)
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, attrs


class _MetaMeta:
    def __init__(self, width: int):
        self.positions = torch.empty(width, dtype=torch.int64, device="meta")
        self.slot_mapping = torch.empty(width, dtype=torch.int64, device="meta")
        self.block_tables = torch.empty(width, 64, dtype=torch.int32, device="meta")
        self.seq_lens = torch.empty(width, dtype=torch.int32, device="meta")


def kernel_sources(
    dims: ModelDims, weight_dtype: str, width: int, block_size: int, mplan: ModelPlan, target: Target
) -> list[tuple[str, object]]:
    """[(name, ASTSource)] of K1 and K2 for one width: what the launcher compiles on a GPU and
    the compile checks compile on a CPU (same constants, same argument order)."""
    from triton.compiler import ASTSource

    from monodecode.kernels.triton.k1 import k1_kernel
    from monodecode.kernels.triton.k2 import k2_kernel
    from monodecode.kernels.triton.launch import k1_args, k2_args, kv_strides

    c1, c2 = constexprs(dims, mplan, width, target, block_size, weight_dtype != "bf16")
    L = _meta_layer(dims, weight_dtype)
    bf = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")  # noqa: E731
    scratch = torch.empty(16, dtype=torch.int64, device="meta")
    health = torch.empty(2, dtype=torch.int32, device="meta")
    kv = bf(2, block_size, dims.num_kv_heads, dims.head_dim)
    a1 = k1_args(
        L,
        bf(width, dims.hidden_size),
        kv,
        kv,
        kv_strides(kv, kv, dims, block_size),
        _MetaMeta(width),
        bf(width, dims.q_size),
        scratch,
        health,
        0,
        1000,
        0,
        dims,
    )
    a2 = k2_args(
        L,
        bf(width, dims.hidden_size),
        bf(width, dims.q_size),
        bf(width, dims.hidden_size),
        scratch,
        health,
        0,
        1000,
        0,
        dims,
    )
    out = []
    for name, fn, args, consts in (("k1", k1_kernel, a1, c1), ("k2", k2_kernel, a2, c2)):
        sig, attrs = _signature(fn, args, consts)
        out.append((name, ASTSource(fn, sig, constexprs=dict(consts), attrs=attrs)))
    return out


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

    ptx = compiled.asm["ptx"]
    tmp = Path(f"/tmp/monodecode-{kernel}-{width}.ptx")
    tmp.write_text(ptx)
    ptxas = get_ptxas(90).path
    res = subprocess.run(
        [ptxas, "--gpu-name", "sm_90a", "-v", str(tmp), "-o", "/dev/null"], capture_output=True, text=True, check=True
    )
    info = res.stderr + res.stdout
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill", info))
    stack = int(re.search(r"(\d+) bytes stack frame", info).group(1)) if "stack frame" in info else 0
    lds = int(compiled.metadata.shared)
    by_regs = REGS_PER_SM // (regs * 32 * num_warps)
    by_lds = LDS_LIMIT["sm_90"] // lds if lds else 99
    return Resources(
        kernel, "sm_90", width, num_warps, regs, 0, spill, stack, lds, LDS_LIMIT["sm_90"], min(by_regs, by_lds), spill
    )


def compile_width(
    dims: ModelDims,
    weight_dtype: str,
    width: int,
    arch: str,
    target: Target,
    block_size: int = 16,
    num_programs: int = 304,
) -> list[Resources]:
    """Compile K1 and K2 of one width for ``arch`` (gfx942 | gfx950 | sm_90); their resources."""
    import triton
    from triton.backends.compiler import GPUTarget

    if arch.startswith("gfx"):
        gpu = GPUTarget("hip", arch, 64)
    else:
        gpu = GPUTarget("cuda", 90, 32)
    out = []
    mplan = plan_model(dims, 1, [width], num_programs)
    for name, src in kernel_sources(dims, weight_dtype, width, block_size, mplan, target):
        compiled = triton.compile(src, target=gpu, options={"num_warps": target.num_warps})
        if arch.startswith("gfx"):
            out.append(amd_resources(name, arch, width, target.num_warps, compiled))
        else:
            out.append(cuda_resources(name, width, target.num_warps, compiled))
    return out
