"""What gets compiled: the typed ``ASTSource`` of K1 and K2 for one width.

The GPU launcher compiles these, and the CPU compile checks compile the same sources for HIP and
CUDA targets: same constants, same argument order (``args.py``).
"""

from __future__ import annotations

import torch

from monodecode.kernels.plan import ModelPlan
from monodecode.kernels.triton.args import KV_STRIDE_ARGS, _Layer, k1_args, k2_args, ka_args, kv_strides
from monodecode.kernels.triton.config import Target, constexprs
from monodecode.model.dims import ModelDims
from monodecode.model.weights import TORCH_DTYPES

POINTER_TYPES = {  # a tensor argument's dtype -> Triton's pointer type
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e4m3fnuz: "*fp8e4b8",
}


def _meta_layer(dims: ModelDims, weight_dtype: str):
    wdt = TORCH_DTYPES[weight_dtype]

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
            sig[name] = POINTER_TYPES[v.dtype]
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
    dims: ModelDims,
    weight_dtype: str,
    width: int,
    block_size: int,
    mplan: ModelPlan,
    target: Target,
    prof: bool = False,
) -> list[tuple[str, object]]:
    """[(name, ASTSource)] of K1 and K2 (and KA, the attention launch, where the target has one)
    for one width: what the launcher compiles on a GPU and the compile checks compile on a CPU
    (same constants, same argument order)."""
    from triton.compiler import ASTSource

    from monodecode.kernels.triton.k1 import k1_kernel
    from monodecode.kernels.triton.k2 import k2_kernel

    consts = constexprs(dims, mplan, width, target, block_size, weight_dtype != "bf16", prof=prof)
    c1, c2 = consts[:2]
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
        scratch,
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
        scratch,
        health,
        0,
        1000,
        0,
        dims,
    )
    kernels = [("k1", k1_kernel, a1, c1), ("k2", k2_kernel, a2, c2)]
    if len(consts) > 2:  # the attention launch (``config.attn_launch``)
        from monodecode.kernels.triton.ka import ka_kernel

        ka = consts[2]
        part = torch.empty(16, dtype=torch.float32, device="meta")
        arrive = torch.empty(16, dtype=torch.int32, device="meta")
        a3 = ka_args(L, kv, kv, kv_strides(kv, kv, dims, block_size), _MetaMeta(width), bf(width, dims.q_size),
                     scratch, health, part, arrive, 0, 1000, dims)  # fmt: skip
        kernels.append(("ka", ka_kernel, a3, ka))
    out = []
    for name, fn, args, kc in kernels:
        sig, attrs = _signature(fn, args, kc)
        out.append((name, ASTSource(fn, sig, constexprs=dict(kc), attrs=attrs)))
    return out
