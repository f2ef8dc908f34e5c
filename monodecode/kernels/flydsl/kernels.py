"""FlyDSL K1 and K2 of a dense decoder layer: the shared plan's stages, in wave64 CDNA code.

One specialisation per (arch, dims, width, weight dtype, block size); every count, offset and
region comes from ``geometry.Geometry``, i.e. from ``kernels/plan.py`` (the same plan, stages and
tagged-mailbox protocol as ``kernels/triton``). Task ``t`` of a stage runs on workgroup
``(t + offset) % G``; a workgroup runs its tasks of stage 0, then of stage 1, ...; a task only
waits on words of earlier stages, so there is no grid barrier and no deadlock while all ``G``
workgroups (one per CU) are resident.

Side by side with ``monodecode/model/reference.py``:

K1 (``x`` -> ``attn_out``)
  qkv      GEMV task = ``rows`` outputs of       h = rms_norm(x, attn_norm); q|k|v = W_qkv h
           W_qkv for every row of the step;      (bf16 each)
           x normed into LDS, published as
           tagged words -> region ``qkv``
  attn     task = (row, KV head, context split): q/k = rms_norm(., q/k_norm) (qk_norm models);
           waits for the group's q, k, v words;  RoPE (rotate-half, bf16 cos/sin); K,V written
           q/k-norm, RoPE; the split holding the at the slot; softmax(q.K^T * scale) V over
           newest position writes K/V to the      positions j < seq_len (and j > pos - window on
           cache; online softmax over its slice   sliding layers); padded rows (slot -1): zeros
           -> unnormalised (m, l, acc) words
           -> regions ``attn_ml``, ``attn_acc``
  combine  task = (row, query head): merges the  out = sum_s e^(m_s-M) acc_s / sum_s e^(m_s-M) l_s
           splits -> ``attn_out`` (bf16)
K2 (``x``, ``attn_out`` -> ``x_out``)
  o_proj   GEMV of attn_out -> ``o`` (fp32,      o = W_o attn
           TP: pushed to every peer, ``o_peer``)
  post     task = row: (TP: sum of the ranks'   Gemma: o = rms_norm(o, attn_post_norm);
           partials in rank order, fp32) ->     h = x + o; hn = rms_norm(h, mlp_norm)
           ``h``, ``hn``
  gate_up  GEMV of hn, gate and up rows in one  a = bf16(act(bf16 gate)) * bf16(up)
           pass -> ``act``
  down     GEMV of act; without a final stage   d = W_down a; Llama/Qwen: x_out = h + d
           adds h and writes x_out, else ``d``
  final    task = row (Gemma or TP): sums the   Gemma: d = rms_norm(d, mlp_post_norm);
           partials, norm, residual -> x_out    x_out = h + d

K/V are addressed through the cache's block / token / head strides, passed at launch
(``kv.py``), so one code object serves the reference's contiguous cache and vLLM's interleaved
K|V views alike.

An expired wait stores ``health_code(wait_timeout, k1|k2, layer)``, a non-finite output
``health_code(nonfinite, k2, layer)`` in the sticky health word (the plan's header region).
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu, rocdl

from monodecode.kernels.flydsl import device as d
from monodecode.kernels.flydsl.arch import WAVE_SIZE, WAVES_PER_WORKGROUP, WORKGROUP_SIZE
from monodecode.kernels.flydsl.geometry import (
    ATTN_CHUNK,
    MFMA_ROWS,
    NEG_BIG,
    GemvTile,
    Geometry,
    first_task,
    mfma_k_elem,
    mfma_lane,
    mfma_part,
    mfma_weight_row,
)
from monodecode.kernels.flydsl.kv import kv_word
from monodecode.kernels.plan import K1, K2
from monodecode.model.dims import ModelDims

NW = WAVES_PER_WORKGROUP
WG = WORKGROUP_SIZE
BATCH = 4  # mailbox word pairs a thread stages per round trip (loads in flight)

# Health sites and kernel ids of monodecode.kernels.base.health_code.
SITE_WAIT, SITE_NONFINITE = 1, 2
KERNEL_K1, KERNEL_K2 = 1, 2


def make_kernels(dims: ModelDims, geom: Geometry, block_size: int):
    """Build the K1 / K2 launchers for one specialisation (closures bake the constants in)."""
    W, G = geom.width, geom.grid
    H, I, D, GQ, KVH, HEADS, S = (
        geom.hidden,
        geom.intermediate,
        geom.head_dim,
        geom.group,
        geom.kv_heads,
        geom.heads,
        geom.attn_splits,
    )
    Q, KV, NQKV = geom.q, geom.kv, geom.qkv
    EPS, SCALE = float(dims.rms_norm_eps), float(dims.attn_scale)
    QK_NORM, POST_NORMS, FP8 = dims.qk_norm, geom.post_norms, geom.fp8
    GELU = dims.activation == "gelu_tanh"
    SPLIT_BATCH = min(S, 4)  # combine: attention splits merged per round trip (S is a power of two)
    ROW_BATCH = max(1, 4 // geom.tp_size)  # post/final: columns per round trip (x TP partial words each)
    FINAL = geom.final
    BS = block_size
    ARCH = geom.arch
    DPL = D // WAVE_SIZE  # head dims per lane
    HALF = D // 2
    RG = geom.regions  # word offsets in this width's scratch segment
    L1, L2 = geom.lds1, geom.lds2
    norm = d.norm_scale(dims.norm_one_plus)
    st_qkv, st_attn, st_comb = geom.stage(K1, "qkv"), geom.stage(K1, "attn"), geom.stage(K1, "combine")
    st_o, st_post = geom.stage(K2, "o_proj"), geom.stage(K2, "post")
    st_gu, st_dn = geom.stage(K2, "gate_up"), geom.stage(K2, "down")
    st_fin = geom.stage(K2, "final") if FINAL else None
    TP = geom.tp_size
    PRG = geom.peer_regions  # TP: o_peer / d_peer word offsets in a rank's peer-buffer segment

    # ------------------------------------------------------------------------------ GEMV task
    def gemv_task(tl: GemvTile, t, w_rs, lds, x_off: int, part_off: int, tid, wave, lane, stage_chunk, finish):
        """Task ``t`` of a GEMV stage: rows [t*rows, t*rows + rows) of y[W, N] = x[W, K] . Wt[N, K]^T
        (gate|up: the same rows of both matrices). ``stage_chunk(c0)`` stages the input rows'
        elements [c0, c0 + chunk) in LDS as bf16; ``finish(row, token, values, valid)`` gets each
        output (``values``: one per matrix) on some thread, ``valid`` false for padding."""
        st = tl.stage
        if tl.mfma:
            return _gemv_mfma(
                t,
                w_rs,
                lds,
                tid,
                wave,
                lane,
                stage_chunk,
                finish,
                st.n,
                st.k,
                st.rows,
                tl.pair,
                tl.vec,
                tl.chunk,
                tl.x_stride,
                tl.chunks,
                tl.k_pad,
                tl.kblock,
                tl.k_split,
                tl.tiles * tl.k_split // NW,
                tl.tiles,
                x_off,
                part_off,
            )
        return _gemv_fma(
            t,
            w_rs,
            lds,
            wave,
            lane,
            stage_chunk,
            finish,
            st.n,
            st.k,
            st.rows,
            tl.rows_per_wave,
            tl.row_group,
            tl.pair,
            tl.vec,
            tl.step,
            tl.chunk,
            tl.x_stride,
            tl.chunks,
            tl.k_pad,
            x_off,
            part_off,
        )

    def weight_byte(row, n: int, k: int, p: int, kg):
        """Byte offset of weight element (row + p*n, kg): gate|up rows are stacked, 2I x K."""
        return ((row + d.i32(p * n)) * d.i32(k) + kg) * d.i32(1 if FP8 else 2)

    def _fma_weights(w_rs, row0, c0, s, lane, N, K, R, GR, PR, VEC, STEP, KPAD):
        """Step ``s`` of chunk ``c0``: this lane's 16 weight bytes of each row of the group at row0."""
        kg = c0 + s * d.i32(STEP) + lane * d.i32(VEC)
        if KPAD != K:  # lanes past K read a valid weight; their LDS input is 0
            kg = fx.min(kg, d.i32(K - VEC))
        wv = []
        for i in range(GR):
            row = row0 + d.i32(i)
            if N % R != 0:  # the last task's rows past N read row N-1
                row = fx.min(row, d.i32(N - 1))
            for p in range(PR):
                wv.append(d.load_weights16(w_rs, weight_byte(row, N, K, p, kg)))
        return wv

    def _fma_step(lds, wv, s, lane, accs, GR, PR, VEC, STEP, XS, x_off):
        """accs[j * W + tk] += weights j . token tk's staged inputs for step ``s`` of the chunk."""
        kl = s * d.i32(STEP) + lane * d.i32(VEC)  # element inside the chunk
        for tk in range(W):
            xa = d.lds_load4(lds, d.i32(x_off + tk * XS) + kl // d.i32(2))
            if VEC == 16:
                xb = d.lds_load4(lds, d.i32(x_off + tk * XS + 4) + kl // d.i32(2))
            for j in range(GR * PR):
                if VEC == 8:
                    accs[j * W + tk] = d.dot_bf16(wv[j], xa, accs[j * W + tk])
                else:
                    accs[j * W + tk] = d.dot_fp8(wv[j], xa, xb, accs[j * W + tk])
        return accs

    @d.device
    def _gemv_fma(
        t,
        w_rs,
        lds,
        wave,
        lane,
        stage_chunk,
        finish,
        N,
        K,
        R,
        RPW,
        GR,
        PR,
        VEC,
        STEP,
        CK,
        XS,
        NCH,
        KPAD,
        x_off,
        part_off,
    ):
        """Narrow steps: lanes split K (16 bytes of weights each per step), waves split the rows.
        The task's first weights (chunk 0, row group 0, step 0) are loaded before its inputs are
        staged, so they stream in while ``stage_chunk`` waits for the producers' words."""
        n0 = t * d.i32(R)
        first = _fma_weights(w_rs, n0 + wave * d.i32(RPW), d.i32(0), d.i32(0), lane, N, K, R, GR, PR, VEC, STEP, KPAD)
        for c_ in range(NCH):
            c = d.i32(c_)
            c0 = c * d.i32(CK)
            gpu.barrier()  # the previous chunk (or task, or stage) is done with the LDS
            stage_chunk(c0)
            gpu.barrier()
            nsteps = fx.min(d.i32(CK), d.i32(KPAD) - c0) // d.i32(STEP)
            for grp_ in range(RPW // GR):
                grp = d.i32(grp_)
                row0 = n0 + wave * d.i32(RPW) + grp * d.i32(GR)
                # step 0 peeled: the weights loaded up front, or this group's own
                wv0 = first
                if (c != d.i32(0)) | (grp != d.i32(0)):
                    wv0 = _fma_weights(w_rs, row0, c0, d.i32(0), lane, N, K, R, GR, PR, VEC, STEP, KPAD)
                accs = _fma_step(
                    lds, wv0, d.i32(0), lane, [d.f32(0.0) for _ in range(GR * PR * W)], GR, PR, VEC, STEP, XS, x_off
                )
                for s_ in range(d.i32(1), nsteps, d.i32(1), unroll=2):
                    s = d.i32(s_)
                    wv = _fma_weights(w_rs, row0, c0, s, lane, N, K, R, GR, PR, VEC, STEP, KPAD)
                    accs = _fma_step(lds, wv, s, lane, accs, GR, PR, VEC, STEP, XS, x_off)
                sums = [d.warp_sum(a) for a in accs]
                if fx.const_expr(NCH > 1):
                    slot = d.i32(part_off) + (wave * d.i32(RPW) + grp * d.i32(GR)) * d.i32(PR * W)
                    if c > d.i32(0):
                        sums = [sums[j] + d.lds_loadf(lds, slot + d.i32(j)) for j in range(GR * PR * W)]
                    if (c < d.i32(NCH - 1)) & (lane == d.i32(0)):
                        for j in fx.range_constexpr(GR * PR * W):
                            d.lds_storef(lds, slot + d.i32(j), sums[j])
                if c == d.i32(NCH - 1):
                    for i in fx.range_constexpr(GR):  # lane t < W takes token t's sums (wave-uniform)
                        vals = [d.lane_pick(lane, [sums[(i * PR + p) * W + tk] for tk in range(W)]) for p in range(PR)]
                        finish(row0 + d.i32(i), lane, vals, lane < d.i32(W))

    def _mfma_weights(w_rs, n0, tg, rin, kq, b, c0, N, K, R, PR, VEC, KPAD, TW):
        """This lane's 16 weight bytes of K block ``b`` of chunk ``c0`` for each of the wave's tiles."""
        kg = c0 + mfma_k_elem(b, kq, VEC)
        if KPAD != K:
            kg = fx.min(kg, d.i32(K - VEC))
        wv = []
        for j in range(TW):
            tile = tg * d.i32(TW) + d.i32(j)
            rin_ = rin
            if N % R != 0:  # the last task's rows past N read row N-1
                rin_ = fx.min(rin, d.i32(N - 1) - n0 - (tile // d.i32(PR)) * d.i32(MFMA_ROWS))
            row = mfma_weight_row(n0, tile, rin_, PR, N)
            wv.append(d.load_weights16(w_rs, (row * d.i32(K) + kg) * d.i32(1 if FP8 else 2)))
        return wv

    def _mfma_block(lds, wv, b, kq, tok, accs, VEC, XS, TW, x_off):
        """accs[j] += tile j's weights (``wv[j]``) . the staged inputs of K block ``b``."""
        kl = mfma_k_elem(b, kq, VEC)  # element inside the chunk
        xa = d.lds_load4(lds, d.i32(x_off) + tok * d.i32(XS) + kl // d.i32(2))
        xb = xa
        if VEC == 16:
            xb = d.lds_load4(lds, d.i32(x_off + 4) + tok * d.i32(XS) + kl // d.i32(2))
        return [d.mfma_tile(ARCH, wv[j], xa, xb, accs[j], VEC == 16) for j in range(TW)]

    @d.device
    def _gemv_mfma(
        t,
        w_rs,
        lds,
        tid,
        wave,
        lane,
        stage_chunk,
        finish,
        N,
        K,
        R,
        PR,
        VEC,
        CK,
        XS,
        NCH,
        KPAD,
        KB,
        KS,
        TW,
        NT,
        x_off,
        part_off,
    ):
        """Wide steps: 16x16 MFMA tiles, A = 16 weight rows (lane l: row l % 16), B = 16 token
        columns (lane l: token l % 16, padded columns read a real row and are dropped), both with
        the same 16 K-bytes per lane (lane l: K group l // 16), so each 16-byte weight load feeds
        the tile directly. The waves split the tiles (``TW`` each) and, with fewer than 4 tiles,
        K blocks (``KS`` ways); the tiles meet in LDS, where the epilogue adds the K splits in a
        fixed order (same bits every run). The wave's first weights are loaded before its inputs
        are staged, so they stream in while ``stage_chunk`` waits for the producers' words."""
        n0 = t * d.i32(R)
        ks = wave % d.i32(KS)
        tg = wave // d.i32(KS)
        rin, kq = mfma_lane(lane)
        tok = fx.min(rin, d.i32(W - 1))
        accs = [d.mfma_zero() for _ in range(TW)]
        # this wave's first K block of chunk 0, loaded before the inputs are staged (waited for)
        first = _mfma_weights(w_rs, n0, tg, rin, kq, ks, d.i32(0), N, K, R, PR, VEC, KPAD, TW)
        for c_ in range(NCH):
            c = d.i32(c_)
            c0 = c * d.i32(CK)
            gpu.barrier()
            stage_chunk(c0)
            gpu.barrier()
            nblk = fx.min(d.i32(CK), d.i32(KPAD) - c0) // d.i32(KB)
            b_start = ks
            if (c == d.i32(0)) & (ks < nblk):  # block ks of chunk 0 peeled: its weights are in already
                accs = _mfma_block(lds, first, ks, kq, tok, accs, VEC, XS, TW, x_off)
                b_start = ks + d.i32(KS)
            for b_ in range(b_start, nblk, d.i32(KS)):
                b = d.i32(b_)
                wv = _mfma_weights(w_rs, n0, tg, rin, kq, b, c0, N, K, R, PR, VEC, KPAD, TW)
                accs = _mfma_block(lds, wv, b, kq, tok, accs, VEC, XS, TW, x_off)
        for j in fx.range_constexpr(TW):  # lane l holds rows 4*(l // 16) + e of token l % 16
            tile = tg * d.i32(TW) + d.i32(j)
            if rin < d.i32(W):
                for e in fx.range_constexpr(4):
                    at = mfma_part(ks, tile, kq * d.i32(4) + d.i32(e), rin, NT, W)
                    d.lds_storef(lds, d.i32(part_off) + at, accs[j][e])
        gpu.barrier()
        for idx_ in range(tid, d.i32(R * W), d.i32(WG)):
            idx = d.i32(idx_)
            rr = idx // d.i32(W)
            tk = idx - rr * d.i32(W)
            vals = []
            for p in fx.range_constexpr(PR):
                tile = (rr // d.i32(MFMA_ROWS)) * d.i32(PR) + d.i32(p)
                v = d.f32(0.0)
                for kk in fx.range_constexpr(KS):
                    v = v + d.lds_loadf(
                        lds, d.i32(part_off) + mfma_part(d.i32(kk), tile, rr % d.i32(MFMA_ROWS), tk, NT, W)
                    )
                vals.append(v)
            finish(n0 + rr, tk, vals, tk >= d.i32(0))

    def scaled(sptr, row, v):
        """FP8 weights: the per-output-channel scale applies to the fp32 dot (Linear.__call__)."""
        if FP8:
            return v * d.load_f32(sptr, row)
        return v

    @d.device
    def _put(mbox, tag, tok, region, n, row, v, enable):
        """Publish output ``row`` of token ``tok`` into a (W, n) region (rows past n are padding)."""
        if enable & (row < d.i32(n)):
            d.mb_put(mbox, d.i32(region) + tok * d.i32(n) + row, tag, v)

    @d.device
    def _push(peers, rank, tag, tok, region: int, row, v, enable):
        """TP: token ``tok``'s partial of output ``row`` into slot ``rank`` of every rank's peer
        buffer (system scope: other GPUs read it)."""
        if enable & (row < d.i32(H)):
            at = d.i32(region) + (rank * d.i32(W) + tok) * d.i32(H) + row
            for q in fx.range_constexpr(TP):
                d.mb_put(d.peer_buffer(peers, d.i32(q)), at, tag, v, None)

    @d.device
    def _sum_ranks(mine, region: int, r, k, tag, polls, health, code):
        """TP: the ranks' partials of (row r, column k) summed in rank order in fp32, so every
        rank gets the same bits."""
        tot = d.f32(0.0)
        for q in fx.range_constexpr(TP):
            tot = tot + d.mb_wait(mine, d.i32(region + q * W * H) + r * d.i32(H) + k, tag, polls, health, code, None)
        return tot

    # ------------------------------------------------------------------------------------ K1
    @flyc.kernel
    def k1_kernel(
        x: fx.Pointer,
        norm_w: fx.Pointer,
        w_qkv: fx.Pointer,
        s_qkv: fx.Pointer,
        q_norm_w: fx.Pointer,
        k_norm_w: fx.Pointer,
        cos_sin: fx.Pointer,
        key_cache: fx.Pointer,
        value_cache: fx.Pointer,
        block_tables: fx.Pointer,
        seq_lens: fx.Pointer,
        slots: fx.Pointer,
        positions: fx.Pointer,
        out_attn: fx.Pointer,
        mbox: fx.Pointer,
        health: fx.Pointer,
        window: fx.Int32,
        bt_stride: fx.Int32,
        k_block_stride: fx.Int32,
        k_token_stride: fx.Int32,
        k_head_stride: fx.Int32,
        v_block_stride: fx.Int32,
        v_token_stride: fx.Int32,
        v_head_stride: fx.Int32,
        max_polls: fx.Int32,
        layer: fx.Int32,
        stall: fx.Int32,
    ):
        tid = fx.Int32(gpu.thread_idx.x)
        bid = fx.Int32(gpu.block_idx.x)
        wave = d.uniform(tid // WAVE_SIZE)
        lane = tid % WAVE_SIZE
        epoch = mbox + RG["epoch_k1"]
        tag = d.launch_tag(epoch, G)
        polls = d.health_ok(health).select(max_polls, d.i32(0))  # a failed step waits no more
        wait_code = d.health_code(SITE_WAIT, KERNEL_K1, layer)
        lds = d.lds_arena(fx.SharedAllocator(), L1["words"])

        # ---- qkv: rstd of every row of x, then the normed rows chunk by chunk into LDS
        first = first_task(bid, st_qkv.offset, G)
        if first < d.i32(st_qkv.tasks):
            for tk_ in range(wave, d.i32(W), d.i32(NW)):
                tk = d.i32(tk_)
                ss = d.f32(0.0)
                for kw_ in range(lane, d.i32(H // 2), d.i32(WAVE_SIZE)):
                    kw = d.i32(kw_)
                    xw = d.load_word(x, tk * (H // 2) + kw)
                    ss = fx.math.fma(d.bf16_lo(xw), d.bf16_lo(xw), ss)
                    ss = fx.math.fma(d.bf16_hi(xw), d.bf16_hi(xw), ss)
                tot = d.warp_sum(ss)
                if lane == d.i32(0):
                    d.lds_storef(lds, d.i32(L1["rstd"]) + tk, d.rsqrt_mean(tot, H, EPS))
            gpu.barrier()
        tile = geom.tiles["qkv"]
        w_rs = d.buffer_rsrc(w_qkv)

        def stage_x(c0):
            _stage_normed(x, norm_w, lds, tid, c0, tile.chunk_words, tile.x_stride, H)

        def publish_qkv(row, tok, vals, valid):
            v = d.round_bf16(scaled(s_qkv, fx.min(row, d.i32(NQKV - 1)), vals[0]))
            _put(mbox, tag, tok, RG["qkv"], NQKV, row, v, valid & (stall == d.i32(0)))

        for t_ in range(first, d.i32(st_qkv.tasks), d.i32(G)):
            gemv_task(tile, d.i32(t_), w_rs, lds, L1["x"], L1["part"], tid, wave, lane, stage_x, publish_qkv)
        gpu.barrier()

        # ---- attn: (row, KV head, split) partials
        for t_ in range(first_task(bid, st_attn.offset, G), d.i32(st_attn.tasks), d.i32(G)):
            _attn_task(
                d.i32(t_),
                mbox,
                tag,
                polls,
                health,
                wait_code,
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
                (k_block_stride, k_token_stride, k_head_stride),
                (v_block_stride, v_token_stride, v_head_stride),
            )

        # ---- combine: merge each query head's splits -> attn_out (bf16)
        for t_ in range(first_task(bid, st_comb.offset, G), d.i32(st_comb.tasks), d.i32(G)):
            _combine_task(d.i32(t_), mbox, tag, polls, health, wait_code, tid, out_attn)

        d.finish_launch(epoch, tid)

    @d.device
    def _stage_normed(x, norm_w, lds, tid, c0, ckw: int, xs: int, k: int):
        """Rows of x (bf16 pairs) normed with their rstd and the norm weight, into LDS (0 past k)."""
        for idx_ in range(tid, d.i32(W * ckw), d.i32(WG), unroll=4):
            idx = d.i32(idx_)
            tk = idx // d.i32(ckw)
            kk = c0 + (idx - tk * d.i32(ckw)) * d.i32(2)
            word = d.i32(0)
            if kk < d.i32(k):
                xw = d.load_word(x, (tk * d.i32(k) + kk) // d.i32(2))
                nw = d.load_word(norm_w, kk // d.i32(2))
                rs = d.lds_loadf(lds, d.i32(L1["rstd"]) + tk)
                word = d.pack_bf16x2(norm(d.bf16_lo(xw), rs, d.bf16_lo(nw)), norm(d.bf16_hi(xw), rs, d.bf16_hi(nw)))
            d.lds_store(lds, d.i32(L1["x"]) + idx + tk * d.i32(xs - ckw), word)

    @d.device
    def _attn_task(
        t,
        mbox,
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
        r = t // d.i32(KVH * S)
        g = (t // d.i32(S)) % d.i32(KVH)
        s = t % d.i32(S)
        pos = d.load_word(positions, r * 2)  # low word of the int64 position / slot
        slot = d.load_word(slots, r * 2)
        seq = d.load_word(seq_lens, r)
        live = slot >= d.i32(0)
        vec = d.i32(L1["qkv_vec"])

        # q of the group's heads, k and v of KV head g (tagged words of the qkv stage)
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
        got = d.mb_wait_all(mbox, ats, oks, tag, polls, health, code)
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
                    d.mb_put(mbox, d.i32(RG["attn_acc"] + j) + hrow * d.i32(D) + lane * d.i32(DPL), tag, outs[j])
                if lane == d.i32(0):
                    d.mb_put(mbox, d.i32(RG["attn_ml"]) + hrow * d.i32(2), tag, mx)
                    d.mb_put(mbox, d.i32(RG["attn_ml"] + 1) + hrow * d.i32(2), tag, den)
        gpu.barrier()  # the next task reuses the LDS

    @d.device
    def _combine_task(t, mbox, tag, polls, health, code, tid, out_attn):
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
                got = d.mb_wait_all(mbox, ats, [tid >= d.i32(0)] * len(ats), tag, polls, health, code)
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

    # ------------------------------------------------------------------------------------ K2
    @flyc.kernel
    def k2_kernel(
        x: fx.Pointer,
        attn: fx.Pointer,
        w_o: fx.Pointer,
        s_o: fx.Pointer,
        post_attn_w: fx.Pointer,
        mlp_norm_w: fx.Pointer,
        w_gu: fx.Pointer,
        s_gu: fx.Pointer,
        w_down: fx.Pointer,
        s_down: fx.Pointer,
        post_mlp_w: fx.Pointer,
        out: fx.Pointer,
        mbox: fx.Pointer,
        health: fx.Pointer,
        peers: fx.Pointer,
        max_polls: fx.Int32,
        layer: fx.Int32,
        nan_fault: fx.Int32,
        rank: fx.Int32,
    ):
        tid = fx.Int32(gpu.thread_idx.x)
        bid = fx.Int32(gpu.block_idx.x)
        wave = d.uniform(tid // WAVE_SIZE)
        lane = tid % WAVE_SIZE
        epoch = mbox + RG["epoch_k2"]
        tag = d.launch_tag(epoch, G)
        polls = d.health_ok(health).select(max_polls, d.i32(0))
        wait_code = d.health_code(SITE_WAIT, KERNEL_K2, layer)
        bad_code = d.health_code(SITE_NONFINITE, KERNEL_K2, layer)
        lds = d.lds_arena(fx.SharedAllocator(), L2["words"])
        o_region = RG["o"] if TP == 1 else PRG["o_peer"]
        d_region = (RG["d"] if TP == 1 else PRG["d_peer"]) if FINAL else 0
        mine = d.peer_buffer(peers, rank) if TP > 1 else mbox  # this rank's peer-buffer segment

        # ---- o_proj: attn_out (K1's bf16 output) staged as is
        t_o = geom.tiles["o_proj"]
        o_rs = d.buffer_rsrc(w_o)

        def stage_attn(c0):
            _stage_plain(attn, lds, tid, c0, t_o.chunk_words, t_o.x_stride, Q)

        def publish_o(row, tok, vals, valid):
            v = scaled(s_o, fx.min(row, d.i32(H - 1)), vals[0])
            if fx.const_expr(TP == 1):
                _put(mbox, tag, tok, o_region, H, row, v, valid)
            else:
                _push(peers, rank, tag, tok, o_region, row, v, valid)

        for t_ in range(first_task(bid, st_o.offset, G), d.i32(st_o.tasks), d.i32(G)):
            gemv_task(t_o, d.i32(t_), o_rs, lds, L2["x"], L2["part"], tid, wave, lane, stage_attn, publish_o)
        gpu.barrier()

        # ---- post: h = x + (post-attn norm)(o), hn = mlp_norm(h)
        for r_ in range(first_task(bid, st_post.offset, G), d.i32(st_post.tasks), d.i32(G)):
            _post_task(
                d.i32(r_),
                x,
                post_attn_w,
                mlp_norm_w,
                mbox,
                mine,
                tag,
                polls,
                health,
                wait_code,
                lds,
                tid,
                wave,
                lane,
                o_region,
            )

        # ---- gate_up: hn (waited) staged in LDS, gate and up rows together, activation
        t_gu = geom.tiles["gate_up"]
        gu_rs = d.buffer_rsrc(w_gu)

        def stage_hn(c0):
            _stage_words(
                mbox, RG["hn"], tag, polls, health, wait_code, lds, tid, c0, t_gu.chunk_words, t_gu.x_stride, H
            )

        def publish_act(row, tok, vals, valid):
            srow = fx.min(row, d.i32(I - 1))
            gt = d.round_bf16(scaled(s_gu, srow, vals[0]))
            up = d.round_bf16(scaled(s_gu, srow + d.i32(I), vals[1]))
            a = d.round_bf16(d.gelu_tanh(gt) if GELU else d.silu(gt))
            _put(mbox, tag, tok, RG["act"], I, row, d.round_bf16(a * up), valid)

        for t_ in range(first_task(bid, st_gu.offset, G), d.i32(st_gu.tasks), d.i32(G)):
            gemv_task(t_gu, d.i32(t_), gu_rs, lds, L2["x"], L2["part"], tid, wave, lane, stage_hn, publish_act)
        gpu.barrier()

        # ---- down: act (waited) staged in LDS; residual here, or a final stage
        t_dn = geom.tiles["down"]
        dn_rs = d.buffer_rsrc(w_down)

        def stage_act(c0):
            _stage_words(
                mbox, RG["act"], tag, polls, health, wait_code, lds, tid, c0, t_dn.chunk_words, t_dn.x_stride, I
            )

        def finish_down(row, tok, vals, valid):
            v = scaled(s_down, fx.min(row, d.i32(H - 1)), vals[0])
            if fx.const_expr(TP > 1):
                _push(peers, rank, tag, tok, d_region, row, v, valid)
            elif fx.const_expr(FINAL):
                _put(mbox, tag, tok, d_region, H, row, v, valid)
            else:
                _residual_out(mbox, tag, polls, health, wait_code, bad_code, out, tok, row, v, nan_fault, valid)

        for t_ in range(first_task(bid, st_dn.offset, G), d.i32(st_dn.tasks), d.i32(G)):
            gemv_task(t_dn, d.i32(t_), dn_rs, lds, L2["x"], L2["part"], tid, wave, lane, stage_act, finish_down)

        # ---- final (Gemma post-MLP norm): x_out = h + norm(d)
        if fx.const_expr(FINAL):
            gpu.barrier()
            for r_ in range(first_task(bid, st_fin.offset, G), d.i32(st_fin.tasks), d.i32(G)):
                _final_task(
                    d.i32(r_),
                    post_mlp_w,
                    out,
                    mbox,
                    mine,
                    tag,
                    polls,
                    health,
                    wait_code,
                    bad_code,
                    lds,
                    tid,
                    wave,
                    lane,
                    d_region,
                    nan_fault,
                )

        d.finish_launch(epoch, tid)

    @d.device
    def _stage_plain(src, lds, tid, c0, ckw: int, xs: int, k: int):
        """Rows of a bf16 launch input into LDS as they are (0 past k)."""
        for idx_ in range(tid, d.i32(W * ckw), d.i32(WG), unroll=4):
            idx = d.i32(idx_)
            tk = idx // d.i32(ckw)
            kk = c0 + (idx - tk * d.i32(ckw)) * d.i32(2)
            word = d.i32(0)
            if kk < d.i32(k):
                word = d.load_word(src, (tk * d.i32(k) + kk) // d.i32(2))
            d.lds_store(lds, d.i32(L2["x"]) + idx + tk * d.i32(xs - ckw), word)

    @d.device
    def _stage_words(mbox, region: int, tag, polls, health, code, lds, tid, c0, ckw: int, xs: int, k: int):
        """Rows of a mailbox region (waited for, values already bf16) into LDS as bf16 pairs,
        BATCH pairs per thread per round trip."""
        for base_ in range(tid, d.i32(W * ckw), d.i32(WG * BATCH)):
            base = d.i32(base_)
            ats, oks = [], []
            for u in fx.range_constexpr(BATCH):
                idx = base + d.i32(u * WG)
                tk = idx // d.i32(ckw)
                kk = c0 + (idx - tk * d.i32(ckw)) * d.i32(2)
                ok = (idx < d.i32(W * ckw)) & (kk < d.i32(k))
                at = ok.select(d.i32(region) + tk * d.i32(k) + kk, d.i32(region))
                ats += [at, at + d.i32(1)]
                oks += [ok, ok]
            vals = d.mb_wait_all(mbox, ats, oks, tag, polls, health, code)
            for u in fx.range_constexpr(BATCH):
                idx = base + d.i32(u * WG)
                tk = idx // d.i32(ckw)
                if idx < d.i32(W * ckw):
                    word = oks[2 * u].select(d.pack_bf16x2(vals[2 * u], vals[2 * u + 1]), d.i32(0))
                    d.lds_store(lds, d.i32(L2["x"]) + idx + tk * d.i32(xs - ckw), word)

    @d.device
    def _residual_out(mbox, tag, polls, health, code, bad_code, out, tok, row, v, nan_fault, enable):
        """x_out = bf16(h + bf16(d)) for token ``tok``, checked for non-finite values."""
        if enable & (row < d.i32(H)):
            hv = d.mb_wait(mbox, d.i32(RG["h"]) + tok * d.i32(H) + row, tag, polls, health, code)
            res = d.round_bf16(hv + d.round_bf16(v))
            if (nan_fault != d.i32(0)) & (tok == d.i32(0)) & (row == d.i32(0)):
                res = d.f32(float("nan"))
            if d.is_nonfinite(res):
                d.raise_health(health, bad_code)
            d.store_bf16(out, tok * d.i32(H) + row, res)

    def _cols(k0):
        """The ROW_BATCH columns a thread takes per round trip in a per-row stage, and which exist."""
        ks = [k0 + d.i32(u * WG) for u in range(ROW_BATCH)]
        oks = [k < d.i32(H) for k in ks]
        return [ok.select(k, d.i32(0)) for k, ok in zip(ks, oks)], oks

    def _o_values(mbox, mine, region: int, r, ks, oks, tag, polls, health, code):
        """o[r, k] for the columns ``ks`` as the reference has it: bf16 of the projection (TP: of
        the ranks' partials summed in rank order, fp32, so every rank gets the same bits)."""
        if TP == 1:
            vals = d.mb_wait_all(mbox, [d.i32(region) + r * d.i32(H) + k for k in ks], oks, tag, polls, health, code)
            return [d.round_bf16(v) for v in vals]
        ats = [d.i32(region + q * W * H) + r * d.i32(H) + k for k in ks for q in range(TP)]
        vals = d.mb_wait_all(mine, ats, [ok for ok in oks for _ in range(TP)], tag, polls, health, code, None)
        out = []
        for u in range(len(ks)):
            tot = d.f32(0.0)
            for q in range(TP):
                tot = tot + vals[u * TP + q]
            out.append(d.round_bf16(tot))
        return out

    def _weight(w_ptr, k):
        return d.bf16_half(d.load_word(w_ptr, k // d.i32(2)), k % d.i32(2))

    @d.device
    def _post_task(r, x, post_w, mlp_w, mbox, mine, tag, polls, health, code, lds, tid, wave, lane, o_region: int):
        """Row r: h = x + (post-attn norm)(o) and hn = mlp_norm(h), both published."""
        red = L2["red"]
        rs_o = d.f32(1.0)
        if fx.const_expr(POST_NORMS):
            ss = d.f32(0.0)
            for k_ in range(tid, d.i32(H), d.i32(WG * ROW_BATCH)):
                ks, oks = _cols(d.i32(k_))
                os_ = _o_values(mbox, mine, o_region, r, ks, oks, tag, polls, health, code)
                for u in fx.range_constexpr(ROW_BATCH):
                    ov = oks[u].select(os_[u], d.f32(0.0))
                    ss = fx.math.fma(ov, ov, ss)
            rs_o = d.rsqrt_mean(d.block_sum(ss, lds, red, wave, lane, NW), H, EPS)
        ss_h = d.f32(0.0)
        for k_ in range(tid, d.i32(H), d.i32(WG * ROW_BATCH)):
            ks, oks = _cols(d.i32(k_))
            os_ = _o_values(mbox, mine, o_region, r, ks, oks, tag, polls, health, code)
            for u in fx.range_constexpr(ROW_BATCH):
                o = os_[u]
                if fx.const_expr(POST_NORMS):
                    o = norm(o, rs_o, _weight(post_w, ks[u]))
                hv = d.round_bf16(_weight(x, r * d.i32(H) + ks[u]) + o)
                if oks[u]:
                    d.mb_put(mbox, d.i32(RG["h"]) + r * d.i32(H) + ks[u], tag, hv)
                hv = oks[u].select(hv, d.f32(0.0))
                ss_h = fx.math.fma(hv, hv, ss_h)
        rs_h = d.rsqrt_mean(d.block_sum(ss_h, lds, red, wave, lane, NW), H, EPS)
        for k_ in range(tid, d.i32(H), d.i32(WG * ROW_BATCH)):
            ks, oks = _cols(d.i32(k_))
            os_ = _o_values(mbox, mine, o_region, r, ks, oks, tag, polls, health, code)  # h again, as above
            for u in fx.range_constexpr(ROW_BATCH):
                o = os_[u]
                if fx.const_expr(POST_NORMS):
                    o = norm(o, rs_o, _weight(post_w, ks[u]))
                hv = d.round_bf16(_weight(x, r * d.i32(H) + ks[u]) + o)
                if oks[u]:
                    d.mb_put(mbox, d.i32(RG["hn"]) + r * d.i32(H) + ks[u], tag, norm(hv, rs_h, _weight(mlp_w, ks[u])))

    @d.device
    def _final_task(
        r, post_w, out, mbox, mine, tag, polls, health, code, bad_code, lds, tid, wave, lane, d_region: int, nan_fault
    ):
        """Row r (Gemma post-MLP norm and/or TP sum): x_out = h + (norm)(d)."""
        rs_d = d.f32(1.0)
        if fx.const_expr(POST_NORMS):
            ss = d.f32(0.0)
            for k_ in range(tid, d.i32(H), d.i32(WG * ROW_BATCH)):
                ks, oks = _cols(d.i32(k_))
                dvs = _o_values(mbox, mine, d_region, r, ks, oks, tag, polls, health, code)
                for u in fx.range_constexpr(ROW_BATCH):
                    dv = oks[u].select(dvs[u], d.f32(0.0))
                    ss = fx.math.fma(dv, dv, ss)
            rs_d = d.rsqrt_mean(d.block_sum(ss, lds, L2["red"], wave, lane, NW), H, EPS)
        for k_ in range(tid, d.i32(H), d.i32(WG * ROW_BATCH)):
            ks, oks = _cols(d.i32(k_))
            dvs = _o_values(mbox, mine, d_region, r, ks, oks, tag, polls, health, code)
            hvs = d.mb_wait_all(mbox, [d.i32(RG["h"]) + r * d.i32(H) + k for k in ks], oks, tag, polls, health, code)
            for u in fx.range_constexpr(ROW_BATCH):
                dv = dvs[u]
                if fx.const_expr(POST_NORMS):
                    dv = norm(dv, rs_d, _weight(post_w, ks[u]))
                res = d.round_bf16(hvs[u] + dv)
                if (nan_fault != d.i32(0)) & (r == d.i32(0)) & (ks[u] == d.i32(0)):
                    res = d.f32(float("nan"))
                if oks[u]:
                    if d.is_nonfinite(res):
                        d.raise_health(health, bad_code)
                    d.store_bf16(out, r * d.i32(H) + ks[u], res)

    # ------------------------------------------------------------------------------------ launchers
    @flyc.jit
    def launch_k1(
        x: fx.Pointer,
        norm_w: fx.Pointer,
        w_qkv: fx.Pointer,
        s_qkv: fx.Pointer,
        q_norm_w: fx.Pointer,
        k_norm_w: fx.Pointer,
        cos_sin: fx.Pointer,
        key_cache: fx.Pointer,
        value_cache: fx.Pointer,
        block_tables: fx.Pointer,
        seq_lens: fx.Pointer,
        slots: fx.Pointer,
        positions: fx.Pointer,
        out_attn: fx.Pointer,
        mbox: fx.Pointer,
        health: fx.Pointer,
        window: fx.Int32,
        bt_stride: fx.Int32,
        k_block_stride: fx.Int32,
        k_token_stride: fx.Int32,
        k_head_stride: fx.Int32,
        v_block_stride: fx.Int32,
        v_token_stride: fx.Int32,
        v_head_stride: fx.Int32,
        max_polls: fx.Int32,
        layer: fx.Int32,
        stall: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        k1_kernel(
            x,
            norm_w,
            w_qkv,
            s_qkv,
            q_norm_w,
            k_norm_w,
            cos_sin,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            slots,
            positions,
            out_attn,
            mbox,
            health,
            window,
            bt_stride,
            k_block_stride,
            k_token_stride,
            k_head_stride,
            v_block_stride,
            v_token_stride,
            v_head_stride,
            max_polls,
            layer,
            stall,
        ).launch(grid=(G,), block=(WG,), stream=stream)

    @flyc.jit
    def launch_k2(
        x: fx.Pointer,
        attn: fx.Pointer,
        w_o: fx.Pointer,
        s_o: fx.Pointer,
        post_attn_w: fx.Pointer,
        mlp_norm_w: fx.Pointer,
        w_gu: fx.Pointer,
        s_gu: fx.Pointer,
        w_down: fx.Pointer,
        s_down: fx.Pointer,
        post_mlp_w: fx.Pointer,
        out: fx.Pointer,
        mbox: fx.Pointer,
        health: fx.Pointer,
        peers: fx.Pointer,
        max_polls: fx.Int32,
        layer: fx.Int32,
        nan_fault: fx.Int32,
        rank: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        k2_kernel(
            x,
            attn,
            w_o,
            s_o,
            post_attn_w,
            mlp_norm_w,
            w_gu,
            s_gu,
            w_down,
            s_down,
            post_mlp_w,
            out,
            mbox,
            health,
            peers,
            max_polls,
            layer,
            nan_fault,
            rank,
        ).launch(grid=(G,), block=(WG,), stream=stream)

    return launch_k1, launch_k2
