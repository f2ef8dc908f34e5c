"""Device-side building blocks shared by K1 and K2 (FlyDSL 0.5, wave64, CDNA3/CDNA4).

Imported only while tracing a kernel (it imports FlyDSL). Each helper is a plain function that
emits IR when called inside a ``@flyc.kernel`` body; helpers with data-dependent control flow go
through FlyDSL's AST rewriter (``device``) exactly like a kernel body does.

Memory conventions (see flydsl_notes.md §2 for the ISA each one compiles to):

* weights: ``buffer_load_dwordx4 ... nt`` (read once per step, streamed past the caches);
* mailboxes: relaxed agent-scope atomic 32-bit loads/stores (``global_load/store ... sc1``), one
  word = ``tag16 << 16 | bf16`` so a value and its epoch tag are single-copy atomic;
* the epoch word: acquire load at launch start; the last workgroup to finish (done counter)
  resets the counter and publishes ``epoch + 1`` with a release store.
"""

from __future__ import annotations

import flydsl.expr as fx
from flydsl.compiler.ast_rewriter import ASTRewriter
from flydsl.expr import rocdl
from flydsl.expr.typing import Vector

LOG2E = 1.4426950408889634
NEG_BIG = -1.0e30  # finite "minus infinity": keeps (m_old - m_new) free of inf - inf


def device(f):
    """Rewrite Python ``if``/``for``/``while`` on traced values into scf ops, as @flyc.kernel does."""
    return ASTRewriter.transform(f)


# ---------------------------------------------------------------- scalars and bf16 packing
def i32(v):
    return fx.Int32(v)


def f32(v):
    return fx.Float32(v)


def bf16_lo(word):
    """Low bf16 of a packed 32-bit word as fp32 (exact)."""
    return (fx.Int32(word) << 16).bitcast(fx.Float32)


def bf16_hi(word):
    return (fx.Int32(word) & fx.Int32(-65536)).bitcast(fx.Float32)


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


def warp_sum(x):
    return fx.coop.warp_sum(x)


def warp_max(x):
    return fx.coop.warp_max(x)


# ---------------------------------------------------------------- global memory
def buffer_rsrc(ptr):
    return rocdl.get_buffer_rsrc(rocdl.make_buffer_ptr(ptr))


CM_NT = 2  # streamed weights: nontemporal


def load_weights16(rsrc, byte_off):
    """16 bytes of weights (8 bf16 or 16 fp8) per lane, streamed (nt)."""
    v = rocdl.raw_ptr_buffer_load(
        Vector.make_type(4, fx.Int32), rsrc, fx.Int32(byte_off).ir_value(), fx.Int32(0).ir_value(), aux=CM_NT
    )
    return Vector(v, (4,), fx.Int32)


def load_word(ptr, idx):
    return fx.generic_load(ptr + idx, dtype=fx.Int32)


def load_words(ptr, idx, n):
    return fx.generic_load(ptr + idx, dtype=fx.Int32, count=n)


def store_bf16(ptr16, idx, x):
    """One bf16 result through a 16-bit element pointer (the kernel outputs are bf16 tensors)."""
    fx.generic_store(ptr16 + idx, fx.Int16(bf16_bits(x)))


def store_word(ptr, idx, v):
    fx.generic_store(ptr + idx, fx.Int32(v))


def mb_load(ptr, idx):
    """Relaxed agent-scope load of one mailbox word (coherent across XCDs)."""
    return fx.generic_load(ptr + idx, dtype=fx.Int32, memory_order=fx.AtomicOrdering.Monotonic, syncscope="agent")


def mb_put(ptr, idx, tag, x):
    """Publish bf16(x) with this launch's tag in one 32-bit word."""
    word = bf16_bits(x) | (tag << 16)
    fx.generic_store(ptr + idx, word, memory_order=fx.AtomicOrdering.Monotonic, syncscope="agent")


def health_ok(health):
    h = fx.generic_load(health, dtype=fx.Int32, memory_order=fx.AtomicOrdering.Monotonic, syncscope="agent")
    return h == fx.Int32(0)


def raise_health(health, code):
    """Record the first failure only: the word keeps the code of the earliest site (sticky)."""
    fx.atomic_cas(health, fx.Int32(0), fx.Int32(code), syncscope="agent")


def health_code(site: int, kernel: int, layer):
    """On-device twin of ``monodecode.kernels.base.health_code``: bits 0-7 site, 8-9 kernel
    (1 = k1, 2 = k2), 10-29 layer + 1."""
    return fx.Int32(site | (kernel << 8)) | ((fx.Int32(layer) + fx.Int32(1)) << 10)


@device
def mb_wait(ptr, idx, tag, budget, health, site):
    """Bounded wait for a mailbox word carrying ``tag``; returns its value as fp32.

    ``budget`` polls at most (each ``s_sleep 1`` apart). On expiry the health word gets ``site``
    (sticky) and the stale value is used: the step is already failed and the runner's check before
    logits stops it. Callers pass budget 0 once the health word is set, so a stall costs one
    timeout per workgroup, not one per word.
    """
    w = mb_load(ptr, idx)
    n = fx.Int32(0)
    while (((w >> 16) & fx.Int32(0xFFFF)) != tag) & (n < budget):
        rocdl.s_sleep(1)
        w = mb_load(ptr, idx)
        n = n + fx.Int32(1)
    if ((w >> 16) & fx.Int32(0xFFFF)) != tag:
        raise_health(health, site)
    return bf16_lo(w)


# ---------------------------------------------------------------- launch epoch
def launch_tag(scratch):
    """Tag of this launch: (epoch + 1) mod 2^16, read with acquire at agent scope."""
    epoch = fx.generic_load(scratch, dtype=fx.Int32, memory_order=fx.AtomicOrdering.Acquire, syncscope="agent")
    return epoch, (epoch + fx.Int32(1)) & fx.Int32(0xFFFF)


@device
def finish_launch(scratch, epoch, tid, grid):
    """Advance the width's epoch once every workgroup is done (device-side; graph-safe)."""
    fx.memory_fence(syncscope="agent", ordering=fx.AtomicOrdering.Release)
    fx.gpu.barrier()
    if tid == fx.Int32(0):
        old = fx.atomic_add(scratch + 1, fx.Int32(1), syncscope="agent", ordering=fx.AtomicOrdering.AcqRel)
        if old == fx.Int32(grid - 1):
            fx.generic_store(scratch + 1, fx.Int32(0), memory_order=fx.AtomicOrdering.Monotonic, syncscope="agent")
            fx.generic_store(scratch, epoch + fx.Int32(1), memory_order=fx.AtomicOrdering.Release,
                             syncscope="agent")


# ---------------------------------------------------------------- LDS
def lds_words(alloc, n):
    """A static LDS array of ``n`` 32-bit words (16-byte aligned for ds_read_b128)."""
    return alloc.allocate(fx.Array[fx.Int32, n, 16]).peek().ptr


def lds_load(p, idx):
    return fx.generic_load(p + idx, dtype=fx.Int32)


def lds_load4(p, idx):
    return fx.generic_load(p + idx, dtype=fx.Int32, count=4)


def lds_store(p, idx, v):
    fx.generic_store(p + idx, fx.Int32(v))


def lds_loadf(p, idx):
    return fx.Int32(fx.generic_load(p + idx, dtype=fx.Int32)).bitcast(fx.Float32)


def lds_storef(p, idx, v):
    fx.generic_store(p + idx, fx.Float32(v).bitcast(fx.Int32))


# ---------------------------------------------------------------- GEMV core
def dot_bf16(wv, xv, acc):
    """acc += 8 bf16 weights (4 words) . 8 bf16 activations (4 words)."""
    for j in fx.range_constexpr(4):
        acc = fx.math.fma(bf16_lo(wv[j]), bf16_lo(xv[j]), acc)
        acc = fx.math.fma(bf16_hi(wv[j]), bf16_hi(xv[j]), acc)
    return acc


def dot_fp8(wv, xa, xb, acc):
    """acc += 16 fp8 weights (4 words, format decoded by the hardware: FNUZ on gfx942, OCP on
    gfx950) . 16 bf16 activations (8 words)."""
    v2 = Vector.make_type(2, fx.Float32)
    for j in fx.range_constexpr(4):
        lo = Vector(rocdl.cvt_pk_f32_fp8(v2, wv[j].ir_value(), False), (2,), fx.Float32)
        hi = Vector(rocdl.cvt_pk_f32_fp8(v2, wv[j].ir_value(), True), (2,), fx.Float32)
        # weight word j holds fp8 weights 4j..4j+3; activations 4j..4j+3 are words 2j, 2j+1
        w_idx = 2 * j
        x0 = (xa if w_idx < 4 else xb)[w_idx % 4]
        x1 = (xa if w_idx + 1 < 4 else xb)[(w_idx + 1) % 4]
        acc = fx.math.fma(lo[0], bf16_lo(x0), acc)
        acc = fx.math.fma(lo[1], bf16_hi(x0), acc)
        acc = fx.math.fma(hi[0], bf16_lo(x1), acc)
        acc = fx.math.fma(hi[1], bf16_hi(x1), acc)
    return acc
