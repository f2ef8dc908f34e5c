"""K1's attention stages: split-context paged GQA attention and the merge of the splits.

``attn_task`` (row r, KV head g, split s): waits for the row's q (the group's heads), k and v
words, applies q/k-norm and RoPE (rotate-half, bf16 cos/sin), and the split that holds the
newest position writes k/v into the paged cache at the row's slot. K and V are addressed through
their block / token / head strides, passed at launch (``kv.py``; 64-bit word offsets), so the
reference's contiguous cache and vLLM's interleaved K|V views run the same code object. It then
runs an online softmax over its slice of the visible context (chunks of 64 positions, one per
lane, wave c % 4 takes chunk c), merges the waves' partials and publishes the unnormalised
(m, l, acc) of each query head.

``combine_task`` (row r, query head h): waits for the S partials of its head and writes the
merged, normalised attention output (bf16), K1's launch output.

Visible context of a row: positions ``j < seq_len`` and, on sliding layers, ``j > pos - window``
(the reference's rule). Padded rows (slot < 0) see nothing and produce zeros.
"""

from __future__ import annotations

import flydsl.expr as fx
from flydsl.expr import gpu, rocdl

from monodecode.kernels.flydsl import device as d
from monodecode.kernels.flydsl import mailbox as mb
from monodecode.kernels.flydsl.arch import WAVE_SIZE, WAVES_PER_WORKGROUP, WORKGROUP_SIZE
from monodecode.kernels.flydsl.config import ATTN_CHUNK, NEG_BIG, Geometry
from monodecode.kernels.flydsl.kv import kv_word
from monodecode.model.dims import ModelDims

NW = WAVES_PER_WORKGROUP
WG = WORKGROUP_SIZE


def make_attention(dims: ModelDims, geom: Geometry, block_size: int):
    """``(attn_task, combine_task)`` of one specialisation (closures bake the constants in)."""
    D, GQ, KVH, HEADS, S = geom.head_dim, geom.group, geom.kv_heads, geom.heads, geom.attn_splits
    Q, KV, NQKV = geom.q, geom.kv, geom.qkv
    EPS, SCALE, QK_NORM = float(dims.rms_norm_eps), float(dims.attn_scale), dims.qk_norm
    SPLIT_BATCH = min(S, 4)  # combine: attention splits merged per round trip (S is a power of two)
    BS = block_size
    DPL = D // WAVE_SIZE  # head dims per lane
    HALF = D // 2
    RG = geom.regions  # word offsets in this width's scratch segment
    L1 = geom.lds1
    norm = d.norm_scale(dims.norm_one_plus)

    @d.device
    def attn_task(
        t,
        seg,
        ready,
        tag,
        polls,
        health,
        code,
        lds,
        tid,
        wave,
        lane,
        q_norm_w,
        k_norm_w,
        cos_sin,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        slots,
        positions,
        window,
        bt_stride,
        kst,
        vst,
    ):
        """Task t = (row, KV head g, split s). K/V of (block, token, head g) sit at word
        ``kv_word(block, token, g, kst | vst)`` of the caches (strides are launch arguments)."""
        mb.wait_ready(seg, ready, polls, health, code)  # the whole qkv stage (bf16 format)
        r = t // d.i32(KVH * S)
        g = (t // d.i32(S)) % d.i32(KVH)
        s = t % d.i32(S)
        pos = d.load_word(positions, r * 2)  # low word of the int64 position / slot
        slot = d.load_word(slots, r * 2)
        seq = d.load_word(seq_lens, r)
        live = slot >= d.i32(0)
        vec = d.i32(L1["qkv_vec"])

        # q of the group's heads, k and v of KV head g (the qkv stage's outputs)
        base = d.i32(RG["qkv"]) + r * d.i32(NQKV)
        ats, oks = [], []
        for u in fx.range_constexpr((GQ + 2) * D // WG + ((GQ + 2) * D % WG > 0)):  # one round trip
            i = tid + d.i32(u * WG)
            src = (i < d.i32(GQ * D)).select(
                g * d.i32(GQ * D) + i,
                (i < d.i32((GQ + 1) * D)).select(
                    d.i32(Q - GQ * D) + g * d.i32(D) + i, d.i32(Q + KV - (GQ + 1) * D) + g * d.i32(D) + i
                ),
            )
            ok = i < d.i32((GQ + 2) * D)
            ats.append(base + ok.select(src, d.i32(0)))
            oks.append(ok)
        got = mb.fetch(seg, ats, oks, tag, polls, health, code)
        for u in fx.range_constexpr(len(oks)):
            if oks[u]:
                d.lds_storef(lds, vec + tid + d.i32(u * WG), got[u])
        gpu.barrier()

        # q/k-norm and RoPE per head vector (GQ q heads, then k); lane holds dims lane*DPL + j
        for hv_ in range(wave, d.i32(GQ + 1), d.i32(NW)):
            hv = d.i32(hv_)
            hb = vec + hv * d.i32(D)
            vals = [d.lds_loadf(lds, hb + lane * d.i32(DPL) + d.i32(j)) for j in range(DPL)]
            if fx.const_expr(QK_NORM):
                ss = d.f32(0.0)
                for j in fx.range_constexpr(DPL):
                    ss = fx.math.fma(vals[j], vals[j], ss)
                rstd = d.rsqrt_mean(d.warp_sum(ss), D, EPS)
                for j in fx.range_constexpr(DPL):
                    dd = lane * d.i32(DPL) + d.i32(j)
                    wq = d.bf16_half(d.load_word(q_norm_w, dd // d.i32(2)), dd % d.i32(2))
                    wk = d.bf16_half(d.load_word(k_norm_w, dd // d.i32(2)), dd % d.i32(2))
                    vals[j] = norm(vals[j], rstd, (hv < d.i32(GQ)).select(wq, wk))
                for j in fx.range_constexpr(DPL):
                    d.lds_storef(lds, hb + lane * d.i32(DPL) + d.i32(j), vals[j])
            roped = []
            for j in fx.range_constexpr(DPL):
                dd = lane * d.i32(DPL) + d.i32(j)
                i2 = dd % d.i32(HALF)
                cs = d.load_f32(cos_sin, pos * d.i32(D) + i2)
                sn = d.load_f32(cos_sin, pos * d.i32(D) + d.i32(HALF) + i2)
                partner = d.lds_loadf(lds, hb + (dd + d.i32(HALF)) % d.i32(D))
                rot = (dd < d.i32(HALF)).select(d.f32(0.0) - partner, partner)
                roped.append(d.round_bf16(vals[j] * cs + rot * sn))
            for j in fx.range_constexpr(DPL):
                d.lds_storef(lds, hb + lane * d.i32(DPL) + d.i32(j), roped[j])
        gpu.barrier()

        # this split's slice of the visible context (the Triton kernels' rule)
        start = (window > d.i32(0)).select(fx.max(pos - window + d.i32(1), d.i32(0)), d.i32(0))
        end = live.select(seq, start)
        n = fx.max(end - start, d.i32(0))
        per = (((n + d.i32(S - 1)) // d.i32(S) + d.i32(ATTN_CHUNK - 1)) // d.i32(ATTN_CHUNK)) * d.i32(ATTN_CHUNK)
        lo = start + s * per
        hi = fx.min(lo + per, end)
        newest = end - d.i32(1)
        has_new = live & (lo <= newest) & (newest < hi)
        cend = fx.min(hi, newest)  # cached positions [lo, cend); the newest comes from LDS

        # the split holding the newest position writes it to the paged cache (bf16 pairs)
        if has_new & (tid < d.i32(HALF)):
            kb = vec + d.i32(GQ * D) + tid * d.i32(2)
            vb = vec + d.i32((GQ + 1) * D) + tid * d.i32(2)
            nblk = slot // d.i32(BS)
            ntok = slot - nblk * d.i32(BS)
            d.store_word(
                key_cache + kv_word(nblk, ntok, g, kst),
                tid,
                d.pack_bf16x2(d.lds_loadf(lds, kb), d.lds_loadf(lds, kb + d.i32(1))),
            )
            d.store_word(
                value_cache + kv_word(nblk, ntok, g, vst),
                tid,
                d.pack_bf16x2(d.lds_loadf(lds, vb), d.lds_loadf(lds, vb + d.i32(1))),
            )

        # online softmax over the cached positions: chunk c of 64 positions -> wave c % 4
        m = [d.f32(NEG_BIG) for _ in range(GQ)]
        lsum = [d.f32(0.0) for _ in range(GQ)]
        acc = [d.f32(0.0) for _ in range(GQ * DPL)]
        nch = (fx.max(cend - lo, d.i32(0)) + d.i32(ATTN_CHUNK - 1)) // d.i32(ATTN_CHUNK)
        p_base = d.i32(L1["p"]) + wave * d.i32(GQ * ATTN_CHUNK)
        s_base = d.i32(L1["slot"]) + wave * d.i32(2 * ATTN_CHUNK)  # 64-bit V word offsets
        # this lane's V dims as a 64-bit address, added to each position's word below (kept out of
        # the i32 offset: that sum made the scheduler hoist the score loop's q reads, +30 VGPRs)
        v_lane = value_cache + ((lane // d.i32(2)) if DPL == 1 else lane * d.i32(DPL // 2))
        for ch_ in range(wave, nch, d.i32(NW)):
            ch = d.i32(ch_)
            p0 = lo + ch * d.i32(ATTN_CHUNK)
            p = p0 + lane
            valid = p < cend
            pc = valid.select(p, lo)
            blk = d.load_word(block_tables, r * bt_stride + pc // d.i32(BS))
            btok = pc % d.i32(BS)
            d.lds_store64(lds, s_base + lane * d.i32(2), kv_word(blk, btok, g, vst))  # V's word, for P.V
            krow = key_cache + kv_word(blk, btok, g, kst)  # this lane's position: K of head g
            sc = [d.f32(0.0) for _ in range(GQ)]
            for k4_ in range(d.i32(D // 32)):  # 32 dims (4 x 16 bytes of K) per iteration
                k4 = d.i32(k4_)
                kw = [d.load_words(krow, k4 * d.i32(16) + d.i32(4 * u), 4) for u in range(4)]
                for h in fx.range_constexpr(GQ):
                    rocdl.sched_barrier(0)  # one head's q reads at a time (else all are hoisted: +30 VGPRs)
                    qb = vec + d.i32(h * D) + k4 * d.i32(32)
                    for u in fx.range_constexpr(4):
                        q0 = d.lds_load4(lds, qb + d.i32(8 * u))
                        q1 = d.lds_load4(lds, qb + d.i32(8 * u + 4))
                        for e in fx.range_constexpr(4):
                            qa = (q0 if e < 2 else q1)[(2 * e) % 4].bitcast(fx.Float32)
                            qc = (q0 if e < 2 else q1)[(2 * e + 1) % 4].bitcast(fx.Float32)
                            sc[h] = fx.math.fma(qa, d.bf16_lo(kw[u][e]), sc[h])
                            sc[h] = fx.math.fma(qc, d.bf16_hi(kw[u][e]), sc[h])
            for h in fx.range_constexpr(GQ):
                sv = valid.select(sc[h] * d.f32(SCALE), d.f32(NEG_BIG))
                m_new = fx.max(m[h], d.warp_max(sv))
                corr = d.exp(m[h] - m_new)
                pr = valid.select(d.exp(sv - m_new), d.f32(0.0))
                lsum[h] = lsum[h] * corr + d.warp_sum(pr)
                m[h] = m_new
                d.lds_storef(lds, p_base + d.i32(h * ATTN_CHUNK) + lane, pr)
                for j in fx.range_constexpr(DPL):
                    acc[h * DPL + j] = acc[h * DPL + j] * corr
            for i_ in range(fx.min(d.i32(ATTN_CHUNK), cend - p0)):
                i = d.i32(i_)
                vrow = v_lane + d.lds_load64(lds, s_base + i * d.i32(2))  # position i's V of head g
                vv = []
                if fx.const_expr(DPL == 1):
                    vw = d.load_word(vrow, d.i32(0))
                    vv.append(d.bf16_half(vw, lane % d.i32(2)))
                else:
                    for j2 in fx.range_constexpr(DPL // 2):
                        vw = d.load_word(vrow, d.i32(j2))
                        vv.append(d.bf16_lo(vw))
                        vv.append(d.bf16_hi(vw))
                for h in fx.range_constexpr(GQ):
                    ph = d.lds_loadf(lds, p_base + d.i32(h * ATTN_CHUNK) + i)
                    for j in fx.range_constexpr(DPL):
                        acc[h * DPL + j] = fx.math.fma(ph, vv[j], acc[h * DPL + j])

        # merge the waves' partials and the newest position; wave h % 4 publishes head h
        for h in fx.range_constexpr(GQ):
            if lane == d.i32(0):
                d.lds_storef(lds, d.i32(L1["ml"] + h * 2) + wave * d.i32(GQ * 2), m[h])
                d.lds_storef(lds, d.i32(L1["ml"] + h * 2 + 1) + wave * d.i32(GQ * 2), lsum[h])
            for j in fx.range_constexpr(DPL):
                d.lds_storef(
                    lds, d.i32(L1["acc"] + h * D + j) + wave * d.i32(GQ * D) + lane * d.i32(DPL), acc[h * DPL + j]
                )
        gpu.barrier()
        for h in fx.range_constexpr(GQ):
            if wave == d.i32(h % NW):
                cur = d.f32(0.0)
                for j in fx.range_constexpr(DPL):
                    dd = lane * d.i32(DPL) + d.i32(j)
                    cur = fx.math.fma(
                        d.lds_loadf(lds, vec + d.i32(h * D) + dd), d.lds_loadf(lds, vec + d.i32(GQ * D) + dd), cur
                    )
                s_new = has_new.select(d.warp_sum(cur) * d.f32(SCALE), d.f32(NEG_BIG))
                mx = s_new
                for w in fx.range_constexpr(NW):
                    mx = fx.max(mx, d.lds_loadf(lds, d.i32(L1["ml"] + (w * GQ + h) * 2)))
                e_new = has_new.select(d.exp(s_new - mx), d.f32(0.0))
                den = e_new
                outs = [e_new * d.lds_loadf(lds, vec + d.i32((GQ + 1) * D + j) + lane * d.i32(DPL)) for j in range(DPL)]
                for w in fx.range_constexpr(NW):
                    f = d.exp(d.lds_loadf(lds, d.i32(L1["ml"] + (w * GQ + h) * 2)) - mx)
                    den = den + f * d.lds_loadf(lds, d.i32(L1["ml"] + (w * GQ + h) * 2 + 1))
                    for j in fx.range_constexpr(DPL):
                        outs[j] = outs[j] + f * d.lds_loadf(
                            lds, d.i32(L1["acc"] + (w * GQ + h) * D + j) + lane * d.i32(DPL)
                        )
                hrow = (r * d.i32(HEADS) + g * d.i32(GQ) + d.i32(h)) * d.i32(S) + s
                for j in fx.range_constexpr(DPL):
                    mb.publish(seg, d.i32(RG["attn_acc"] + j) + hrow * d.i32(D) + lane * d.i32(DPL), tag, outs[j], True)
                if lane == d.i32(0):
                    mb.publish(seg, d.i32(RG["attn_ml"]) + hrow * d.i32(2), tag, mx, True)
                    mb.publish(seg, d.i32(RG["attn_ml"] + 1) + hrow * d.i32(2), tag, den, True)
        gpu.barrier()  # the next task reuses the LDS

    @d.device
    def combine_task(t, seg, ready, tag, polls, health, code, tid, out_attn):
        mb.wait_ready(seg, ready, polls, health, code)  # the whole attn stage (bf16 format)
        r = t // d.i32(HEADS)
        h = t % d.i32(HEADS)
        if tid < d.i32(D):
            hrow = (r * d.i32(HEADS) + h) * d.i32(S)
            big = d.f32(NEG_BIG)
            den = d.f32(0.0)
            num = d.f32(0.0)
            for s0_ in range(0, S, SPLIT_BATCH):  # SPLIT_BATCH splits (3 words each) per round trip
                s0 = d.i32(s0_)
                ats = []
                for j in fx.range_constexpr(SPLIT_BATCH):
                    at = (hrow + s0 + d.i32(j)) * d.i32(2)
                    ats += [
                        d.i32(RG["attn_ml"]) + at,
                        d.i32(RG["attn_ml"] + 1) + at,
                        d.i32(RG["attn_acc"]) + (hrow + s0 + d.i32(j)) * d.i32(D) + tid,
                    ]
                got = mb.fetch(seg, ats, [tid >= d.i32(0)] * len(ats), tag, polls, health, code, True)
                new_big = big
                for j in fx.range_constexpr(SPLIT_BATCH):
                    new_big = fx.max(new_big, got[3 * j])
                scale = d.exp(big - new_big)
                den = den * scale
                num = num * scale
                for j in fx.range_constexpr(SPLIT_BATCH):
                    wgt = d.exp(got[3 * j] - new_big)
                    den = fx.math.fma(wgt, got[3 * j + 1], den)
                    num = fx.math.fma(wgt, got[3 * j + 2], num)
                big = new_big
            res = (den > d.f32(0.0)).select(num / (den > d.f32(0.0)).select(den, d.f32(1.0)), d.f32(0.0))
            d.store_bf16(out_attn, r * d.i32(Q) + h * d.i32(D) + tid, res)

    return attn_task, combine_task
