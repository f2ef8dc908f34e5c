"""One GEMV task of a persistent stage: rows ``[t*rows, t*rows + rows)`` of ``y[W, N] = x[W, K] . Wt[N, K]^T``.

The task's input rows are staged in LDS as bf16 by the caller's ``stage_chunk`` (a launch input,
normed or as is, or a mailbox region), in chunks (``config.GemvTile``); the weights stream from
global memory 16 bytes per lane (``buffer_load_dwordx4 ... nt``: read once per step, past the
caches). Width 1 uses FMA (lanes split K, waves split the rows); wider steps use 16x16 MFMA tiles
(weight rows x padded token columns), the waves splitting the tiles and, with fewer than 4 tiles,
K; partial sums meet in LDS and are added in a fixed order (same bits every run). FP8 weights
(FNUZ on gfx942, OCP on gfx950, decoded by the hardware) are widened exactly; the per-output-
channel scale applies to the fp32 result (``scaled``), as ``Linear.__call__`` does. A task's first
weights are loaded before its inputs are staged, so they stream in while the producers' words
are waited for.
"""

from __future__ import annotations

import flydsl.expr as fx
from flydsl.expr import gpu, rocdl
from flydsl.expr.typing import Vector

from monodecode.kernels.flydsl import device as d
from monodecode.kernels.flydsl.arch import WAVES_PER_WORKGROUP, WORKGROUP_SIZE
from monodecode.kernels.flydsl.config import (
    MFMA_ROWS,
    GemvTile,
    Geometry,
    mfma_k_elem,
    mfma_lane,
    mfma_part,
    mfma_weight_row,
    task_origin,
)

NW = WAVES_PER_WORKGROUP
WG = WORKGROUP_SIZE


# ---------------------------------------------------------------- weight loads
def buffer_rsrc(ptr):
    return rocdl.get_buffer_rsrc(rocdl.make_buffer_ptr(ptr))


CM_NT = 2  # streamed weights: nontemporal (flydsl_notes.md section 2: aux 2 -> nt)


def load_weights16(rsrc, byte_off):
    """16 bytes of weights (8 bf16 or 16 fp8) per lane, streamed (nt)."""
    v = rocdl.raw_ptr_buffer_load(
        Vector.make_type(4, fx.Int32), rsrc, fx.Int32(byte_off).ir_value(), fx.Int32(0).ir_value(), aux=CM_NT
    )
    return Vector(v, (4,), fx.Int32)


# ---------------------------------------------------------------- input staging
@d.device
def stage_rows(src, lds, x_off: int, tid, c0, W: int, ckw: int, xs: int, k: int, kend, norm=None):
    """Elements ``[c0, c0 + chunk)`` of the ``W`` rows of a bf16 input (``src``: 32-bit words, bf16
    pairs, ``k`` elements a row) into the LDS staging area at ``x_off`` as bf16 pairs, 0 from
    ``kend`` on (``k``, or the end of the task's K slice). ``norm`` = (norm weight, one_plus, LDS
    word of the rows' rstd): RMSNorm's output instead, exactly as the reference rounds it
    (``device.norm_scale``)."""
    for idx_ in range(tid, d.i32(W * ckw), d.i32(WG), unroll=4):
        idx = d.i32(idx_)
        tk = idx // d.i32(ckw)
        kk = c0 + (idx - tk * d.i32(ckw)) * d.i32(2)
        word = d.i32(0)
        if kk < d.i32(kend):
            word = d.load_word(src, (tk * d.i32(k) + kk) // d.i32(2))
            if fx.const_expr(norm is not None):
                norm_w, one_plus, rstd = norm
                scale = d.norm_scale(one_plus)
                nw = d.load_word(norm_w, kk // d.i32(2))
                rs = d.lds_loadf(lds, d.i32(rstd) + tk)
                word = d.pack_bf16x2(
                    scale(d.bf16_lo(word), rs, d.bf16_lo(nw)), scale(d.bf16_hi(word), rs, d.bf16_hi(nw))
                )
        d.lds_store(lds, d.i32(x_off) + idx + tk * d.i32(xs - ckw), word)


# ---------------------------------------------------------------- GEMV core
def dot_bf16(wv, xv, acc):
    """acc += 8 bf16 weights (4 words) . 8 bf16 activations (4 words)."""
    for j in range(4):
        acc = fx.math.fma(d.bf16_lo(wv[j]), d.bf16_lo(xv[j]), acc)
        acc = fx.math.fma(d.bf16_hi(wv[j]), d.bf16_hi(xv[j]), acc)
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
        acc = fx.math.fma(lo[0], d.bf16_lo(x0), acc)
        acc = fx.math.fma(lo[1], d.bf16_hi(x0), acc)
        acc = fx.math.fma(hi[0], d.bf16_lo(x1), acc)
        acc = fx.math.fma(hi[1], d.bf16_hi(x1), acc)
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


def scaled(fp8: bool, sptr, row, v):
    """FP8 weights: the per-output-channel scale applies to the fp32 dot (Linear.__call__)."""
    if fp8:
        return v * d.load_f32(sptr, row)
    return v


def make_gemv(geom: Geometry):
    """``gemv_task`` of one specialisation (its width, weight format and arch baked in)."""
    W, FP8, ARCH = geom.width, geom.fp8, geom.arch

    def gemv_task(tl: GemvTile, t, w_rs, lds, x_off: int, part_off: int, tid, wave, lane, stage_chunk, finish):
        """Task ``t`` of a GEMV stage: its rows (``config.task_origin``) of y[W, N] = x[W, K] . Wt[N, K]^T
        over its K slice (gate|up: the same rows of both matrices). ``stage_chunk(c0, kend)`` stages
        the input rows' elements [c0, c0 + chunk) in LDS as bf16, zero from ``kend`` on;
        ``finish(row, token, values, valid, k_slice)`` gets each output (``values``: one per matrix)
        on some thread, ``valid`` false for padding, ``k_slice`` the task's K slice (0 unsplit)."""
        st = tl.stage
        if tl.mfma:
            n0, k0, k_slice = task_origin(t, st)
            last = None  # the task's last own row, where its tile has rows past it
            if st.rows != st.tile or st.n % st.tile:
                last = fx.min(n0 + d.i32(st.rows - 1), d.i32(st.n - 1))
            kend = st.k if st.k_splits == 1 else k0 + d.i32(st.k_task)  # the LDS holds zeros from here
            return _gemv_mfma(
                n0,
                k0,
                k_slice,
                last,
                kend,
                w_rs,
                lds,
                tid,
                wave,
                lane,
                stage_chunk,
                finish,
                st.n,
                st.k,
                st.k_task,
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
                wv.append(load_weights16(w_rs, weight_byte(row, N, K, p, kg)))
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
                    accs[j * W + tk] = dot_bf16(wv[j], xa, accs[j * W + tk])
                else:
                    accs[j * W + tk] = dot_fp8(wv[j], xa, xb, accs[j * W + tk])
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
            stage_chunk(c0, K)
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
                        finish(row0 + d.i32(i), lane, vals, lane < d.i32(W), d.i32(0))

    def _mfma_weights(w_rs, n0, last, k0, tg, rin, kq, b, c0, N, K, KT, PR, VEC, KPAD, TW):
        """This lane's 16 weight bytes of K block ``b`` of chunk ``c0`` of the task's K slice (from
        ``k0``) for each of the wave's tiles. ``last``: the task's last own row, where the tile
        has rows past it (they load that row again: addresses the wave already reads)."""
        kg = c0 + mfma_k_elem(b, kq, VEC)
        if KPAD != KT:  # lanes past the slice read a valid weight; their LDS input is 0
            kg = fx.min(kg, d.i32(K - VEC) - k0)
        wv = []
        for j in range(TW):
            tile = tg * d.i32(TW) + d.i32(j)
            rin_ = rin
            if last is not None:
                rin_ = fx.min(rin, last - n0 - (tile // d.i32(PR)) * d.i32(MFMA_ROWS))
            row = mfma_weight_row(n0, tile, rin_, PR, N)
            wv.append(load_weights16(w_rs, (row * d.i32(K) + k0 + kg) * d.i32(1 if FP8 else 2)))
        return wv

    def _mfma_block(lds, wv, b, kq, tok, accs, VEC, XS, TW, x_off):
        """accs[j] += tile j's weights (``wv[j]``) . the staged inputs of K block ``b``."""
        kl = mfma_k_elem(b, kq, VEC)  # element inside the chunk
        xa = d.lds_load4(lds, d.i32(x_off) + tok * d.i32(XS) + kl // d.i32(2))
        xb = xa
        if VEC == 16:
            xb = d.lds_load4(lds, d.i32(x_off + 4) + tok * d.i32(XS) + kl // d.i32(2))
        return [mfma_tile(ARCH, wv[j], xa, xb, accs[j], VEC == 16) for j in range(TW)]

    @d.device
    def _gemv_mfma(
        n0,
        k0,
        k_slice,
        last,
        kend,
        w_rs,
        lds,
        tid,
        wave,
        lane,
        stage_chunk,
        finish,
        N,
        K,
        KT,
        OWN,
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
        are staged, so they stream in while ``stage_chunk`` waits for the producers' words.

        The task's tiles own its first ``OWN`` rows (fewer than the tiles hold when the plan cut
        the stage to even waves: the rest are the next task's, never stored; ``last`` is the last
        own row, which the rows past it load again) over the ``KT`` elements of its K slice from
        ``k0``; a split stage's partials are summed by the stage that reads them."""
        ks = wave % d.i32(KS)
        tg = wave // d.i32(KS)
        rin, kq = mfma_lane(lane)
        tok = fx.min(rin, d.i32(W - 1))
        accs = [mfma_zero() for _ in range(TW)]
        # this wave's first K block of chunk 0, loaded before the inputs are staged (waited for)
        first = _mfma_weights(w_rs, n0, last, k0, tg, rin, kq, ks, d.i32(0), N, K, KT, PR, VEC, KPAD, TW)
        for c_ in range(NCH):
            c = d.i32(c_)
            c0 = c * d.i32(CK)
            gpu.barrier()
            stage_chunk(k0 + c0, kend)
            gpu.barrier()
            nblk = fx.min(d.i32(CK), d.i32(KPAD) - c0) // d.i32(KB)
            b_start = ks
            if (c == d.i32(0)) & (ks < nblk):  # block ks of chunk 0 peeled: its weights are in already
                accs = _mfma_block(lds, first, ks, kq, tok, accs, VEC, XS, TW, x_off)
                b_start = ks + d.i32(KS)
            for b_ in range(b_start, nblk, d.i32(KS)):
                b = d.i32(b_)
                wv = _mfma_weights(w_rs, n0, last, k0, tg, rin, kq, b, c0, N, K, KT, PR, VEC, KPAD, TW)
                accs = _mfma_block(lds, wv, b, kq, tok, accs, VEC, XS, TW, x_off)
        for j in fx.range_constexpr(TW):  # lane l holds rows 4*(l // 16) + e of token l % 16
            tile = tg * d.i32(TW) + d.i32(j)
            if rin < d.i32(W):
                for e in fx.range_constexpr(4):
                    at = mfma_part(ks, tile, kq * d.i32(4) + d.i32(e), rin, NT, W)
                    d.lds_storef(lds, d.i32(part_off) + at, accs[j][e])
        gpu.barrier()
        for idx_ in range(tid, d.i32(OWN * W), d.i32(WG)):
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
            finish(n0 + rr, tk, vals, tk >= d.i32(0), k_slice)

    return gemv_task
