"""FlyDSL K1 and K2 of a dense decoder layer, specialised per (dims, width, arch, weight dtype).

Side by side with ``monodecode/model/reference.py`` (``k1_reference`` / ``k2_reference``):

K1  (``x`` -> ``attn``; persistent grid, one workgroup per CU)
  S0  rstd of every row of x                       (every workgroup; x is tiny, L2-resident)
  S1  normed x staged in LDS per chunk, QKV GEMV   RMSNorm (Gemma: x*rstd*(1+w); Llama/Qwen:
      rows -> waves round-robin                    w*bf16(x*rstd)), q|k|v = W_qkv @ xn, bf16
                                                   -> mailbox MB_QKV (tagged words)
  S2  task (token, kv_head) -> workgroup:          wait q/k/v words; q/k RMSNorm per head
      q/k-norm, RoPE (rotate-half, cos/sin table), (qk_norm); RoPE; K,V written at the slot;
      KV insert, GQA attention over the paged      softmax(q.K^T*scale) V over positions
      cache (sliding window), 4 waves split the    [max(0, L-window), L) with the new K/V
      positions, merged in LDS                     taken from registers; out bf16
K2  (``x``, ``attn`` -> ``x_new``)
  S0  attn staged in LDS, O GEMV -> MB_O           o = W_o @ attn (bf16)
  S1  per row: rstd of o (Gemma post-attn norm),   h = x + post_norm(o) (bf16); rstd of h
      residual h, rstd of h (pre-MLP norm)
  S2  normed h in LDS, gate|up GEMV (row pairs)    a = act(bf16 gate) * bf16 up -> MB_ACT
  S3  a (waited) in LDS, down GEMV                 d = W_down @ a; Llama/Qwen: x_new = h + d;
                                                   Gemma: d -> MB_DOWN
  S4  (Gemma) per row: post-MLP norm, residual     x_new = h + bf16(d*rstd*(1+w))
  Non-finite outputs and expired waits raise bits of the sticky health word (``SITES``).

No stage waits on a later stage and every workgroup is resident, so there is no grid barrier.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu

from monodecode.kernels.flydsl import device as d
from monodecode.kernels.flydsl.arch import WAVE_SIZE, WAVES_PER_WORKGROUP, WORKGROUP_SIZE
from monodecode.kernels.flydsl.geometry import GemvShape, Geometry
from monodecode.model.dims import ModelDims

NW = WAVES_PER_WORKGROUP

# Health sites (monodecode.kernels.base.HEALTH_SITES); the word holds health_code(site, kernel, layer).
SITE_WAIT, SITE_NONFINITE = 1, 2
KERNEL_K1, KERNEL_K2 = 1, 2


@d.device
def gemv_chunk(g: GemvShape, c: int, w_rs, wbase, lds_x, lds_part, width: int, pair: int, pair_stride: int,
               wave, lane, gw, gwaves: int, epilogue):
    """Rows of this wave over LDS chunk ``c`` of the activations (``width`` rows of bf16).

    Weight row r lives at byte ``wbase + r * k * bytes``; with ``pair`` = 2 the wave also computes
    row ``r + pair_stride`` (gate|up) from the same activation loads. Partial sums of earlier
    chunks wait in ``lds_part``; after the last chunk ``epilogue(r, sums)`` gets the full dots
    (``sums[p][t]``, wave-uniform).
    """
    wbytes = 1 if g.vec == 16 else 2
    c0 = c * g.chunk
    clen = min(g.chunk, g.k - c0)
    nfull = clen // g.step
    tail_lanes = (clen % g.step) // g.vec
    xw_per_lane = g.vec // 2  # activation words (bf16 pairs) per lane per step
    last = c == g.chunks - 1
    for j in range(g.rows_per_wave):
        r = gw + j * gwaves
        if r < g.rows:
            accs = [[d.f32(0.0) for _ in range(width)] for _ in range(pair)]
            for s in range(nfull):
                kl = s * g.step + lane * g.vec  # element offset inside the chunk
                for p in fx.range_constexpr(pair):
                    wv = d.load_weights16(w_rs, wbase + ((r + p * pair_stride) * g.k + c0 + kl) * wbytes)
                    for t in fx.range_constexpr(width):
                        xa = d.lds_load4(lds_x, (t * g.chunk + kl) // 2)
                        if fx.const_expr(xw_per_lane == 4):
                            accs[p][t] = d.dot_bf16(wv, xa, accs[p][t])
                        else:
                            xb = d.lds_load4(lds_x, (t * g.chunk + kl) // 2 + 4)
                            accs[p][t] = d.dot_fp8(wv, xa, xb, accs[p][t])
            if fx.const_expr(tail_lanes > 0):
                active = lane < tail_lanes
                ln = active.select(lane, d.i32(0))
                kl = nfull * g.step + ln * g.vec
                for p in fx.range_constexpr(pair):
                    wv = d.load_weights16(w_rs, wbase + ((r + p * pair_stride) * g.k + c0 + kl) * wbytes)
                    for t in fx.range_constexpr(width):
                        xa = d.lds_load4(lds_x, (t * g.chunk + kl) // 2)
                        if fx.const_expr(xw_per_lane == 4):
                            part = d.dot_bf16(wv, xa, d.f32(0.0))
                        else:
                            xb = d.lds_load4(lds_x, (t * g.chunk + kl) // 2 + 4)
                            part = d.dot_fp8(wv, xa, xb, d.f32(0.0))
                        accs[p][t] = accs[p][t] + active.select(part, d.f32(0.0))
            sums = [[d.warp_sum(accs[p][t]) for t in range(width)] for p in range(pair)]
            slot = ((wave * g.rows_per_wave + j) * pair) * width
            if fx.const_expr(c > 0):
                sums = [[sums[p][t] + d.lds_loadf(lds_part, slot + p * width + t) for t in range(width)]
                        for p in range(pair)]
            if fx.const_expr(last):
                epilogue(r, sums)
            else:
                if lane == d.i32(0):
                    for p in fx.range_constexpr(pair):
                        for t in fx.range_constexpr(width):
                            d.lds_storef(lds_part, slot + p * width + t, sums[p][t])


def lane_pick(lane, values):
    """values[lane] for lane < len(values) (wave-uniform inputs -> one value per lane)."""
    out = values[0]
    for t in range(1, len(values)):
        out = (lane == d.i32(t)).select(values[t], out)
    return out


def norm_scale(one_plus: bool):
    """Gemma multiplies by (1 + w) in fp32; Llama/Qwen by w after rounding x*rstd to bf16."""
    if one_plus:
        return lambda xv, rstd, w: d.round_bf16(xv * rstd * (d.f32(1.0) + w))
    return lambda xv, rstd, w: d.round_bf16(w * d.round_bf16(xv * rstd))


def make_kernels(dims: ModelDims, geom: Geometry, block_size: int):
    """Build the K1 / K2 launchers for one specialisation (closures bake the constants in)."""
    W, G, H = geom.width, geom.grid, geom.hidden
    Q, KV, D, NKV, GQ, I = geom.q_size, geom.kv_size, geom.head_dim, geom.num_kv_heads, geom.gqa, geom.intermediate
    NQKV = Q + 2 * KV
    EPS = float(dims.rms_norm_eps)
    SCALE = float(dims.attn_scale)
    QK_NORM, ONE_PLUS, GEMMA_POST = dims.qk_norm, dims.norm_one_plus, dims.post_norms
    GELU = dims.activation == "gelu_tanh"
    BS = block_size
    DPL = max(1, D // WAVE_SIZE)  # head dims per lane in the V phase
    HALF = D // 2
    GW = G * NW
    scale_fn = norm_scale(ONE_PLUS)
    qkv, og, gu, dn = geom.qkv, geom.o, geom.gate_up, geom.down
    part_words = max(1, NW * max(qkv.rows_per_wave, og.rows_per_wave, 2 * gu.rows_per_wave, dn.rows_per_wave) * W)

    # ------------------------------------------------------------------------------------ K1
    @flyc.kernel
    def k1_kernel(x: fx.Pointer, norm_w: fx.Pointer, w_qkv: fx.Pointer, s_qkv: fx.Pointer, q_norm_w: fx.Pointer,
                  k_norm_w: fx.Pointer, cos_sin: fx.Pointer, key_cache: fx.Pointer, value_cache: fx.Pointer,
                  block_tables: fx.Pointer, seq_lens: fx.Pointer, slots: fx.Pointer, positions: fx.Pointer,
                  out_attn: fx.Pointer, scratch: fx.Pointer, health: fx.Pointer, window: fx.Int32,
                  bt_stride: fx.Int32, max_polls: fx.Int32, layer: fx.Int32):
        tid = gpu.thread_idx.x
        bid = gpu.block_idx.x
        wave = tid // WAVE_SIZE
        lane = tid % WAVE_SIZE
        gw = bid * NW + wave
        epoch, tag = d.launch_tag(scratch)
        mbox = scratch + geom.mb_qkv
        wait_code = d.health_code(SITE_WAIT, KERNEL_K1, layer)

        alloc = fx.SharedAllocator()
        lds_x = d.lds_words(alloc, W * qkv.chunk // 2)
        lds_rstd = d.lds_words(alloc, W)
        lds_part = d.lds_words(alloc, part_words)
        lds_qkv = d.lds_words(alloc, (GQ + 2) * D)
        lds_p = d.lds_words(alloc, NW * GQ * WAVE_SIZE)
        lds_slot = d.lds_words(alloc, NW * WAVE_SIZE)
        lds_m = d.lds_words(alloc, NW * GQ * 2)
        lds_acc = d.lds_words(alloc, NW * GQ * D)

        # S0: rstd of each row of x (wave t % NW owns row t)
        for t in fx.range_constexpr(W):
            if wave == d.i32(t % NW):
                ss = d.f32(0.0)
                for k in range(lane * 2, H, WAVE_SIZE * 2):
                    wd = d.load_word(x, (t * H + k) // 2)
                    ss = fx.math.fma(d.bf16_lo(wd), d.bf16_lo(wd), ss)
                    ss = fx.math.fma(d.bf16_hi(wd), d.bf16_hi(wd), ss)
                tot = d.warp_sum(ss)
                if lane == d.i32(0):
                    d.lds_storef(lds_rstd, t, fx.math.rsqrt(tot / d.f32(float(H)) + d.f32(EPS)))
        gpu.barrier()

        w_rs = d.buffer_rsrc(w_qkv)

        def publish_qkv(r, sums):
            sc = d.f32(1.0)
            if fx.const_expr(geom.fp8):
                sc = fx.generic_load(s_qkv + r, dtype=fx.Float32)
            v = lane_pick(lane, sums[0]) * sc
            if lane < d.i32(W):
                d.mb_put(mbox, lane * NQKV + r, tag, v)

        # S1: normed x chunks -> QKV GEMV
        for c in fx.range_constexpr(qkv.chunks):
            c0 = c * qkv.chunk
            clen = min(qkv.chunk, H - c0)
            if fx.const_expr(c > 0):
                gpu.barrier()
            for idx in range(tid, W * clen // 2, WORKGROUP_SIZE):
                t = idx // (clen // 2)
                k = c0 + (idx % (clen // 2)) * 2
                wd = d.load_word(x, (t * H + k) // 2)
                nw = d.load_word(norm_w, k // 2)
                rs = d.lds_loadf(lds_rstd, t)
                lo = scale_fn(d.bf16_lo(wd), rs, d.bf16_lo(nw))
                hi = scale_fn(d.bf16_hi(wd), rs, d.bf16_hi(nw))
                d.lds_store(lds_x, t * (qkv.chunk // 2) + (k - c0) // 2, d.pack_bf16x2(lo, hi))
            gpu.barrier()
            gemv_chunk(qkv, c, w_rs, 0, lds_x, lds_part, W, 1, 0, wave, lane, gw, GW, publish_qkv)

        # S2: attention tasks (token, kv head) -> workgroups
        budget = d.health_ok(health).select(max_polls, d.i32(0))
        for task in range(bid, W * NKV, G):
            t = task // NKV
            g = task % NKV
            slot = fx.generic_load(slots + t * 2, dtype=fx.Int32)  # low word of the int64 slot
            pos = fx.generic_load(positions + t * 2, dtype=fx.Int32)
            L = fx.generic_load(seq_lens + t, dtype=fx.Int32)
            # gather q (GQ heads), k, v of this kv head from the QKV mailbox
            for i in range(tid, (GQ + 2) * D, WORKGROUP_SIZE):
                row = (i < d.i32(GQ * D)).select(g * (GQ * D) + i,
                                                 (i < d.i32((GQ + 1) * D)).select(Q + g * D + (i - GQ * D),
                                                                                  Q + KV + g * D + (i - (GQ + 1) * D)))
                v = d.mb_wait(mbox, t * NQKV + row, tag, budget, health, wait_code)
                d.lds_storef(lds_qkv, i, v)
            gpu.barrier()
            # q/k RMSNorm per head and RoPE; wave w handles head vectors w, w+NW, ... (GQ q heads + k)
            for hv in range(wave, GQ + 1, NW):
                vals = [d.lds_loadf(lds_qkv, hv * D + lane * DPL + j) for j in range(DPL)]
                if fx.const_expr(QK_NORM):
                    ss = d.f32(0.0)
                    for j in fx.range_constexpr(DPL):
                        ss = fx.math.fma(vals[j], vals[j], ss)
                    rstd = fx.math.rsqrt(d.warp_sum(ss) / d.f32(float(D)) + d.f32(EPS))
                    for j in fx.range_constexpr(DPL):
                        dd = lane * DPL + j
                        wq = fx.generic_load(q_norm_w + dd // 2, dtype=fx.Int32)
                        wk = fx.generic_load(k_norm_w + dd // 2, dtype=fx.Int32)
                        wsel = ((dd % 2) == d.i32(0)).select(d.bf16_lo(wq), d.bf16_hi(wq))
                        ksel = ((dd % 2) == d.i32(0)).select(d.bf16_lo(wk), d.bf16_hi(wk))
                        wn = (hv < d.i32(GQ)).select(wsel, ksel)
                        vals[j] = scale_fn(vals[j], rstd, wn)
                for j in fx.range_constexpr(DPL):
                    d.lds_storef(lds_qkv, hv * D + lane * DPL + j, vals[j])
                # rotate-half RoPE with the (cos | sin) row of this position
                roped = []
                for j in fx.range_constexpr(DPL):
                    dd = lane * DPL + j
                    i2 = dd % HALF
                    cs = fx.generic_load(cos_sin + pos * D + i2, dtype=fx.Float32)
                    sn = fx.generic_load(cos_sin + pos * D + HALF + i2, dtype=fx.Float32)
                    partner = d.lds_loadf(lds_qkv, hv * D + (dd + HALF) % D)
                    rot = (dd < d.i32(HALF)).select(d.f32(0.0) - partner, partner)
                    roped.append(d.round_bf16(vals[j] * cs + rot * sn))
                for j in fx.range_constexpr(DPL):
                    d.lds_storef(lds_qkv, hv * D + lane * DPL + j, roped[j])
            gpu.barrier()
            active = slot >= d.i32(0)
            # KV insert at the slot (bf16 pairs)
            if active & (tid < d.i32(D // 2)):
                kw = d.pack_bf16x2(d.lds_loadf(lds_qkv, GQ * D + 2 * tid), d.lds_loadf(lds_qkv, GQ * D + 2 * tid + 1))
                vw = d.pack_bf16x2(d.lds_loadf(lds_qkv, (GQ + 1) * D + 2 * tid),
                                   d.lds_loadf(lds_qkv, (GQ + 1) * D + 2 * tid + 1))
                d.store_word(key_cache, ((slot * NKV + g) * D) // 2 + tid, kw)
                d.store_word(value_cache, ((slot * NKV + g) * D) // 2 + tid, vw)
            # attention over cached positions [p0, L-1); the new position comes from LDS
            p0 = (window > d.i32(0)).select(fx.max(d.i32(0), L - window), d.i32(0))
            n_prev = fx.max(d.i32(0), L - d.i32(1) - p0)
            m = [d.f32(d.NEG_BIG) for _ in range(GQ)]
            lsum = [d.f32(0.0) for _ in range(GQ)]
            acc = [[d.f32(0.0) for _ in range(DPL)] for _ in range(GQ)]
            n_chunks = (n_prev + d.i32(WAVE_SIZE - 1)) // d.i32(WAVE_SIZE)
            for ch in range(wave, n_chunks, NW):
                p = p0 + ch * WAVE_SIZE + lane
                valid = p < L - d.i32(1)
                pc = valid.select(p, p0)
                blk = fx.generic_load(block_tables + t * bt_stride + pc // BS, dtype=fx.Int32)
                s_slot = blk * BS + pc % BS
                d.lds_store(lds_slot, wave * WAVE_SIZE + lane, s_slot)
                kbase = ((s_slot * NKV + g) * D) // 2
                sc = [d.f32(0.0) for _ in range(GQ)]
                for k8 in range(0, D // 8):
                    kv4 = d.load_words(key_cache, kbase + k8 * 4, 4)
                    for h in fx.range_constexpr(GQ):
                        q0 = d.lds_load4(lds_qkv, h * D + k8 * 8)
                        q1 = d.lds_load4(lds_qkv, h * D + k8 * 8 + 4)
                        for e in fx.range_constexpr(4):
                            qa = (q0 if e < 2 else q1)[(2 * e) % 4].bitcast(fx.Float32)
                            qb = (q0 if e < 2 else q1)[(2 * e + 1) % 4].bitcast(fx.Float32)
                            sc[h] = fx.math.fma(qa, d.bf16_lo(kv4[e]), sc[h])
                            sc[h] = fx.math.fma(qb, d.bf16_hi(kv4[e]), sc[h])
                for h in fx.range_constexpr(GQ):
                    s = valid.select(sc[h] * d.f32(SCALE), d.f32(d.NEG_BIG))
                    m_new = fx.max(m[h], d.warp_max(s))
                    corr = d.exp(m[h] - m_new)
                    pr = d.exp(s - m_new)
                    pr = valid.select(pr, d.f32(0.0))
                    lsum[h] = lsum[h] * corr + d.warp_sum(pr)
                    m[h] = m_new
                    d.lds_storef(lds_p, (wave * GQ + h) * WAVE_SIZE + lane, pr)
                    for j in fx.range_constexpr(DPL):
                        acc[h][j] = acc[h][j] * corr
                n_here = fx.min(d.i32(WAVE_SIZE), L - d.i32(1) - (p0 + ch * WAVE_SIZE))
                for i in range(0, n_here):
                    vs = d.lds_load(lds_slot, wave * WAVE_SIZE + i)
                    vbase = (vs * NKV + g) * D + lane * DPL
                    vw = d.load_word(value_cache, vbase // 2)
                    vv = []
                    for j in fx.range_constexpr(DPL):
                        if fx.const_expr(DPL == 1):
                            vv.append(((lane % 2) == d.i32(0)).select(d.bf16_lo(vw), d.bf16_hi(vw)))
                        elif fx.const_expr(j % 2 == 0):
                            vw2 = d.load_word(value_cache, vbase // 2 + j // 2)
                            vv.append(d.bf16_lo(vw2))
                        else:
                            vw2 = d.load_word(value_cache, vbase // 2 + j // 2)
                            vv.append(d.bf16_hi(vw2))
                    for h in fx.range_constexpr(GQ):
                        ph = d.lds_loadf(lds_p, (wave * GQ + h) * WAVE_SIZE + i)
                        for j in fx.range_constexpr(DPL):
                            acc[h][j] = fx.math.fma(ph, vv[j], acc[h][j])
            for h in fx.range_constexpr(GQ):
                if lane == d.i32(0):
                    d.lds_storef(lds_m, (wave * GQ + h) * 2, m[h])
                    d.lds_storef(lds_m, (wave * GQ + h) * 2 + 1, lsum[h])
                for j in fx.range_constexpr(DPL):
                    d.lds_storef(lds_acc, (wave * GQ + h) * D + lane * DPL + j, acc[h][j])
            gpu.barrier()
            # merge the waves and the new position; wave h % NW writes head h
            for h in fx.range_constexpr(GQ):
                if wave == d.i32(h % NW):
                    cur = d.f32(0.0)
                    for j in fx.range_constexpr(DPL):
                        dd = lane * DPL + j
                        cur = fx.math.fma(d.lds_loadf(lds_qkv, h * D + dd), d.lds_loadf(lds_qkv, GQ * D + dd), cur)
                    s_cur = d.warp_sum(cur) * d.f32(SCALE)
                    mx = s_cur
                    for w in fx.range_constexpr(NW):
                        mx = fx.max(mx, d.lds_loadf(lds_m, (w * GQ + h) * 2))
                    e_cur = d.exp(s_cur - mx)
                    den = e_cur
                    outs = [e_cur * d.lds_loadf(lds_qkv, (GQ + 1) * D + lane * DPL + j) for j in range(DPL)]
                    for w in fx.range_constexpr(NW):
                        f = d.exp(d.lds_loadf(lds_m, (w * GQ + h) * 2) - mx)
                        den = den + f * d.lds_loadf(lds_m, (w * GQ + h) * 2 + 1)
                        for j in fx.range_constexpr(DPL):
                            outs[j] = outs[j] + f * d.lds_loadf(lds_acc, (w * GQ + h) * D + lane * DPL + j)
                    for j in fx.range_constexpr(DPL):
                        res = active.select(outs[j] / den, d.f32(0.0))
                        oidx = t * Q + (g * GQ + h) * D + lane * DPL + j
                        d.store_bf16(out_attn, oidx, res)
            gpu.barrier()
        d.finish_launch(scratch, epoch, tid, G)

    # ------------------------------------------------------------------------------------ K2
    @flyc.kernel
    def k2_kernel(x: fx.Pointer, attn: fx.Pointer, w_o: fx.Pointer, s_o: fx.Pointer, post_attn_w: fx.Pointer,
                  mlp_norm_w: fx.Pointer, w_gu: fx.Pointer, s_gu: fx.Pointer, w_down: fx.Pointer,
                  s_down: fx.Pointer, post_mlp_w: fx.Pointer, out: fx.Pointer, scratch: fx.Pointer,
                  health: fx.Pointer, max_polls: fx.Int32, layer: fx.Int32):
        tid = gpu.thread_idx.x
        bid = gpu.block_idx.x
        wave = tid // WAVE_SIZE
        lane = tid % WAVE_SIZE
        gw = bid * NW + wave
        epoch, tag = d.launch_tag(scratch)
        mb_o = scratch + geom.mb_o
        wait_code = d.health_code(SITE_WAIT, KERNEL_K2, layer)
        bad_code = d.health_code(SITE_NONFINITE, KERNEL_K2, layer)
        mb_act = scratch + geom.mb_act
        mb_down = scratch + geom.mb_down
        chunk_words = max(og.chunk, gu.chunk, dn.chunk) // 2
        alloc = fx.SharedAllocator()
        lds_x = d.lds_words(alloc, W * chunk_words)
        lds_part = d.lds_words(alloc, part_words)
        lds_rs = d.lds_words(alloc, 3 * W)  # rstd of o (Gemma), rstd of h, rstd of down (Gemma)

        def scaled(sptr, r, v):
            if fx.const_expr(geom.fp8):
                return v * fx.generic_load(sptr + r, dtype=fx.Float32)
            return v

        # S0: O projection of attn (plain copy into LDS; attn came from K1's launch)
        def publish_o(r, sums):
            v = scaled(s_o, r, lane_pick(lane, sums[0]))
            if lane < d.i32(W):
                d.mb_put(mb_o, lane * H + r, tag, v)

        o_rs = d.buffer_rsrc(w_o)
        for c in fx.range_constexpr(og.chunks):
            c0 = c * og.chunk
            clen = min(og.chunk, Q - c0)
            if fx.const_expr(c > 0):
                gpu.barrier()
            for idx in range(tid, W * clen // 2, WORKGROUP_SIZE):
                t = idx // (clen // 2)
                kw = idx % (clen // 2)
                d.lds_store(lds_x, t * (og.chunk // 2) + kw, d.load_word(attn, (t * Q + c0) // 2 + kw))
            gpu.barrier()
            gemv_chunk(og, c, o_rs, 0, lds_x, lds_part, W, 1, 0, wave, lane, gw, GW, publish_o)

        budget = d.health_ok(health).select(max_polls, d.i32(0))

        def residual(t, k, ov, rs_o):
            """h = x + post_attn_norm(o), bf16 (the residual stream after attention)."""
            xv = d.load_word(x, (t * H + k) // 2)
            xk = ((k % 2) == d.i32(0)).select(d.bf16_lo(xv), d.bf16_hi(xv))
            if fx.const_expr(GEMMA_POST):
                pw = d.load_word(post_attn_w, k // 2)
                wk = ((k % 2) == d.i32(0)).select(d.bf16_lo(pw), d.bf16_hi(pw))
                ov = scale_fn(ov, rs_o, wk)
            return d.round_bf16(xk + ov)

        # S1: per row statistics (wave t % NW owns row t)
        for t in fx.range_constexpr(W):
            if wave == d.i32(t % NW):
                rs_o = d.f32(1.0)
                if fx.const_expr(GEMMA_POST):
                    ss = d.f32(0.0)
                    for k in range(lane, H, WAVE_SIZE):
                        ov = d.mb_wait(mb_o, t * H + k, tag, budget, health, wait_code)
                        ss = fx.math.fma(ov, ov, ss)
                    rs_o = fx.math.rsqrt(d.warp_sum(ss) / d.f32(float(H)) + d.f32(EPS))
                ss2 = d.f32(0.0)
                for k in range(lane, H, WAVE_SIZE):
                    ov = d.mb_wait(mb_o, t * H + k, tag, budget, health, wait_code)
                    hv = residual(t, k, ov, rs_o)
                    ss2 = fx.math.fma(hv, hv, ss2)
                rs_h = fx.math.rsqrt(d.warp_sum(ss2) / d.f32(float(H)) + d.f32(EPS))
                if lane == d.i32(0):
                    d.lds_storef(lds_rs, t, rs_o)
                    d.lds_storef(lds_rs, W + t, rs_h)
        gpu.barrier()

        # S2: pre-MLP-normed h in LDS -> gate|up GEMV (row pairs) -> act * up -> MB_ACT
        def publish_act(r, sums):
            gt = d.round_bf16(scaled(s_gu, r, lane_pick(lane, sums[0])))
            up = d.round_bf16(scaled(s_gu, r + I, lane_pick(lane, sums[1])))
            if fx.const_expr(GELU):
                a = d.round_bf16(d.gelu_tanh(gt))
            else:
                a = d.round_bf16(d.silu(gt))
            if lane < d.i32(W):
                d.mb_put(mb_act, lane * I + r, tag, a * up)

        gu_rs = d.buffer_rsrc(w_gu)
        for c in fx.range_constexpr(gu.chunks):
            c0 = c * gu.chunk
            clen = min(gu.chunk, H - c0)
            gpu.barrier()
            for idx in range(tid, W * clen // 2, WORKGROUP_SIZE):
                t = idx // (clen // 2)
                k = c0 + (idx % (clen // 2)) * 2
                rs_o = d.lds_loadf(lds_rs, t)
                rs_h = d.lds_loadf(lds_rs, W + t)
                nw = d.load_word(mlp_norm_w, k // 2)
                h0 = residual(t, k, d.mb_wait(mb_o, t * H + k, tag, budget, health, wait_code), rs_o)
                h1 = residual(t, k + 1, d.mb_wait(mb_o, t * H + k + 1, tag, budget, health, wait_code), rs_o)
                lo = scale_fn(h0, rs_h, d.bf16_lo(nw))
                hi = scale_fn(h1, rs_h, d.bf16_hi(nw))
                d.lds_store(lds_x, t * (gu.chunk // 2) + (k - c0) // 2, d.pack_bf16x2(lo, hi))
            gpu.barrier()
            gemv_chunk(gu, c, gu_rs, 0, lds_x, lds_part, W, 2, I, wave, lane, gw, GW, publish_act)

        # S3: act (waited) in LDS -> down GEMV -> residual (Llama/Qwen) or MB_DOWN (Gemma)
        def finish_down(r, sums):
            dv = d.round_bf16(scaled(s_down, r, lane_pick(lane, sums[0])))
            if lane < d.i32(W):
                if fx.const_expr(GEMMA_POST):
                    d.mb_put(mb_down, lane * H + r, tag, dv)
                else:
                    ov = d.mb_wait(mb_o, lane * H + r, tag, budget, health, wait_code)
                    res = d.round_bf16(residual(lane, r, ov, d.f32(1.0)) + dv)
                    if d.is_nonfinite(res):
                        d.raise_health(health, bad_code)
                    d.store_bf16(out, lane * H + r, res)

        dn_rs = d.buffer_rsrc(w_down)
        for c in fx.range_constexpr(dn.chunks):
            c0 = c * dn.chunk
            clen = min(dn.chunk, I - c0)
            gpu.barrier()
            for idx in range(tid, W * clen // 2, WORKGROUP_SIZE):
                t = idx // (clen // 2)
                k = c0 + (idx % (clen // 2)) * 2
                a0 = d.mb_wait(mb_act, t * I + k, tag, budget, health, wait_code)
                a1 = d.mb_wait(mb_act, t * I + k + 1, tag, budget, health, wait_code)
                d.lds_store(lds_x, t * (dn.chunk // 2) + (k - c0) // 2, d.pack_bf16x2(a0, a1))
            gpu.barrier()
            gemv_chunk(dn, c, dn_rs, 0, lds_x, lds_part, W, 1, 0, wave, lane, gw, GW, finish_down)

        # S4 (Gemma): post-MLP norm per row, residual add
        if fx.const_expr(GEMMA_POST):
            for t in range(bid, W, G):
                if wave == d.i32(0):
                    ss = d.f32(0.0)
                    for k in range(lane, H, WAVE_SIZE):
                        dv = d.mb_wait(mb_down, t * H + k, tag, budget, health, wait_code)
                        ss = fx.math.fma(dv, dv, ss)
                    rs_d = fx.math.rsqrt(d.warp_sum(ss) / d.f32(float(H)) + d.f32(EPS))
                    if lane == d.i32(0):
                        d.lds_storef(lds_rs, 2 * W, rs_d)
                gpu.barrier()
                rs_d = d.lds_loadf(lds_rs, 2 * W)
                rs_o = d.lds_loadf(lds_rs, t)
                for k in range(tid, H, WORKGROUP_SIZE):
                    dv = d.mb_wait(mb_down, t * H + k, tag, budget, health, wait_code)
                    pw = d.load_word(post_mlp_w, k // 2)
                    wk = ((k % 2) == d.i32(0)).select(d.bf16_lo(pw), d.bf16_hi(pw))
                    hv = residual(t, k, d.mb_wait(mb_o, t * H + k, tag, budget, health, wait_code), rs_o)
                    res = d.round_bf16(hv + scale_fn(dv, rs_d, wk))
                    if d.is_nonfinite(res):
                        d.raise_health(health, bad_code)
                    d.store_bf16(out, t * H + k, res)
                gpu.barrier()
        d.finish_launch(scratch, epoch, tid, G)

    # ------------------------------------------------------------------------------------ launchers
    @flyc.jit
    def launch_k1(x: fx.Pointer, norm_w: fx.Pointer, w_qkv: fx.Pointer, s_qkv: fx.Pointer, q_norm_w: fx.Pointer,
                  k_norm_w: fx.Pointer, cos_sin: fx.Pointer, key_cache: fx.Pointer, value_cache: fx.Pointer,
                  block_tables: fx.Pointer, seq_lens: fx.Pointer, slots: fx.Pointer, positions: fx.Pointer,
                  out_attn: fx.Pointer, scratch: fx.Pointer, health: fx.Pointer, window: fx.Int32,
                  bt_stride: fx.Int32, max_polls: fx.Int32, layer: fx.Int32, stream: fx.Stream = fx.Stream(None)):
        k1_kernel(x, norm_w, w_qkv, s_qkv, q_norm_w, k_norm_w, cos_sin, key_cache, value_cache, block_tables,
                  seq_lens, slots, positions, out_attn, scratch, health, window, bt_stride, max_polls, layer).launch(
            grid=(G,), block=(WORKGROUP_SIZE,), stream=stream)

    @flyc.jit
    def launch_k2(x: fx.Pointer, attn: fx.Pointer, w_o: fx.Pointer, s_o: fx.Pointer, post_attn_w: fx.Pointer,
                  mlp_norm_w: fx.Pointer, w_gu: fx.Pointer, s_gu: fx.Pointer, w_down: fx.Pointer,
                  s_down: fx.Pointer, post_mlp_w: fx.Pointer, out: fx.Pointer, scratch: fx.Pointer,
                  health: fx.Pointer, max_polls: fx.Int32, layer: fx.Int32, stream: fx.Stream = fx.Stream(None)):
        k2_kernel(x, attn, w_o, s_o, post_attn_w, mlp_norm_w, w_gu, s_gu, w_down, s_down, post_mlp_w, out,
                  scratch, health, max_polls, layer).launch(grid=(G,), block=(WORKGROUP_SIZE,), stream=stream)

    return launch_k1, launch_k2

