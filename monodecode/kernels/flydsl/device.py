"""Device-side building blocks shared by K1 and K2 (FlyDSL 0.5, wave64, CDNA3/CDNA4).

Imported only while tracing a kernel (it imports FlyDSL). Each helper emits IR when called
inside a ``@flyc.kernel`` body; helpers with data-dependent control flow go through FlyDSL's AST
rewriter (``device``) exactly like a kernel body does.

The hand-off protocol is the plan's (``monodecode/kernels/plan.py``), the same the Triton
backend implements (``kernels/triton/mailbox.py``):

* a mailbox word is 8 bytes: the fp32 value's bits in the low half, the launch's 31-bit epoch
  tag in the high half, written with ONE relaxed agent-scope 64-bit store
  (``global_store_dwordx2 ... sc1``), so a reader that sees the tag sees the value;
* readers load words with relaxed agent-scope 64-bit loads (``global_load_dwordx2 ... sc1``,
  coherent across XCDs) and poll, ``s_sleep 1`` apart, until the tag matches; a word of an
  earlier launch carries an older tag, so nothing is ever zeroed between steps;
* the tag is derived on device from the width's int64 launch counter (the plan's ``epoch_k1`` /
  ``epoch_k2`` regions): every workgroup adds 1 when it leaves, so during launch ``n`` the
  counter reads in ``[n*G, n*G + G - 1]`` before this workgroup's own add and
  ``counter // G + 1`` is the same in every workgroup (graph-safe, no host involvement);
* waits are bounded (``max_polls`` polls); on expiry the sticky health word gets the site code
  (compare-and-swap from 0: the first failure wins) and the kernel carries on with the stale
  value, so the launch always terminates and the runner's check before logits stops the step.

Weights stream through ``buffer_load_dwordx4 ... nt`` (read once per step, past the caches).
"""

from __future__ import annotations

import flydsl.expr as fx
from flydsl.compiler.ast_rewriter import ASTRewriter
from flydsl.expr import rocdl
from flydsl.expr.primitive import range_constexpr
from flydsl.expr.typing import Vector

from monodecode.kernels.flydsl.geometry import health_word

LOG2E = 1.4426950408889634
TAG_MASK = 0x7FFFFFFF
HEALTH_POLL_EVERY = 64  # a failing wait re-reads the health word this often (stops early after a failure)


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


# ---------------------------------------------------------------- global memory
def buffer_rsrc(ptr):
    return rocdl.get_buffer_rsrc(rocdl.make_buffer_ptr(ptr))


CM_NT = 2  # streamed weights: nontemporal (flydsl_notes.md section 2: aux 2 -> nt)


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


def load_f32(ptr, idx):
    return fx.generic_load(ptr + idx, dtype=fx.Float32)


def store_bf16(ptr16, idx, x):
    """One bf16 result through a 16-bit element pointer (the kernel outputs are bf16 tensors)."""
    fx.generic_store(ptr16 + idx, fx.Int16(bf16_bits(x)))


def store_word(ptr, idx, v):
    fx.generic_store(ptr + idx, fx.Int32(v))


# ---------------------------------------------------------------- tagged mailbox words (8 bytes)
_RELAXED = fx.AtomicOrdering.Monotonic


def mb_load(mbox, idx, scope="agent"):
    """One mailbox word (int64), relaxed: at agent scope coherent across XCDs; ``scope=None``
    (system) for the TP peer buffers that other GPUs write."""
    return fx.generic_load(mbox + idx, dtype=fx.Int64, memory_order=_RELAXED, syncscope=scope)


def mb_tag(word):
    return fx.Int32(word >> fx.Int64(32))


def mb_value(word):
    return fx.Int32(word).bitcast(fx.Float32)


def mb_put(mbox, idx, tag, x, scope="agent"):
    """Publish fp32 ``x`` with this launch's tag in one 8-byte store."""
    bits = fx.Int64(fx.Float32(x).bitcast(fx.Int32)) & fx.Int64(0xFFFFFFFF)
    word = (fx.Int64(tag) << fx.Int64(32)) | bits
    fx.generic_store(mbox + idx, word, memory_order=_RELAXED, syncscope=scope)


def peer_buffer(peers, rank):
    """Rank ``rank``'s peer-buffer segment: ``peers`` holds one 64-bit device address per rank
    (IPC-mapped into this process), in the same pointer type as ``peers``."""
    return fx.inttoptr(peers.type, fx.generic_load(peers + rank, dtype=fx.Int64))


def health_load(health):
    return fx.generic_load(health, dtype=fx.Int32, memory_order=_RELAXED, syncscope="agent")


def health_ok(health):
    return health_load(health) == fx.Int32(0)


def raise_health(health, code):
    """Record the first failure only: the word keeps the code of the earliest site (sticky)."""
    fx.atomic_cas(health, fx.Int32(0), fx.Int32(code), syncscope="agent")


def health_code(site: int, kernel: int, layer):
    """``geometry.health_word`` on the traced layer: bits 0-7 site, 8-9 kernel (1 = k1, 2 = k2),
    10-29 layer + 1."""
    return fx.Int32(health_word(site, kernel, fx.Int32(layer)))


@device
def mb_wait(mbox, idx, tag, polls, health, code, scope="agent"):
    """Bounded wait for the word at ``idx`` to carry ``tag``; returns its fp32 value.

    The fast path is one load. On a miss the word is re-read ``s_sleep 1`` apart, at most
    ``polls`` times; every HEALTH_POLL_EVERY polls the health word is checked so that, once any
    wait of the step has failed, the others give up quickly instead of each burning a timeout.
    """
    w = mb_load(mbox, idx, scope)
    n = fx.Int32(0)
    while (mb_tag(w) != tag) & (n < polls):
        rocdl.s_sleep(1)
        w = mb_load(mbox, idx, scope)
        n = n + fx.Int32(1)
        if (n & fx.Int32(HEALTH_POLL_EVERY - 1)) == fx.Int32(0):
            if health_load(health) != fx.Int32(0):
                n = polls
    if mb_tag(w) != tag:
        raise_health(health, code)
    return mb_value(w)


@device
def mb_wait_all(mbox, idxs, valid, tag, polls, health, code, scope="agent"):
    """fp32 values of several mailbox words (``valid[i]`` False: word i is padding, not waited
    for, its value is garbage). All loads are issued back to back, so one round trip serves them
    all; only when some word is not there yet are the words waited for one by one."""
    words = [mb_load(mbox, i, scope) for i in idxs]
    vals = [mb_value(w) for w in words]
    miss = fx.Int32(0)
    for w, ok in zip(words, valid):
        miss = miss | (ok & (mb_tag(w) != tag)).select(fx.Int32(1), fx.Int32(0))
    if miss != fx.Int32(0):
        for i in range_constexpr(len(idxs)):
            if valid[i]:
                vals[i] = mb_wait(mbox, idxs[i], tag, polls, health, code, scope)
    return vals


# ---------------------------------------------------------------- launch epoch
def launch_tag(epoch, grid: int):
    """This launch's 31-bit tag from the width's launch counter (same in every workgroup)."""
    count = fx.generic_load(epoch, dtype=fx.Int64, memory_order=_RELAXED, syncscope="agent")
    tag = fx.Int32(((count // fx.Int64(grid)) + fx.Int64(1)) & fx.Int64(TAG_MASK))
    return uniform(tag)


@device
def finish_launch(epoch, tid):
    """Count this workgroup out of the launch (once, after every thread has read the tag)."""
    fx.gpu.barrier()
    if tid == fx.Int32(0):
        fx.atomic_add(epoch, fx.Int64(1), syncscope="agent")


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


# ---------------------------------------------------------------- GEMV core
def dot_bf16(wv, xv, acc):
    """acc += 8 bf16 weights (4 words) . 8 bf16 activations (4 words)."""
    for j in range(4):
        acc = fx.math.fma(bf16_lo(wv[j]), bf16_lo(xv[j]), acc)
        acc = fx.math.fma(bf16_hi(wv[j]), bf16_hi(xv[j]), acc)
    return acc


def dot_fp8(wv, xa, xb, acc):
    """acc += 16 fp8 weights (4 words, format decoded by the hardware: FNUZ on gfx942, OCP on
    gfx950) . 16 bf16 activations (8 words)."""
    v2 = Vector.make_type(2, fx.Float32)
    for j in range(4):
        lo = Vector(rocdl.cvt_pk_f32_fp8(v2, wv[j].ir_value(), False), (2,), fx.Float32)
        hi = Vector(rocdl.cvt_pk_f32_fp8(v2, wv[j].ir_value(), True), (2,), fx.Float32)
        # weight word j holds fp8 weights 4j..4j+3; their activations are words 2j, 2j+1
        x0 = (xa if 2 * j < 4 else xb)[(2 * j) % 4]
        x1 = (xa if 2 * j + 1 < 4 else xb)[(2 * j + 1) % 4]
        acc = fx.math.fma(lo[0], bf16_lo(x0), acc)
        acc = fx.math.fma(lo[1], bf16_hi(x0), acc)
        acc = fx.math.fma(hi[0], bf16_lo(x1), acc)
        acc = fx.math.fma(hi[1], bf16_hi(x1), acc)
    return acc


# ---------------------------------------------------------------- MFMA tiles (16 x 16, fp32 accumulators)


def mfma_zero():
    return Vector.filled((4,), 0.0, fx.Float32)


def _bf16_exact(a, b):
    """Two fp32 values that are exactly bf16 (widened fp8) packed as a bf16 pair, no rounding."""
    return ((fx.Float32(a).bitcast(fx.Int32) >> 16) & fx.Int32(0xFFFF)) | (
        fx.Float32(b).bitcast(fx.Int32) & fx.Int32(-65536)
    )


def fp8x16_as_bf16(wv):
    """16 fp8 weights (4 words; FNUZ on gfx942, OCP on gfx950, decoded by the hardware) widened to
    16 bf16 (exact: e4m3 fits bf16) as two 4-word vectors, elements 0-7 and 8-15."""
    v2 = Vector.make_type(2, fx.Float32)
    words = []
    for j in range(4):
        lo = Vector(rocdl.cvt_pk_f32_fp8(v2, wv[j].ir_value(), False), (2,), fx.Float32)
        hi = Vector(rocdl.cvt_pk_f32_fp8(v2, wv[j].ir_value(), True), (2,), fx.Float32)
        words.append(_bf16_exact(lo[0], lo[1]))
        words.append(_bf16_exact(hi[0], hi[1]))
    return Vector.from_elements(words[:4], fx.Int32), Vector.from_elements(words[4:], fx.Int32)


def _mfma8(arch: str, a_words, b_words, acc):
    """acc += A . B over 8 K elements per lane (4 words of bf16 pairs each): one
    ``v_mfma_f32_16x16x32_bf16`` on gfx950, two ``v_mfma_f32_16x16x16_bf16`` on gfx942."""
    v4f = Vector.make_type(4, fx.Float32)
    if arch == "gfx950":
        out = rocdl.mfma_f32_16x16x32_bf16(
            v4f, [a_words.bitcast(fx.BFloat16), b_words.bitcast(fx.BFloat16), acc, 0, 0, 0]
        )
        return Vector(out, (4,), fx.Float32)
    a16, b16 = a_words.bitcast(fx.Int16), b_words.bitcast(fx.Int16)
    for h in (0, 1):
        half = [4 * h, 4 * h + 1, 4 * h + 2, 4 * h + 3]
        out = rocdl.mfma_f32_16x16x16bf16_1k(v4f, [a16.shuffle(a16, half), b16.shuffle(b16, half), acc, 0, 0, 0])
        acc = Vector(out, (4,), fx.Float32)
    return acc


def mfma_tile(arch: str, wv, xa, xb, acc, fp8: bool):
    """One 16-byte weight load per lane into the tile: 8 bf16 (against ``xa``) or 16 fp8 widened
    to bf16 (against ``xa`` then ``xb``). Weights and activations share the lane's K elements, so
    the products pair up exactly as the dot product's terms."""
    if not fp8:
        return _mfma8(arch, wv, xa, acc)
    w_lo, w_hi = fp8x16_as_bf16(wv)
    return _mfma8(arch, w_hi, xb, _mfma8(arch, w_lo, xa, acc))
