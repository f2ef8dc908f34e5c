"""Device-side building blocks shared by the FlyDSL stages (FlyDSL 0.5, wave64, CDNA3/CDNA4):
scalars and bf16 packing, math, plain global loads/stores, LDS, wave and block reductions.

Imported only while tracing a kernel (it imports FlyDSL). Each helper emits IR when called
inside a ``@flyc.kernel`` body; helpers with data-dependent control flow go through FlyDSL's AST
rewriter (``device``) exactly like a kernel body does. The hand-off protocol lives in
``mailbox.py``, the GEMV core (weight loads, dot products, MFMA tiles) in ``gemv.py``.
"""

from __future__ import annotations

import flydsl.expr as fx
from flydsl.compiler.ast_rewriter import ASTRewriter
from flydsl.expr import rocdl

LOG2E = 1.4426950408889634


def device(f):
    """Rewrite Python ``if``/``for``/``while`` on traced values into scf ops, as @flyc.kernel does."""
    return ASTRewriter.transform(f)


# ---------------------------------------------------------------- scalars and bf16 packing
def i32(v):
    return fx.Int32(v)


def f32(v):
    return fx.Float32(v)


def uniform(v):
    """A value every lane holds the same, moved to a scalar register."""
    return fx.Int32(rocdl.readfirstlane(fx.Int32.ir_type, fx.Int32(v).ir_value()))


def bf16_lo(word):
    """Low bf16 of a packed 32-bit word as fp32 (exact)."""
    return (fx.Int32(word) << 16).bitcast(fx.Float32)


def bf16_hi(word):
    return (fx.Int32(word) & fx.Int32(-65536)).bitcast(fx.Float32)


def bf16_half(word, odd):
    """Element ``odd`` (0 or 1, traced) of a bf16 pair."""
    return (odd == fx.Int32(0)).select(bf16_lo(word), bf16_hi(word))


def bf16_bits(x):
    """fp32 -> bf16 bits, round to nearest even (what torch's .to(bfloat16) does for finite values)."""
    b = fx.Float32(x).bitcast(fx.Int32)
    return ((b + fx.Int32(0x7FFF) + ((b >> 16) & fx.Int32(1))) >> 16) & fx.Int32(0xFFFF)


def round_bf16(x):
    """fp32 rounded to the nearest bf16, kept in fp32: the HF rounding points of the reference."""
    return (fx.Int32(bf16_bits(x)) << 16).bitcast(fx.Float32)


def pack_bf16x2(lo, hi):
    return bf16_bits(lo) | (bf16_bits(hi) << 16)


def is_nonfinite(x):
    return (fx.Float32(x).bitcast(fx.Int32) & fx.Int32(0x7F800000)) == fx.Int32(0x7F800000)


def exp2(x):
    return fx.Float32(rocdl.exp2(fx.Float32.ir_type, fx.Float32(x).ir_value()))


def exp(x):
    return exp2(x * fx.Float32(LOG2E))


def silu(x):
    return x / (fx.Float32(1.0) + exp(fx.Float32(0.0) - x))


def gelu_tanh(x):
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), tanh(u) = 1 - 2 / (e^{2u} + 1)
    u = fx.Float32(0.7978845608028654) * (x + fx.Float32(0.044715) * x * x * x)
    t = fx.Float32(1.0) - fx.Float32(2.0) / (exp(fx.Float32(2.0) * u) + fx.Float32(1.0))
    return fx.Float32(0.5) * x * (fx.Float32(1.0) + t)


def rsqrt_mean(ss, n: int, eps: float):
    """RMSNorm's 1 / sqrt(mean(x^2) + eps) from a sum of squares over ``n`` elements."""
    return fx.math.rsqrt(ss / fx.Float32(float(n)) + fx.Float32(eps))


def norm_scale(one_plus: bool):
    """Gemma multiplies by (1 + w) in fp32; Llama/Qwen by w after rounding x*rstd to bf16."""
    if one_plus:
        return lambda xv, rstd, w: round_bf16(xv * rstd * (fx.Float32(1.0) + w))
    return lambda xv, rstd, w: round_bf16(w * round_bf16(xv * rstd))


def warp_sum(x):
    return fx.coop.warp_sum(x)


def warp_max(x):
    return fx.coop.warp_max(x)


def lane_pick(lane, values):
    """values[lane] for lane < len(values) (wave-uniform inputs -> one value per lane)."""
    out = values[0]
    for t in range(1, len(values)):
        out = (lane == fx.Int32(t)).select(values[t], out)
    return out


def load_word(ptr, idx):
    return fx.generic_load(ptr + idx, dtype=fx.Int32)


def load_words(ptr, idx, n):
    return fx.generic_load(ptr + idx, dtype=fx.Int32, count=n)


def load_f32(ptr, idx):
    return fx.generic_load(ptr + idx, dtype=fx.Float32)


def store_bf16(ptr16, idx, x):
    """One bf16 result through a 16-bit element pointer (the kernel outputs are bf16 tensors)."""
    fx.generic_store(ptr16 + idx, fx.Int16(bf16_bits(x)))


def store_word(ptr, idx, v):
    fx.generic_store(ptr + idx, fx.Int32(v))


# ---------------------------------------------------------------- LDS
def lds_arena(alloc, words: int):
    """The kernel's one static LDS array of 32-bit words (16-byte aligned for ds_read_b128)."""
    return alloc.allocate(fx.Array[fx.Int32, max(words, 4), 16]).peek().ptr


def lds_load(p, idx):
    return fx.generic_load(p + idx, dtype=fx.Int32)


def lds_load4(p, idx):
    return fx.generic_load(p + idx, dtype=fx.Int32, count=4)


def lds_store(p, idx, v):
    fx.generic_store(p + idx, fx.Int32(v))


def lds_store64(p, idx, v):
    """A 64-bit value into words ``idx``, ``idx + 1`` (8-byte aligned)."""
    fx.generic_store(p + idx, fx.Int64(v))


def lds_load64(p, idx):
    return fx.generic_load(p + idx, dtype=fx.Int64)


def lds_loadf(p, idx):
    return fx.Int32(fx.generic_load(p + idx, dtype=fx.Int32)).bitcast(fx.Float32)


def lds_storef(p, idx, v):
    fx.generic_store(p + idx, fx.Float32(v).bitcast(fx.Int32))


@device
def block_sum(v, lds, red: int, wave, lane, waves: int):
    """Sum of ``v`` over the whole workgroup (every thread calls it; two barriers)."""
    s = warp_sum(v)
    if lane == fx.Int32(0):
        lds_storef(lds, red + wave, s)
    fx.gpu.barrier()
    tot = lds_loadf(lds, red)
    for w in fx.range_constexpr(1, waves):
        tot = tot + lds_loadf(lds, red + w)
    fx.gpu.barrier()
    return tot
