"""K1's attention stages: split-context paged GQA attention and the merge of the splits.

``attn_task`` (row r, KV head g, split s): waits for the row's q (the group's heads), k and v
words, applies q/k-norm and RoPE (rotate-half, handled as the two halves of each head so no
register shuffles are needed), and the split that holds the newest position writes k/v into the
paged cache at the row's slot (then a CTA barrier makes them visible to its own tile loads).
K and V are addressed through their block / token / head strides (element units; the head_dim
axis is contiguous), so the contiguous ``[blocks, block_size, kv_heads, head_dim]`` planes of the
reference cache and vLLM's interleaved K|V views (``vllm_plugin.step.kv_views``) both work.
It then runs an online softmax over its slice of the visible context, reading K/V through the
block table, and publishes the unnormalised partial (m, l, acc) per query head. Both tasks read
their inputs after the launch's wait on the producing stage (``mailbox.fetch``: tagged words
have their tags checked; the bf16 format holds q/k/v as bf16 and the partials as fp32).

K1 may load a task's first K/V tile before its wait for the qkv stage (``attn_first_tile``,
``Target.attn_prefetch``): every position of it is older than this step's, except the newest,
which the task replaces from its registers, so the tile's HBM round trips overlap the wait.

``combine_task`` (row r, query head h): waits for the S partials of its head and writes the
merged, normalised attention output (bf16) — K1's launch output.

Visible context of a row: positions ``j < seq_len`` and, on sliding layers, ``j > pos - window``
(the reference's rule). Padded rows (slot < 0) see nothing and produce zeros.
"""

import triton
import triton.language as tl

from monodecode.kernels.triton.gemv import mma, rms_apply
from monodecode.kernels.triton.mailbox import fetch, publish


@triton.jit
def _head_norm(a, b, w_ptr, eps, D: tl.constexpr, ONE_PLUS: tl.constexpr):
    """RMSNorm over each head (rows) given as its two halves ``a``, ``b`` [R, D/2] (bf16 in, bf16 out)."""
    HALF: tl.constexpr = D // 2
    af = a.to(tl.float32)
    bf = b.to(tl.float32)
    ss = tl.sum(af * af, axis=1) + tl.sum(bf * bf, axis=1)
    rstd = 1.0 / tl.sqrt_rn(ss / D + eps)
    d = tl.arange(0, HALF)
    ga = tl.load(w_ptr + d).to(tl.float32)
    gb = tl.load(w_ptr + HALF + d).to(tl.float32)
    return rms_apply(af, rstd[:, None], ga[None, :], ONE_PLUS), rms_apply(bf, rstd[:, None], gb[None, :], ONE_PLUS)


@triton.jit
def _rope(a, b, cos, sin):
    """rotate-half RoPE on the two halves (fp32 math, one rounding to bf16, like the reference)."""
    af = a.to(tl.float32)
    bf = b.to(tl.float32)
    return (af * cos - bf * sin).to(tl.bfloat16), (bf * cos + af * sin).to(tl.bfloat16)


@triton.jit
def _block_ids(bt_ptr, r, bt_stride, j0, hi, BS: tl.constexpr, BT: tl.constexpr):
    """The cache block of each position ``j0 + [0, BT)`` of row ``r`` (0 past ``hi``: never read)."""
    j = j0 + tl.arange(0, BT)
    return tl.load(bt_ptr + r * bt_stride + j // BS, mask=j < hi, other=0)


@triton.jit
def _kv_tile(
    kc_ptr,
    vc_ptr,
    blk,
    j0,
    hi,
    g,
    k_sb,
    k_st,
    k_sh,
    v_sb,
    v_st,
    v_sh,
    BS: tl.constexpr,
    BT: tl.constexpr,
    D: tl.constexpr,
):
    """K (as its two halves) and V of KV head ``g`` at positions ``j0 + [0, BT)`` below ``hi``."""
    HALF: tl.constexpr = D // 2
    j = j0 + tl.arange(0, BT)
    jm = (j < hi)[:, None]
    dh = tl.arange(0, HALF)
    blk64 = blk.to(tl.int64)
    off64 = (j % BS).to(tl.int64)
    krow = blk64 * k_sb + off64 * k_st + g * k_sh
    vrow = blk64 * v_sb + off64 * v_st + g * v_sh
    ka = tl.load(kc_ptr + krow[:, None] + dh[None, :], mask=jm, other=0.0)
    kb = tl.load(kc_ptr + krow[:, None] + HALF + dh[None, :], mask=jm, other=0.0)
    vv = tl.load(vc_ptr + vrow[:, None] + tl.arange(0, D)[None, :], mask=jm, other=0.0)
    return ka, kb, vv


@triton.jit
def _softmax_tile(q1, q2, ka, kb, vv, jm, scale, m_i, l_i, acc, GP: tl.constexpr, BT: tl.constexpr):
    """One online-softmax step of the query group over a K/V tile (``jm``: live positions)."""
    sc = mma(q2, tl.trans(kb), mma(q1, tl.trans(ka), tl.zeros([GP, BT], dtype=tl.float32)))
    sc = tl.where(jm[None, :], sc * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = mma(p.to(tl.bfloat16), vv, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _store_newest(
    kc_ptr, vc_ptr, slot, g, k_sb, k_st, k_sh, v_sb, v_st, v_sh, k1, k2, v, BS: tl.constexpr, D: tl.constexpr
):
    """This step's k (as its two halves) and v of KV head ``g`` into the paged cache at ``slot``."""
    HALF: tl.constexpr = D // 2
    dh = tl.arange(0, HALF)
    sblk = (slot // BS).to(tl.int64)
    soff = (slot % BS).to(tl.int64)
    kdst = sblk * k_sb + soff * k_st + g * k_sh
    vdst = sblk * v_sb + soff * v_st + g * v_sh
    tl.store(kc_ptr + kdst + dh[None, :], k1)
    tl.store(kc_ptr + kdst + HALF + dh[None, :], k2)
    tl.store(vc_ptr + vdst + tl.arange(0, D), v)


@triton.jit
def _split_span(t, pos_ptr, slot_ptr, seq_ptr, window, KVH: tl.constexpr, S: tl.constexpr, BT: tl.constexpr):
    """Task ``t``'s (row, KV head, split), its row's position and slot, and the split's slice
    ``[lo, hi)`` of the visible context (``newest``: the row's newest position)."""
    r = t // (KVH * S)
    g = (t // S) % KVH
    s = t % S
    pos = tl.load(pos_ptr + r)
    slot = tl.load(slot_ptr + r)
    seq = tl.load(seq_ptr + r)
    live = slot >= 0
    start = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0).to(tl.int32)
    end = tl.where(live, seq, start).to(tl.int32)
    per = tl.cdiv(tl.cdiv(tl.maximum(end - start, 0), S), BT) * BT
    lo = start + s * per
    hi = tl.minimum(lo + per, end)
    return r, g, s, pos, slot, live, lo, hi, end - 1


@triton.jit
def attn_first_tile(t, valid, kv, step, SHAPE: tl.constexpr):
    """K (as its two halves) and V of task ``t``'s first context tile (all masked unless
    ``valid``), for K1 to load before it waits for the qkv stage: the step inputs it reads are
    written before the launch, and the one position of it this step writes (the newest)
    ``attn_task`` replaces from its registers."""
    kc_ptr, vc_ptr, k_sb, k_st, k_sh, v_sb, v_st, v_sh = kv
    pos_ptr, slot_ptr, bt_ptr, bt_stride, seq_ptr, window = step
    D: tl.constexpr = SHAPE[3]
    KVH: tl.constexpr = SHAPE[6]
    S: tl.constexpr = SHAPE[8]
    BS: tl.constexpr = SHAPE[9]
    BT: tl.constexpr = SHAPE[10]
    r, g, _s, _pos, _slot, _live, lo, hi, _newest = _split_span(t, pos_ptr, slot_ptr, seq_ptr, window, KVH, S, BT)
    hi = tl.where(valid, hi, lo)
    blk = _block_ids(bt_ptr, r, bt_stride, lo, hi, BS, BT)
    return _kv_tile(kc_ptr, vc_ptr, blk, lo, hi, g, k_sb, k_st, k_sh, v_sb, v_st, v_sh, BS, BT, D)


@triton.jit
def attn_task(
    t,
    qkv_mb,
    acc_mb,
    ml_mb,
    head,
    kv,
    step,
    eps,
    scale,
    tag,
    health_ptr,
    bad_code,
    SHAPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    ONE_PLUS: tl.constexpr,
    BF16MB: tl.constexpr,
    ATTN_STAGES: tl.constexpr,
    first=None,
    PREFETCHED: tl.constexpr = False,
):
    """One (row, KV head, split) task; the caller has waited for the qkv stage. Its kernel's
    arguments come grouped (K1, the attention launch and ``benchmarks/attention_probe.py`` pass
    the same tuples): ``head`` = (q-norm, k-norm, RoPE inverse frequencies), ``kv`` = (K cache,
    V cache, their block / token / head strides), ``step`` = (positions, slots, block table, its
    row stride, sequence lengths, sliding window), ``SHAPE`` = (NQKV, Q, KV, D, G, GP, KVH, H, S,
    BS, BT) as in ``config._attention_shape``. ``ATTN_STAGES``: software-pipelining depth of the
    context loop (block-table, K and V loads in flight). ``PREFETCHED``: ``first`` = (task, its
    first tile as ``attn_first_tile`` loaded it); that task's first tile comes from there."""
    qnorm_ptr, knorm_ptr, inv_freq_ptr = head
    kc_ptr, vc_ptr, k_sb, k_st, k_sh, v_sb, v_st, v_sh = kv
    pos_ptr, slot_ptr, bt_ptr, bt_stride, seq_ptr, window = step
    NQKV: tl.constexpr = SHAPE[0]
    Q: tl.constexpr = SHAPE[1]
    KV: tl.constexpr = SHAPE[2]
    D: tl.constexpr = SHAPE[3]
    G: tl.constexpr = SHAPE[4]
    GP: tl.constexpr = SHAPE[5]
    KVH: tl.constexpr = SHAPE[6]
    H: tl.constexpr = SHAPE[7]
    S: tl.constexpr = SHAPE[8]
    BS: tl.constexpr = SHAPE[9]
    BT: tl.constexpr = SHAPE[10]
    HALF: tl.constexpr = D // 2
    r, g, s, pos, slot, live, lo, hi, newest = _split_span(t, pos_ptr, slot_ptr, seq_ptr, window, KVH, S, BT)
    dh = tl.arange(0, HALF)
    d = tl.arange(0, D)
    jq = tl.arange(0, GP)
    qrow = jq < G
    base = qkv_mb + r * NQKV
    q_w = base + g * G * D
    k_w = base + Q + g * D
    v_w = base + Q + KV + g * D
    qm = qrow[:, None] & (dh[None, :] >= 0)
    q1 = fetch(q_w + jq[:, None] * D + dh[None, :], qm, tag, health_ptr, bad_code, BF16MB).to(tl.bfloat16)
    q2 = fetch(q_w + jq[:, None] * D + HALF + dh[None, :], qm, tag, health_ptr, bad_code, BF16MB).to(tl.bfloat16)
    k1 = fetch(k_w + dh, dh >= 0, tag, health_ptr, bad_code, BF16MB).to(tl.bfloat16)[None, :]
    k2 = fetch(k_w + HALF + dh, dh >= 0, tag, health_ptr, bad_code, BF16MB).to(tl.bfloat16)[None, :]
    v = fetch(v_w + d, d >= 0, tag, health_ptr, bad_code, BF16MB).to(tl.bfloat16)
    if QK_NORM:
        q1, q2 = _head_norm(q1, q2, qnorm_ptr, eps, D, ONE_PLUS)
        k1, k2 = _head_norm(k1, k2, knorm_ptr, eps, D, ONE_PLUS)
    freq = pos.to(tl.float32) * tl.load(inv_freq_ptr + dh)
    cos = tl.cos(freq).to(tl.bfloat16).to(tl.float32)[None, :]
    sin = tl.sin(freq).to(tl.bfloat16).to(tl.float32)[None, :]
    q1, q2 = _rope(q1, q2, cos, sin)
    k1, k2 = _rope(k1, k2, cos, sin)

    if live & (lo <= newest) & (newest < hi):
        _store_newest(kc_ptr, vc_ptr, slot, g, k_sb, k_st, k_sh, v_sb, v_st, v_sh, k1, k2, v, BS, D)
        tl.debug_barrier()  # this program's own tile loads below read them back

    m_i = tl.full([GP], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    jt = tl.arange(0, BT)
    loop_lo = lo
    if PREFETCHED:  # the first tile, loaded before the wait where this is the prefetched task
        pre_t, pre = first
        if t == pre_t:
            ka, kb, vv = pre
        else:
            blk = _block_ids(bt_ptr, r, bt_stride, lo, hi, BS, BT)
            ka, kb, vv = _kv_tile(kc_ptr, vc_ptr, blk, lo, hi, g, k_sb, k_st, k_sh, v_sb, v_st, v_sh, BS, BT, D)
        # the newest position from registers: the prefetched tile holds the slot's old contents
        fresh = (lo + jt == newest)[:, None] & live
        ka = tl.where(fresh, k1, ka)
        kb = tl.where(fresh, k2, kb)
        vv = tl.where(fresh, v[None, :], vv)
        m_i, l_i, acc = _softmax_tile(q1, q2, ka, kb, vv, lo + jt < hi, scale, m_i, l_i, acc, GP, BT)
        loop_lo = lo + BT
    for t0 in tl.range(loop_lo, hi, BT, num_stages=ATTN_STAGES):
        blk = _block_ids(bt_ptr, r, bt_stride, t0, hi, BS, BT)
        ka, kb, vv = _kv_tile(kc_ptr, vc_ptr, blk, t0, hi, g, k_sb, k_st, k_sh, v_sb, v_st, v_sh, BS, BT, D)
        m_i, l_i, acc = _softmax_tile(q1, q2, ka, kb, vv, t0 + jt < hi, scale, m_i, l_i, acc, GP, BT)

    hrow = (r * H + g * G + jq) * S + s
    publish(acc_mb + hrow[:, None] * D + d[None, :], acc, qrow[:, None] & (d[None, :] >= 0), tag, BF16MB, True)
    publish(ml_mb + hrow * 2, m_i, qrow, tag, BF16MB, True)
    publish(ml_mb + hrow * 2 + 1, l_i, qrow, tag, BF16MB, True)


@triton.jit
def combine_task(
    t,
    acc_mb,
    ml_mb,
    out_ptr,
    tag,
    health_ptr,
    bad_code,
    Q: tl.constexpr,
    D: tl.constexpr,
    H: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,
    BF16MB: tl.constexpr,
):
    """One (row, query head) task; the caller has waited for the attention stage. ``SP``: ``S``
    rounded up to a power of two (the attention launch's splits need not be one)."""
    r = t // H
    h = t % H
    si = tl.arange(0, SP)
    sm = si < S
    d = tl.arange(0, D)
    mlb = ml_mb + (r * H + h) * S * 2
    accb = acc_mb + (r * H + h) * S * D
    m = tl.where(sm, fetch(mlb + si * 2, sm, tag, health_ptr, bad_code, BF16MB), float("-inf"))
    l = fetch(mlb + si * 2 + 1, sm, tag, health_ptr, bad_code, BF16MB)
    a = fetch(accb + si[:, None] * D + d[None, :], sm[:, None] & (d[None, :] >= 0), tag, health_ptr, bad_code, BF16MB)
    big = tl.max(m, axis=0)
    wts = tl.exp(m - big)
    den = tl.sum(wts * l, axis=0)
    num = tl.sum(wts[:, None] * a, axis=0)
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(out_ptr + r * Q + h * D + d, out.to(tl.bfloat16))


@triton.jit
def combine_group(
    pair,
    acc_mb,
    ml_mb,
    out_ptr,
    tag,
    health_ptr,
    bad_code,
    Q: tl.constexpr,
    D: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    GQ: tl.constexpr,
    KVH: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,
    DC: tl.constexpr,
    BF16MB: tl.constexpr,
):
    """``combine_task`` for all ``G`` query heads of (row, KV head) ``pair`` at once (``GQ``: G
    rounded up to a power of two): one load of their splits' (m, l), then one of each
    ``DC``-wide slice of their partial outputs, instead of G merges one after another, each
    waiting for its own loads. Each head's sums are combine_task's."""
    r = pair // KVH
    g = pair % KVH
    hh = tl.arange(0, GQ)
    si = tl.arange(0, SP)
    hm = hh < G
    live = hm[:, None] & (si < S)[None, :]
    row = r * H + g * G + hh  # the heads' rows of the partials, S splits each
    ml = ml_mb + (row[:, None] * S + si[None, :]) * 2
    m = tl.where(live, fetch(ml, live, tag, health_ptr, bad_code, BF16MB), float("-inf"))
    l = fetch(ml + 1, live, tag, health_ptr, bad_code, BF16MB)
    big = tl.where(hm, tl.max(m, axis=1), 0.0)  # padded heads: no inf - inf
    wts = tl.exp(m - big[:, None])
    den = tl.sum(wts * l, axis=1)[:, None]
    for c in tl.static_range(D // DC):
        d = c * DC + tl.arange(0, DC)
        a = fetch(
            acc_mb + (row[:, None, None] * S + si[None, :, None]) * D + d[None, None, :],
            live[:, :, None] & (d[None, None, :] >= 0),
            tag,
            health_ptr,
            bad_code,
            BF16MB,
        )
        num = tl.sum(wts[:, :, None] * a, axis=1)
        out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
        om = hm[:, None] & (d[None, :] >= 0)
        tl.store(out_ptr + r * Q + (g * G + hh)[:, None] * D + d[None, :], out.to(tl.bfloat16), mask=om)
