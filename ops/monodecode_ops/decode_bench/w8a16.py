"""A split-K W8A16 GEMM for a few rows: the FP8 stock bar where inductor does not fuse the dequant.

With more than one row, inductor's ``F.linear(x, w_e4m3.to(bf16)) * s`` widens every weight to
bf16 in memory first (three bytes moved per weight instead of one). This Triton kernel reads the
e4m3 weights once: program (n, s) takes ``BN`` output channels and the ``s``-th of ``split`` slices
of K, widens each ``[BK, BN]`` weight tile in registers and accumulates ``x @ w`` in fp32
(``tl.dot``, the rows padded to 16), and writes its partial sums. The partials are summed and
scaled by the caller (inside the compiled layer: one fused kernel). The split is chosen so that
about four programs per SM stream the weights. It is a plain kernel, not tuned per shape.

``w8a16_linear`` is a ``torch.library`` op (opaque to inductor: the fullgraph compile keeps it
whole).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from monodecode.kernels.triton.gemv import mma  # bf16 tl.dot (fp32 operands under the interpreter)

BM, BN, BK = 16, 64, 128
PROGRAMS_PER_SM = 4


@triton.jit
def w8a16_partials_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, k_per_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):
    """``out[s, m, n] = sum over k in slice s of x[m, k] * w[n, k]`` (fp32)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = pid_s * k_per_split
    for i in tl.range(0, k_per_split // BK):
        rk = k_lo + i * BK + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc = mma(x, w.to(tl.bfloat16), acc)
    out = out_ptr + pid_s * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def split_for(n: int, k: int, programs: int) -> tuple[int, int]:
    """(number of K slices, K per slice): about ``programs`` programs in all, each slice a
    multiple of ``BK`` and at least four tiles long."""
    tiles_n = -(-n // BN)
    tiles_k = -(-k // BK)
    split = max(1, min(-(-programs // tiles_n), tiles_k // 4))
    per = -(-tiles_k // split) * BK
    return -(-k // per), per


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter (CPU tests): a few slices, to exercise the split


@torch.library.custom_op("monodecode_bench::w8a16_partials", mutates_args=())
def w8a16_partials(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Split-K partial sums ``[split, rows, out]`` (fp32) of ``x[rows, in] @ w[out, in].T`` for
    bf16 ``x`` (rows <= 16) and e4m3 ``w``."""
    m, k = x.shape
    n = w.shape[0]
    if m > BM:
        raise ValueError(f"w8a16_partials takes at most {BM} rows, got {m}")
    split, per = split_for(n, k, _programs(x.device))
    out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    w8a16_partials_kernel[(-(-n // BN), split)](
        x.contiguous(), w, out, m, n, k, per, BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=4
    )
    return out


@w8a16_partials.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    split, _ = split_for(w.shape[0], x.shape[1], _programs(x.device))
    return x.new_empty((split, x.shape[0], w.shape[0]), dtype=torch.float32)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """bf16 ``F.linear``, or W8A16 through the split-K kernel: partials summed, times the
    per-output-channel scale, rounded once."""
    if scale is None:
        return torch.nn.functional.linear(x, weight)
    return (w8a16_partials(x, weight).sum(0) * scale).to(x.dtype)
