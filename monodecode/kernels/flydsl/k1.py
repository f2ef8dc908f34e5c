"""K1: pre-norm -> QKV -> q/k-norm -> RoPE -> KV insert -> paged GQA attention (one launch).

A persistent launch of ``G`` workgroups (one per CU, all resident). Stages, task counts,
rotation offsets and mailbox regions come from ``kernels/plan.py`` through ``config.Geometry``:
task ``t`` of a stage runs on workgroup ``(t + offset) % G``; a workgroup runs its tasks of stage
0, then of stage 1, ...; a task only waits on earlier stages, so there is no grid barrier and
no deadlock while all ``G`` workgroups are resident. On one GPU the mailbox is the plan's bf16
format (bf16 activations, fp32 attention partials; a consumer task waits once on its producing
stage's completion counter), with TP the tagged one (``mailbox.py``). Side by side with
``monodecode/model/reference.py``:

K1 (``x`` -> ``attn_out``)
  qkv      GEMV task = ``rows`` outputs of       h = rms_norm(x, attn_norm); q|k|v = W_qkv h
           W_qkv for every row of the step;      (bf16 each)
           x normed into LDS, published
           (bf16) -> region ``qkv``
  attn     task = (row, KV head, context split): q/k = rms_norm(., q/k_norm) (qk_norm models);
           waits for the qkv stage (q, k, v);    RoPE (rotate-half, bf16 cos/sin); K,V written
           q/k-norm, RoPE; the split holding the at the slot; softmax(q.K^T * scale) V over
           newest position writes K/V to the      positions j < seq_len (and j > pos - window on
           cache; online softmax over its slice   sliding layers); padded rows (slot -1): zeros
           -> unnormalised (m, l, acc), fp32
           -> regions ``attn_ml``, ``attn_acc``
  combine  task = (row, query head): merges the  out = sum_s e^(m_s-M) acc_s / sum_s e^(m_s-M) l_s
           splits -> ``attn_out`` (bf16)

An expired wait stores ``health_code(wait_timeout, k1, layer)`` in the sticky health word.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import gpu

from monodecode.kernels.flydsl import device as d
from monodecode.kernels.flydsl import gemv as gv
from monodecode.kernels.flydsl import mailbox as mb
from monodecode.kernels.flydsl.arch import WAVE_SIZE, WAVES_PER_WORKGROUP, WORKGROUP_SIZE
from monodecode.kernels.flydsl.attention import make_attention
from monodecode.kernels.flydsl.config import Geometry, first_task
from monodecode.kernels.plan import K1
from monodecode.model.dims import ModelDims

NW = WAVES_PER_WORKGROUP
WG = WORKGROUP_SIZE


def make_k1(dims: ModelDims, geom: Geometry, block_size: int):
    """The K1 launcher of one specialisation (closures bake the constants in)."""
    W, G, H = geom.width, geom.grid, geom.hidden
    NQKV, FP8 = geom.qkv, geom.fp8
    BF16 = geom.bf16_mailbox  # plan mailbox format: bf16 values + completion counters (else tagged words)
    EPS = float(dims.rms_norm_eps)
    RG = geom.regions  # word offsets in this width's scratch segment
    L1 = geom.lds1
    st_qkv, st_attn, st_comb = geom.stage(K1, "qkv"), geom.stage(K1, "attn"), geom.stage(K1, "combine")
    gemv_task = gv.make_gemv(geom)
    attn_task, combine_task = make_attention(dims, geom, block_size)

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
        e, tag = mb.launch_epoch(epoch, G)
        seg = mb.segment(mbox, out_attn, cos_sin, x, BF16)
        ctr_qkv, ctr_attn = mbox + geom.done(K1, "qkv"), mbox + geom.done(K1, "attn")
        qkv_done, attn_done = e * fx.Int64(st_qkv.tasks), e * fx.Int64(st_attn.tasks)
        polls = mb.health_ok(health).select(max_polls, d.i32(0))  # a failed step waits no more
        wait_code = mb.health_code(mb.SITE_WAIT, mb.KERNEL_K1, layer)
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
        w_rs = gv.buffer_rsrc(w_qkv)

        def stage_x(c0, kend):  # qkv is never split along K: kend is H
            normed = (norm_w, dims.norm_one_plus, L1["rstd"])
            gv.stage_rows(x, lds, L1["x"], tid, c0, W, tile.chunk_words, tile.x_stride, H, H, normed)

        def publish_qkv(row, tok, vals, valid, k_slice):
            v = d.round_bf16(gv.scaled(FP8, s_qkv, fx.min(row, d.i32(NQKV - 1)), vals[0]))
            mb.put_row(seg, tag, tok, RG["qkv"], NQKV, row, v, valid & (stall == d.i32(0)))

        for t_ in range(first, d.i32(st_qkv.tasks), d.i32(G)):
            gemv_task(tile, d.i32(t_), w_rs, lds, L1["x"], L1["part"], tid, wave, lane, stage_x, publish_qkv)
        if fx.const_expr(BF16):  # a stalled stage never counts: the attention waits expire
            mb.signal_tasks(ctr_qkv, first, st_qkv.tasks, G, tid, stall == d.i32(0))
        else:
            gpu.barrier()

        # ---- attn: (row, KV head, split) partials
        first_attn = first_task(bid, st_attn.offset, G)
        for t_ in range(first_attn, d.i32(st_attn.tasks), d.i32(G)):
            attn_task(
                d.i32(t_),
                seg,
                (ctr_qkv, qkv_done),
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

        if fx.const_expr(BF16):
            mb.signal_tasks(ctr_attn, first_attn, st_attn.tasks, G, tid, tid >= d.i32(0))

        # ---- combine: merge each query head's splits -> attn_out (bf16)
        for t_ in range(first_task(bid, st_comb.offset, G), d.i32(st_comb.tasks), d.i32(G)):
            combine_task(d.i32(t_), seg, (ctr_attn, attn_done), tag, polls, health, wait_code, tid, out_attn)

        if fx.const_expr(BF16):
            mb.finish_launch(epoch, tid, G, [(ctr_qkv, qkv_done), (ctr_attn, attn_done)])
        else:
            mb.finish_launch(epoch, tid)

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

    return launch_k1
