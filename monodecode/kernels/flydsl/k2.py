"""K2: O proj -> (Gemma post-attn norm) -> residual -> pre-MLP norm -> gate/up -> act -> down ->
(Gemma post-MLP norm) -> residual (one persistent launch; stages from ``kernels/plan.py``).

Rounding follows the reference (``k2_reference``): every projection output, norm, activation,
product and residual add is rounded to bf16 where Hugging Face rounds it; accumulation is fp32.
Side by side with ``monodecode/model/reference.py``:

K2 (``x``, ``attn_out`` -> ``x_out``)
  o_proj   GEMV of attn_out -> ``o`` (fp32,      o = W_o attn
           TP: pushed to every peer, ``o_peer``;
           split along K: ``o_part``, fp32;
           fused post: h = bf16(x + bf16(o))
           -> ``h``, no ``o``)
  post     task = row: (TP: sum of the ranks'   Gemma: o = rms_norm(o, attn_post_norm);
           partials in rank order, split-K:     h = x + o; hn = rms_norm(h, mlp_norm)
           of the slices in slice order, fp32)
           -> ``h``, ``hn``; fused post: no task
  gate_up  GEMV of hn, gate and up rows in one  a = bf16(act(bf16 gate)) * bf16(up)
           pass -> ``act``; fused post: waits
           for o_proj, h's rstd per row (the
           post stage's sum order), h normed
           into LDS chunk by chunk (= hn)
  down     GEMV of act; without a final stage   d = W_down a; Llama/Qwen: x_out = h + d
           adds h and writes x_out, else ``d``
           (split along K: ``d_part``, fp32)
  final    task = row (Gemma, TP or a split     Gemma: d = rms_norm(d, mlp_post_norm);
           down): sums the partials, norm,      x_out = h + d
           residual -> x_out

Split-K merge (``Geometry.o_merge`` / ``d_merge``: Llama/Qwen, one rank, o_proj / down split
along K; ``config.SPLIT_K_MERGE``): after its stage loop a workgroup counts each of its K slice
tasks into the row tile's arrival counter (``mailbox.arrive_last``; outside the GEMV, whose K loop
keeps its pipelining); the tile's last slice sums the fp32 partials in slice order, as post /
final would (``_o_values``), and publishes h = bf16(x + bf16(o)) (then there is no post stage:
gate/up waits for o_proj, as with the fused post) or writes x_out = bf16(h + bf16(d)) (no final
stage). The sums have the same bits whichever slice arrives last.

Fused post (``Geometry.fused_post``: Llama/Qwen, one rank, o_proj unsplit or merged; ``config.FUSED_POST``):
the post stage of one workgroup per row, which every other CU waited for, is gone; every value
keeps the post stage's bits (same formulas, rstd summed in the same order by each gate/up
workgroup). Its counter is never signalled, only settled at the launch's exit.

An expired wait stores ``health_code(wait_timeout, k2, layer)``, a non-finite output
``health_code(nonfinite, k2, layer)`` in the sticky health word.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu

from monodecode.kernels.flydsl import device as d
from monodecode.kernels.flydsl import gemv as gv
from monodecode.kernels.flydsl import mailbox as mb
from monodecode.kernels.flydsl.arch import WAVE_SIZE, WAVES_PER_WORKGROUP, WORKGROUP_SIZE
from monodecode.kernels.flydsl.config import Geometry, first_task, merge_output
from monodecode.kernels.plan import K2
from monodecode.model.dims import ModelDims

NW = WAVES_PER_WORKGROUP
WG = WORKGROUP_SIZE
BATCH = 4  # mailbox word pairs a thread stages per round trip (loads in flight)


def make_k2(dims: ModelDims, geom: Geometry):
    """The K2 launcher of one specialisation (closures bake the constants in)."""
    W, G = geom.width, geom.grid
    H, I, Q = geom.hidden, geom.intermediate, geom.q
    EPS = float(dims.rms_norm_eps)
    POST_NORMS, FP8 = geom.post_norms, geom.fp8
    BF16 = geom.bf16_mailbox  # plan mailbox format: bf16 values + completion counters (else tagged words)
    GELU = dims.activation == "gelu_tanh"
    ROW_BATCH = max(1, 4 // geom.tp_size)  # post/final: columns per round trip (x TP partial words each)
    ROW_ROUNDS = -(-H // (WG * ROW_BATCH))  # a thread's rounds of ROW_BATCH columns over one row
    FINAL = geom.final
    FUSED = geom.fused_post  # no post stage: o_proj publishes h, gate/up normalises it (config.FUSED_POST)
    O_MERGE, D_MERGE = geom.o_merge, geom.d_merge  # split tiles summed by their last K slice (SPLIT_K_MERGE)
    RG = geom.regions  # word offsets in this width's scratch segment
    L2 = geom.lds2
    norm = d.norm_scale(dims.norm_one_plus)
    st_o, st_post = geom.stage(K2, "o_proj"), geom.stage(K2, "post")
    st_gu, st_dn = geom.stage(K2, "gate_up"), geom.stage(K2, "down")
    st_fin = geom.stage(K2, "final") if FINAL else None
    TP = geom.tp_size
    O_SPLITS, D_SPLITS = st_o.k_splits, st_dn.k_splits  # K slices (fp32 partials, widths > 1, one GPU)
    PRG = geom.peer_regions  # TP: o_peer / d_peer word offsets in a rank's peer-buffer segment
    gemv_task = gv.make_gemv(geom)

    @d.device
    def _push(peers, rank, tag, tok, region: int, row, v, enable):
        """TP: token ``tok``'s partial of output ``row`` into slot ``rank`` of every rank's peer
        buffer (system scope: other GPUs read it)."""
        if enable & (row < d.i32(H)):
            at = d.i32(region) + (rank * d.i32(W) + tok) * d.i32(H) + row
            for q in fx.range_constexpr(TP):
                mb.mb_put(mb.peer_buffer(peers, d.i32(q)), at, tag, v, None)

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
        arrive: fx.Pointer,
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
        e, tag = mb.launch_epoch(epoch, G)
        seg = mb.segment(mbox, out, s_o, x, BF16)
        ctr_o, ctr_post = mbox + geom.done(K2, "o_proj"), mbox + geom.done(K2, "post")
        ctr_gu, ctr_dn = mbox + geom.done(K2, "gate_up"), mbox + geom.done(K2, "down")
        o_done, post_done = e * fx.Int64(st_o.tasks), e * fx.Int64(st_post.tasks)
        gu_done, dn_done = e * fx.Int64(st_gu.tasks), e * fx.Int64(st_dn.tasks)
        polls = mb.health_ok(health).select(max_polls, d.i32(0))
        wait_code = mb.health_code(mb.SITE_WAIT, mb.KERNEL_K2, layer)
        bad_code = mb.health_code(mb.SITE_NONFINITE, mb.KERNEL_K2, layer)
        lds = d.lds_arena(fx.SharedAllocator(), L2["words"])
        o_region = RG["o_part"] if O_SPLITS > 1 else RG["o"] if TP == 1 else PRG["o_peer"]
        d_region = 0  # down's output region when a final stage reads it
        if D_SPLITS > 1:
            d_region = RG["d_part"]
        elif FINAL:
            d_region = RG["d"] if TP == 1 else PRG["d_peer"]
        mine = mb.peer_buffer(peers, rank) if TP > 1 else mbox  # this rank's peer-buffer segment
        checks = (tag, polls, health, wait_code, bad_code)  # what a split-K merge's loads and stores check

        # ---- o_proj: attn_out (K1's bf16 output) staged as is
        t_o = geom.tiles["o_proj"]
        o_rs = gv.buffer_rsrc(w_o)

        def stage_attn(c0, kend):
            _stage_rows(attn, lds, tid, c0, t_o.chunk_words, t_o.x_stride, Q, kend)

        def publish_o(row, tok, vals, valid, k_slice):
            v = gv.scaled(FP8, s_o, fx.min(row, d.i32(H - 1)), vals[0])
            if fx.const_expr(O_SPLITS > 1):  # fp32 partial of the task's K slice (slice-major rows)
                mb.put_row(seg, tag, k_slice * d.i32(W) + tok, o_region, H, row, v, valid, partial=True)
            elif fx.const_expr(FUSED):  # the post stage's residual add, here: h = bf16(x + bf16(o))
                hv = d.round_bf16(
                    _weight(x, fx.min(tok, d.i32(W - 1)) * d.i32(H) + fx.min(row, d.i32(H - 1))) + d.round_bf16(v)
                )
                mb.put_row(seg, tag, tok, RG["h"], H, row, hv, valid)  # released by the signal below, like o
            elif fx.const_expr(TP == 1):
                mb.put_row(seg, tag, tok, o_region, H, row, v, valid)
            else:
                _push(peers, rank, tag, tok, o_region, row, v, valid)

        first_o = first_task(bid, st_o.offset, G)
        for t_ in range(first_o, d.i32(st_o.tasks), d.i32(G)):
            gemv_task(t_o, d.i32(t_), o_rs, lds, L2["x"], L2["part"], tid, wave, lane, stage_attn, publish_o)
        if fx.const_expr(O_MERGE):  # each tile's last slice: h = bf16(x + bf16(o)), released by the signal below
            _merge_tiles(st_o, first_o, o_region, x, arrive, seg, lds, tid, nan_fault, checks)
        if fx.const_expr(BF16):
            mb.signal_tasks(ctr_o, first_o, st_o.tasks, G, tid, tid >= d.i32(0))
        else:
            gpu.barrier()

        # ---- post: h = x + (post-attn norm)(o), hn = mlp_norm(h); none when fused (no task, no signal:
        # the last workgroup out still settles its counter at epoch * W, as the Triton kernels do)
        if fx.const_expr(not FUSED):
            first_post = first_task(bid, st_post.offset, G)
            for r_ in range(first_post, d.i32(st_post.tasks), d.i32(G)):
                _post_task(
                    d.i32(r_),
                    x,
                    post_attn_w,
                    mlp_norm_w,
                    seg,
                    (ctr_o, o_done),
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
            if fx.const_expr(BF16):
                mb.signal_tasks(ctr_post, first_post, st_post.tasks, G, tid, tid >= d.i32(0))

        # ---- gate_up: hn (waited) staged in LDS, gate and up rows together, activation
        t_gu = geom.tiles["gate_up"]
        gu_rs = gv.buffer_rsrc(w_gu)
        first_gu = first_task(bid, st_gu.offset, G)
        if fx.const_expr(FUSED):  # the post stage's pre-MLP norm, here: o_proj's h (waited), each row's rstd
            if first_gu < d.i32(st_gu.tasks):
                mb.wait_done(ctr_o, o_done, polls, health, wait_code)
                _rstd_of_h(seg, tag, polls, health, wait_code, lds, tid, wave, lane)

        def stage_hn(c0, kend):  # gate_up is never split along K: kend is H
            if fx.const_expr(FUSED):  # h normalised on the way in: the post stage's hn, bit for bit
                normed = (mlp_norm_w, dims.norm_one_plus, L2["rstd"])
                _stage_rows(seg.i32 + d.i32(RG["h"] // 2), lds, tid, c0, t_gu.chunk_words, t_gu.x_stride, H, H, normed)
            elif fx.const_expr(BF16):  # bf16 pairs staged as they are, once the post stage is done
                mb.wait_first(c0, ctr_post, post_done, polls, health, wait_code)
                _stage_rows(seg.i32 + d.i32(RG["hn"] // 2), lds, tid, c0, t_gu.chunk_words, t_gu.x_stride, H, H)
            else:
                _stage_words(
                    mbox, RG["hn"], tag, polls, health, wait_code, lds, tid, c0, t_gu.chunk_words, t_gu.x_stride, H
                )

        def publish_act(row, tok, vals, valid, k_slice):
            srow = fx.min(row, d.i32(I - 1))
            gt = d.round_bf16(gv.scaled(FP8, s_gu, srow, vals[0]))
            up = d.round_bf16(gv.scaled(FP8, s_gu, srow + d.i32(I), vals[1]))
            a = d.round_bf16(d.gelu_tanh(gt) if GELU else d.silu(gt))
            mb.put_row(seg, tag, tok, RG["act"], I, row, d.round_bf16(a * up), valid)

        for t_ in range(first_gu, d.i32(st_gu.tasks), d.i32(G)):
            gemv_task(t_gu, d.i32(t_), gu_rs, lds, L2["x"], L2["part"], tid, wave, lane, stage_hn, publish_act)
        if fx.const_expr(BF16):
            mb.signal_tasks(ctr_gu, first_gu, st_gu.tasks, G, tid, tid >= d.i32(0))
        else:
            gpu.barrier()

        # ---- down: act (waited) staged in LDS; residual here, or a final stage
        t_dn = geom.tiles["down"]
        dn_rs = gv.buffer_rsrc(w_down)

        def stage_act(c0, kend):
            # gate_up done implies h is ready for the residual too: every gate_up task acquired h's
            # producers (post, or o_proj when fused) before its release (acquire/release is transitive)
            if fx.const_expr(BF16):
                mb.wait_first(c0, ctr_gu, gu_done, polls, health, wait_code)
                _stage_rows(seg.i32 + d.i32(RG["act"] // 2), lds, tid, c0, t_dn.chunk_words, t_dn.x_stride, I, kend)
            else:
                _stage_words(
                    mbox, RG["act"], tag, polls, health, wait_code, lds, tid, c0, t_dn.chunk_words, t_dn.x_stride, I
                )

        def finish_down(row, tok, vals, valid, k_slice):
            v = gv.scaled(FP8, s_down, fx.min(row, d.i32(H - 1)), vals[0])
            if fx.const_expr(D_SPLITS > 1):  # fp32 partial of the task's K slice, summed by final
                mb.put_row(seg, tag, k_slice * d.i32(W) + tok, d_region, H, row, v, valid, partial=True)
            elif fx.const_expr(TP > 1):
                _push(peers, rank, tag, tok, d_region, row, v, valid)
            elif fx.const_expr(FINAL):
                mb.put_row(seg, tag, tok, d_region, H, row, v, valid)
            else:
                _residual_out(seg, tag, polls, health, wait_code, bad_code, out, tok, row, v, nan_fault, valid)

        first_dn = first_task(bid, st_dn.offset, G)
        for t_ in range(first_dn, d.i32(st_dn.tasks), d.i32(G)):
            gemv_task(t_dn, d.i32(t_), dn_rs, lds, L2["x"], L2["part"], tid, wave, lane, stage_act, finish_down)
        if fx.const_expr(D_MERGE):  # each tile's last slice: x_out = bf16(h + bf16(d)), checked
            _merge_tiles(st_dn, first_dn, d_region, out, arrive, seg, lds, tid, nan_fault, checks)
        if fx.const_expr(BF16):
            mb.signal_tasks(ctr_dn, first_dn, st_dn.tasks, G, tid, tid >= d.i32(0))

        # ---- final (Gemma post-MLP norm): x_out = h + norm(d)
        if fx.const_expr(FINAL):
            gpu.barrier()
            for r_ in range(first_task(bid, st_fin.offset, G), d.i32(st_fin.tasks), d.i32(G)):
                _final_task(
                    d.i32(r_),
                    post_mlp_w,
                    out,
                    seg,
                    (ctr_dn, dn_done),
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

        if fx.const_expr(BF16):  # the post counter too when fused (as the Triton kernels): at epoch * W as planned
            settle = [(ctr_o, o_done), (ctr_post, post_done), (ctr_gu, gu_done), (ctr_dn, dn_done)]
            mb.finish_launch(epoch, tid, G, settle)
        else:
            mb.finish_launch(epoch, tid)

    def _stage_rows(src, lds, tid, c0, ckw: int, xs: int, k: int, kend, norm=None):
        """Rows of a bf16 input (a launch input or a bf16 mailbox region, ``k`` elements each) into
        K2's staging area as they are, or with ``norm`` RMSNorm's output (``gemv.stage_rows``)."""
        gv.stage_rows(src, lds, L2["x"], tid, c0, W, ckw, xs, k, kend, norm)

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
            vals = mb.mb_wait_all(mbox, ats, oks, tag, polls, health, code)
            for u in fx.range_constexpr(BATCH):
                idx = base + d.i32(u * WG)
                tk = idx // d.i32(ckw)
                if idx < d.i32(W * ckw):
                    word = oks[2 * u].select(d.pack_bf16x2(vals[2 * u], vals[2 * u + 1]), d.i32(0))
                    d.lds_store(lds, d.i32(L2["x"]) + idx + tk * d.i32(xs - ckw), word)

    @d.device
    def _residual_out(seg, tag, polls, health, code, bad_code, out, tok, row, v, nan_fault, enable):
        """x_out = bf16(h + bf16(d)) for token ``tok``, checked for non-finite values."""
        if enable & (row < d.i32(H)):
            at = d.i32(RG["h"]) + tok * d.i32(H) + row
            hv = mb.fetch(seg, [at], [enable], tag, polls, health, code)[0]
            res = d.round_bf16(hv + d.round_bf16(v))
            if (nan_fault != d.i32(0)) & (tok == d.i32(0)) & (row == d.i32(0)):
                res = d.f32(float("nan"))
            if d.is_nonfinite(res):
                mb.raise_health(health, bad_code)
            d.store_bf16(out, tok * d.i32(H) + row, res)

    @d.device
    def _merge_tiles(st, first, region: int, dst, arrive, seg, lds, tid, nan_fault, checks):
        """Split-K merge of ``st`` (o_proj or down) after this workgroup's tasks of it: each task's
        K slice arrives at its row tile's counter (``Geometry.arrive``); in the tile's last slice
        every thread takes (token, row) outputs of the tile, sums their partials in slice order
        (``_o_values``, the post / final stages' sum) and finishes them: o_proj publishes h from
        ``dst`` = x, down writes x_out to ``dst`` = out (``_residual_out``: NaN fault, finite check).
        Other slices load nothing. ``checks``: (tag, polls, health, wait code, non-finite code)."""
        tag, polls, health, code, bad_code = checks
        rows = st.rows  # output rows of a row tile
        mb.drain_stores()  # every thread's partials stored before thread 0's release
        for t_ in range(first, d.i32(st.tasks), d.i32(G)):
            tile = d.i32(t_) % d.i32(st.row_tiles)
            if mb.arrive_last(arrive + (d.i32(geom.arrive(st.name)) + tile), st.k_splits, tid, lds, L2["red"]):
                for i_ in range(tid, d.i32(W * rows), d.i32(WG)):
                    tok, row = merge_output(d.i32(i_), tile, rows)
                    ok = row < d.i32(H)
                    col = ok.select(row, d.i32(0))
                    v = _o_values(seg, seg.words, region, tok, [col], [ok], tag, polls, health, code, st.k_splits)[0]
                    if fx.const_expr(st.name == "o_proj"):
                        hv = d.round_bf16(_weight(dst, tok * d.i32(H) + col) + v)
                        mb.put_row(seg, tag, tok, RG["h"], H, row, hv, ok)
                    else:
                        _residual_out(seg, tag, polls, health, code, bad_code, dst, tok, row, v, nan_fault, ok)

    def _cols(k0):
        """The ROW_BATCH columns a thread takes per round trip in a per-row stage, and which exist."""
        ks = [k0 + d.i32(u * WG) for u in range(ROW_BATCH)]
        oks = [k < d.i32(H) for k in ks]
        return [ok.select(k, d.i32(0)) for k, ok in zip(ks, oks)], oks

    def _o_values(seg, mine, region: int, r, ks, oks, tag, polls, health, code, slices: int = 1):
        """o[r, k] for the columns ``ks`` as the reference has it: bf16 of the projection (TP: of
        the ranks' partials summed in rank order, fp32, so every rank gets the same bits; split
        along K: of the ``slices`` fp32 partials summed in slice order, as the Triton kernels do)."""
        if TP == 1 and slices == 1:
            vals = mb.fetch(seg, [d.i32(region) + r * d.i32(H) + k for k in ks], oks, tag, polls, health, code)
            return [d.round_bf16(v) for v in vals]
        # partial q of row r at (q * W + r) * H: the ranks' (tagged peer words) or the K slices' (fp32)
        parts = TP if TP > 1 else slices
        ats = [d.i32(region + q * W * H) + r * d.i32(H) + k for k in ks for q in range(parts)]
        valid = [ok for ok in oks for _ in range(parts)]
        if TP > 1:
            vals = mb.mb_wait_all(mine, ats, valid, tag, polls, health, code, None)
        else:
            vals = mb.fetch(seg, ats, valid, tag, polls, health, code, partial=True)
        out = []
        for u in range(len(ks)):  # summed first to last: the same bits on every rank and every run
            tot = d.f32(0.0)
            for v in vals[u * parts : (u + 1) * parts]:
                tot = tot + v
            out.append(d.round_bf16(tot))
        return out

    def _weight(w_ptr, k):
        return d.bf16_half(d.load_word(w_ptr, k // d.i32(2)), k % d.i32(2))

    @d.device
    def _post_task(
        r, x, post_w, mlp_w, seg, ready, mine, tag, polls, health, code, lds, tid, wave, lane, o_region: int
    ):
        """Row r: h = x + (post-attn norm)(o) and hn = mlp_norm(h), both published."""
        mb.wait_ready(seg, ready, polls, health, code)  # the whole o_proj stage (bf16 format)
        red = L2["red"]
        rs_o = d.f32(1.0)
        if fx.const_expr(POST_NORMS):
            ss = d.f32(0.0)
            for k_ in range(tid, d.i32(H), d.i32(WG * ROW_BATCH)):
                ks, oks = _cols(d.i32(k_))
                os_ = _o_values(seg, mine, o_region, r, ks, oks, tag, polls, health, code, O_SPLITS)
                for u in fx.range_constexpr(ROW_BATCH):
                    ov = oks[u].select(os_[u], d.f32(0.0))
                    ss = fx.math.fma(ov, ov, ss)
            rs_o = d.rsqrt_mean(d.block_sum(ss, lds, red, wave, lane, NW), H, EPS)
        ss_h = d.f32(0.0)
        for k_ in range(tid, d.i32(H), d.i32(WG * ROW_BATCH)):
            ks, oks = _cols(d.i32(k_))
            os_ = _o_values(seg, mine, o_region, r, ks, oks, tag, polls, health, code, O_SPLITS)
            for u in fx.range_constexpr(ROW_BATCH):
                o = os_[u]
                if fx.const_expr(POST_NORMS):
                    o = norm(o, rs_o, _weight(post_w, ks[u]))
                hv = d.round_bf16(_weight(x, r * d.i32(H) + ks[u]) + o)
                if oks[u]:
                    mb.publish(seg, d.i32(RG["h"]) + r * d.i32(H) + ks[u], tag, hv)
                hv = oks[u].select(hv, d.f32(0.0))
                ss_h = fx.math.fma(hv, hv, ss_h)
        rs_h = d.rsqrt_mean(d.block_sum(ss_h, lds, red, wave, lane, NW), H, EPS)
        for k_ in range(tid, d.i32(H), d.i32(WG * ROW_BATCH)):
            ks, oks = _cols(d.i32(k_))
            os_ = _o_values(seg, mine, o_region, r, ks, oks, tag, polls, health, code, O_SPLITS)  # h again, as above
            for u in fx.range_constexpr(ROW_BATCH):
                o = os_[u]
                if fx.const_expr(POST_NORMS):
                    o = norm(o, rs_o, _weight(post_w, ks[u]))
                hv = d.round_bf16(_weight(x, r * d.i32(H) + ks[u]) + o)
                if oks[u]:
                    mb.publish(seg, d.i32(RG["hn"]) + r * d.i32(H) + ks[u], tag, norm(hv, rs_h, _weight(mlp_w, ks[u])))

    @d.device
    def _rstd_of_h(seg, tag, polls, health, code, lds, tid, wave, lane):
        """Fused post: RMSNorm's rstd of every row of h (published by o_proj) into LDS ``rstd``,
        summed in ``_post_task``'s order: thread ``tid`` takes the same columns (``_cols``) in the
        same order, fp32 fma of the bf16 values, then the same ``block_sum``, so rstd and hn have
        the post stage's bits. A row's loads are all issued before its sum (one round trip)."""
        for r_ in range(d.i32(0), d.i32(W), d.i32(1)):
            r = d.i32(r_)
            oks, hvs = [], []
            for j in fx.range_constexpr(ROW_ROUNDS):
                ks_j, oks_j = _cols(tid + d.i32(j * WG * ROW_BATCH))
                ats = [d.i32(RG["h"]) + r * d.i32(H) + k for k in ks_j]
                oks, hvs = oks + oks_j, hvs + mb.fetch(seg, ats, oks_j, tag, polls, health, code)
            ss = d.f32(0.0)
            for i in fx.range_constexpr(ROW_ROUNDS * ROW_BATCH):  # past the row: fma(0, 0, ss) is ss, as if not taken
                hv = oks[i].select(hvs[i], d.f32(0.0))
                ss = fx.math.fma(hv, hv, ss)
            rs = d.rsqrt_mean(d.block_sum(ss, lds, L2["red"], wave, lane, NW), H, EPS)
            if tid == d.i32(0):
                d.lds_storef(lds, d.i32(L2["rstd"]) + r, rs)
        gpu.barrier()  # every row's rstd in LDS before gate/up stages its first chunk

    @d.device
    def _final_task(
        r,
        post_w,
        out,
        seg,
        ready,
        mine,
        tag,
        polls,
        health,
        code,
        bad_code,
        lds,
        tid,
        wave,
        lane,
        d_region: int,
        nan_fault,
    ):
        """Row r (Gemma post-MLP norm and/or TP sum): x_out = h + (norm)(d)."""
        mb.wait_ready(seg, ready, polls, health, code)  # the whole down stage (bf16 format)
        rs_d = d.f32(1.0)
        if fx.const_expr(POST_NORMS):
            ss = d.f32(0.0)
            for k_ in range(tid, d.i32(H), d.i32(WG * ROW_BATCH)):
                ks, oks = _cols(d.i32(k_))
                dvs = _o_values(seg, mine, d_region, r, ks, oks, tag, polls, health, code, D_SPLITS)
                for u in fx.range_constexpr(ROW_BATCH):
                    dv = oks[u].select(dvs[u], d.f32(0.0))
                    ss = fx.math.fma(dv, dv, ss)
            rs_d = d.rsqrt_mean(d.block_sum(ss, lds, L2["red"], wave, lane, NW), H, EPS)
        for k_ in range(tid, d.i32(H), d.i32(WG * ROW_BATCH)):
            ks, oks = _cols(d.i32(k_))
            dvs = _o_values(seg, mine, d_region, r, ks, oks, tag, polls, health, code, D_SPLITS)
            hvs = mb.fetch(seg, [d.i32(RG["h"]) + r * d.i32(H) + k for k in ks], oks, tag, polls, health, code)
            for u in fx.range_constexpr(ROW_BATCH):
                dv = dvs[u]
                if fx.const_expr(POST_NORMS):
                    dv = norm(dv, rs_d, _weight(post_w, ks[u]))
                res = d.round_bf16(hvs[u] + dv)
                if (nan_fault != d.i32(0)) & (r == d.i32(0)) & (ks[u] == d.i32(0)):
                    res = d.f32(float("nan"))
                if oks[u]:
                    if d.is_nonfinite(res):
                        mb.raise_health(health, bad_code)
                    d.store_bf16(out, r * d.i32(H) + ks[u], res)

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
        arrive: fx.Pointer,
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
            arrive,
            max_polls,
            layer,
            nan_fault,
            rank,
        ).launch(grid=(G,), block=(WG,), stream=stream)

    return launch_k2
