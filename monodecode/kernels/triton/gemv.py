"""One GEMV task of a persistent stage: rows ``[n0, n0+BN)`` of ``y[W, N] = x[W, K] @ Wt[N, K]^T``.

Width 1 uses a 2-D FMA tile (``acc[BN, BK] += w * x``, one row reduction at the end); wider steps
use matrix instructions on ``dot(w[BN, BK], x[WP, BK]^T)`` with the rows padded to ``WP >= 16``
(masked rows read nothing). The K loop is software-pipelined (``tl.range(num_stages=...)``).

The input vector comes from one of three places (``SRC``):
  0  the launch input (bf16) with the pre-norm fused in (RMSNorm with the row's rstd),
  1  the launch input (bf16) as is,
  2  tagged mailbox words (fp32 | tag). Before its first task of the stage a program waits for
     the producing stage's completion counter (``mailbox.wait_done``); the K loop then streams
     the words with ``.cg`` loads (L2, never a stale L1 line) and checks every tag on the way (a
     mismatch is recorded in the health word; it is never waited on).
  3  a bf16 mailbox region (after the same wait), streamed with ``.cg`` loads: plain bf16
     tiles, a quarter of the tagged words' bytes and no unpacking.
  4  the launch input (bf16) times the pre-norm's weight, with the row's rstd applied to the
     result instead (``Target.deferred_rstd``): rstd is one number per row, so the weights stream
     from the task's first instruction instead of after a pass over the row; its sum of squares
     accumulates from the same chunks. The normalised input is then rounded to bf16 once
     (``bf16(g * x)``), not twice as HF does (``rms_apply``).
  5  a bf16 mailbox region (as 3) with the pre-norm deferred as in 4 (K2's gate/up reading h when
     no post stage normalises it: ``Target.fused_post``).

FP8 weights (e4m3, per-output-channel fp32 scale) are widened in registers; the scale is
applied to the fp32 result, as ``Linear.__call__`` does. At widths > 1 with ``FP8_PAIR`` they are
not widened at all: each input chunk is split into two FP8 tiles that represent it exactly
(``fp8_pair``) and both go through FP8 matrix instructions with the weights as they are.
"""

import os

import triton
import triton.language as tl

from monodecode.kernels.triton.mailbox import unpack

# Triton's CPU interpreter multiplies bf16 dot operands as raw bits; it gets fp32 operands
# (exact for bf16 values) instead.
INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def mma(a, b, acc):
    """acc + a @ b with bf16 operands and fp32 accumulation (matrix instructions when compiled)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)


@triton.jit
def fp8_pair(xb):
    """bf16 ``xb[WP, BK]`` as ``(hi + lo / 16) * inv[:, None]``, with hi and lo exact in e4m3.

    Each row is scaled by a power of two that puts its largest magnitude in [128, 256) (exact),
    hi keeps the top 4 significant bits (a mask: truncation, so |hi| <= 240 < 448) and lo the
    rest, times 16 (a bf16 value has 8 significant bits, so the rest has at most 4 and
    ``|lo| < 256``). Only elements below e4m3's smallest normal (2^-6 after scaling, about
    6e-5 of the row's largest) lose bits. Rows of zeros keep scale 1."""
    xf = xb.to(tl.float32)
    ebits = (tl.max(tl.abs(xf), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    ok = ebits >= 8
    scale = tl.where(ok, ((261 - ebits) << 23).to(tl.float32, bitcast=True), 1.0)  # 2^(7 - e)
    inv = tl.where(ok, ((ebits - 7) << 23).to(tl.float32, bitcast=True), 1.0)
    v = xf * scale[:, None]
    hi = (v.to(tl.int32, bitcast=True) & -1048576).to(tl.float32, bitcast=True)  # sign, exponent, 3 bits
    lo = (v - hi) * 16.0
    return hi, lo, inv


@triton.jit
def mma_fp8_pair(w, xb):
    """``w[BN, BK] @ xb[WP, BK]^T`` in fp32 for e4m3 ``w`` without widening it: two FP8 matrix
    products over ``fp8_pair(xb)``, each chunk's products summed from zero (Hopper's FP8
    accumulator keeps fewer bits than fp32, so it never carries the running total)."""
    hi, lo, inv = fp8_pair(xb)
    if INTERPRET:
        wf = w.to(tl.float32)
        part = tl.dot(wf, tl.trans(hi)) + tl.dot(wf, tl.trans(lo)) * 0.0625
    else:
        part = tl.dot(w, tl.trans(hi.to(tl.float8e4nv))) + tl.dot(w, tl.trans(lo.to(tl.float8e4nv))) * 0.0625
    return part * inv[None, :]


@triton.jit
def rms_apply(xf, rstd, g, ONE_PLUS: tl.constexpr):
    """RMSNorm of fp32 ``xf`` given its rstd and the raw weight ``g`` (fp32), rounded like HF:
    Gemma ``bf16(x_hat * (1 + g))``; Llama/Qwen3 ``bf16(g * bf16(x_hat))``."""
    xhat = xf * rstd
    if ONE_PLUS:
        y = xhat * (1.0 + g)
    else:
        y = g * xhat.to(tl.bfloat16).to(tl.float32)
    return y.to(tl.bfloat16)


@triton.jit
def _input_chunk(
    x_ptr,
    x_stride,
    kk,
    rows,
    rmask,
    norm_ptr,
    rstd,
    tag,
    bad,
    ss,
    BK: tl.constexpr,
    SRC: tl.constexpr,
    ONE_PLUS: tl.constexpr,
    K: tl.constexpr,
):
    k = kk * BK + tl.arange(0, BK)
    ptrs = x_ptr + rows[:, None] * x_stride + k[None, :]
    if K % BK == 0:
        m2 = rmask[:, None] & (k[None, :] >= 0)
    else:  # the last chunk runs past K (``Target.narrow_tail``)
        m2 = rmask[:, None] & (k[None, :] < K)
    if SRC == 2:
        words = tl.load(ptrs, mask=m2, other=0, cache_modifier=".cg")
        bad += (m2 & ((words >> 32) != tag)).to(tl.int32)
        xb = unpack(words).to(tl.bfloat16)
    elif SRC == 3:
        xb = tl.load(ptrs, mask=m2, other=0.0, cache_modifier=".cg").to(tl.bfloat16)
    elif SRC == 0 or SRC == 4 or SRC == 5:  # the pre-norm fused in
        if SRC == 5:
            xf = tl.load(ptrs, mask=m2, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            xf = tl.load(ptrs, mask=m2, other=0.0).to(tl.float32)
        # The norm weight is loaded once per live row, in the input's [WP, BK] shape: as a 1-D
        # [256] vector over 8 warps it got 2 bytes per thread, below cp.async's 4, so Triton
        # did not pipeline it and each K chunk waited one L2 round trip for it.
        g = tl.load(norm_ptr + rows[:, None] * 0 + k[None, :], mask=m2, other=0.0).to(tl.float32)
        if SRC == 0:
            xb = rms_apply(xf, rstd[:, None], g, ONE_PLUS)
        else:  # rstd comes after the loop, from these squares
            ss += xf * xf
            if ONE_PLUS:
                xb = (xf * (1.0 + g)).to(tl.bfloat16)
            else:
                xb = (xf * g).to(tl.bfloat16)
    else:
        xb = tl.load(ptrs, mask=m2, other=0.0).to(tl.bfloat16)
    return xb, bad, ss


@triton.jit
def _mac(acc, w, xb, DOT: tl.constexpr, FP8_PAIR: tl.constexpr):
    if DOT and FP8_PAIR:
        acc += mma_fp8_pair(w, xb)
    elif DOT:
        acc = mma(w, tl.trans(xb), acc)
    else:
        acc += w.to(tl.float32) * xb.to(tl.float32)
    return acc


@triton.jit
def task_rows(n0, N, BN: tl.constexpr, ROWS: tl.constexpr):
    """Output rows of a task's ``BN``-row tile and the ones it owns: below ``N`` and, when the
    plan cut the task narrower than its tile (``plan.even_wave_rows``), among its first ``ROWS``
    (the rest belong to the next task: never loaded, never stored)."""
    n = n0 + tl.arange(0, BN)
    own = n < N
    if 0 < ROWS and ROWS < BN:
        own = own & (tl.arange(0, BN) < ROWS)
    return n, own


@triton.jit
def row_rstd(
    x_ptr, x_stride, rows, rmask, eps, K: tl.constexpr, BK: tl.constexpr, WP: tl.constexpr, NUM_STAGES: tl.constexpr
):
    """1/sqrt(mean(x^2) + eps) of each row of the bf16 launch input (loads pipelined, so the
    chunks do not cost one memory round trip each)."""
    ss = tl.zeros([WP], dtype=tl.float32)
    for kk in tl.range(0, (K + BK - 1) // BK, num_stages=NUM_STAGES):
        k = kk * BK + tl.arange(0, BK)
        m = rmask[:, None] & (k[None, :] < K)
        xf = tl.load(x_ptr + rows[:, None] * x_stride + k[None, :], mask=m, other=0.0).to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    return 1.0 / tl.sqrt_rn(ss / K + eps)


@triton.jit
def gemv_task(
    w1_ptr,
    s1_ptr,
    w2_ptr,
    s2_ptr,
    n0,
    N,
    x_ptr,
    x_stride,
    norm_ptr,
    rstd,
    eps,
    tag,
    health_ptr,
    bad_code,
    K: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SRC: tl.constexpr,
    TWO: tl.constexpr,
    FP8: tl.constexpr,
    ONE_PLUS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SPLIT: tl.constexpr = 1,
    FP8_PAIR: tl.constexpr = False,
    W_STRIDE: tl.constexpr = 0,
    ROWS: tl.constexpr = 0,
):
    """Returns (y1[BN, WP], y2[BN, WP]); y2 is y1 when ``TWO`` is off. Each pipelined iteration
    loads ``SPLIT`` consecutive K chunks (more bytes in flight per iteration, e.g. 1-byte FP8
    weights, with the accumulator still one chunk wide). ``FP8_PAIR``: FP8 weights at widths
    > 1 go through ``mma_fp8_pair``. ``W_STRIDE``: the weights' row stride when the task reduces
    over one K slice of the rows (split-K; the pointers then start at the slice); 0: ``K``.
    ``ROWS``: the rows of the tile the task owns (``task_rows``; 0: all ``BN``)."""
    DOT: tl.constexpr = WP > 1
    NK: tl.constexpr = (K + BK * SPLIT - 1) // (BK * SPLIT)  # a partial last chunk is masked
    n, nmask = task_rows(n0, N, BN, ROWS)
    rows = tl.arange(0, WP)
    rmask = rows < W
    kcol = tl.arange(0, BK)
    ROW: tl.constexpr = W_STRIDE if W_STRIDE else K
    wp1 = w1_ptr + n[:, None].to(tl.int64) * ROW + kcol[None, :]
    wp2 = w2_ptr + n[:, None].to(tl.int64) * ROW + kcol[None, :]
    if DOT:
        acc1 = tl.zeros([BN, WP], dtype=tl.float32)
        acc2 = tl.zeros([BN, WP], dtype=tl.float32)
    else:
        acc1 = tl.zeros([BN, BK], dtype=tl.float32)
        acc2 = tl.zeros([BN, BK], dtype=tl.float32)
    bad = tl.zeros([WP, BK], dtype=tl.int32)
    ss = tl.zeros([WP, BK], dtype=tl.float32)  # SRC 4, 5: the input's squares, reduced after the loop
    for kk in tl.range(0, NK, num_stages=NUM_STAGES):
        for sp in tl.static_range(SPLIT):
            kc = kk * SPLIT + sp
            if K % BK == 0:
                wmask = nmask[:, None]
            else:
                wmask = nmask[:, None] & (kc * BK + kcol < K)[None, :]
            w1 = tl.load(wp1 + kc * BK, mask=wmask, other=0.0)
            if TWO:
                w2 = tl.load(wp2 + kc * BK, mask=wmask, other=0.0)
            xb, bad, ss = _input_chunk(
                x_ptr, x_stride, kc, rows, rmask, norm_ptr, rstd, tag, bad, ss, BK, SRC, ONE_PLUS, K
            )
            acc1 = _mac(acc1, w1, xb, DOT, FP8_PAIR)
            if TWO:
                acc2 = _mac(acc2, w2, xb, DOT, FP8_PAIR)
    if SRC == 2:  # every word must carry this launch's tag (the stage waited for its producers)
        if tl.sum(tl.ravel(bad), axis=0) > 0:
            tl.atomic_cas(health_ptr, 0, bad_code)
    if DOT:
        y1 = acc1
        y2 = acc2
    else:
        y1 = tl.sum(acc1, axis=1)[:, None]
        y2 = tl.sum(acc2, axis=1)[:, None]
    if SRC == 4 or SRC == 5:  # the pre-norm's rstd, as ``row_rstd`` computes it
        r = 1.0 / tl.sqrt_rn(tl.sum(ss, axis=1) / K + eps)
        y1 = y1 * r[None, :]
        y2 = y2 * r[None, :]
    if FP8:
        y1 = y1 * tl.load(s1_ptr + n, mask=nmask, other=0.0)[:, None]
        if TWO:
            y2 = y2 * tl.load(s2_ptr + n, mask=nmask, other=0.0)[:, None]
    if not TWO:
        y2 = y1
    return y1, y2
