"""K1: pre-norm -> QKV -> q/k-norm -> RoPE -> KV insert -> paged GQA attention (one launch).

A persistent launch of ``NPROG`` programs (one per SM/CU). Stages and task tables come from
``kernels/plan.py``: task ``t`` of a stage runs on program ``(t + OFF) % NPROG``. ``VP`` > 1 lets
one program stand for several (used only by the CPU interpreter, which runs programs one after
another: each stage then runs for all of them before the next stage starts). ``k_s*``/``v_s*``
are the block, token and head strides (elements) of the layer's K and V caches. ``BF16MB``
selects the bf16 mailbox format (``plan.MAILBOX_FORMATS``); ``PROF`` compiles in the stage
timestamps (``timeline.py``) written to ``prof_ptr``. ``ATTN_LAUNCH``: the attention and combine
stages run in a launch of their own (``ka.py``; K1 then skips them), or with ``KA_MIN_CTX`` > 0
there only in steps where a row's context reaches it, here otherwise.
"""

import triton
import triton.language as tl

from monodecode.kernels.triton.attention import attn_first_tile, attn_task, combine_task
from monodecode.kernels.triton.gemv import gemv_task, row_rstd, task_rows
from monodecode.kernels.triton.ka import long_context
from monodecode.kernels.triton.mailbox import (
    finish_launch,
    launch_epoch,
    publish,
    region,
    signal_done,
    signal_tasks,
    wait_done,
)
from monodecode.kernels.triton.overlap import await_previous, launch_next
from monodecode.kernels.triton.timeline import stamp


@triton.jit
def k1_kernel(
    x_ptr,
    norm_ptr,
    w_ptr,
    s_ptr,
    qnorm_ptr,
    knorm_ptr,
    inv_freq_ptr,
    kc_ptr,
    vc_ptr,
    k_sb,
    k_st,
    k_sh,
    v_sb,
    v_st,
    v_sh,
    pos_ptr,
    slot_ptr,
    bt_ptr,
    bt_stride,
    seq_ptr,
    out_ptr,
    mbox_ptr,
    health_ptr,
    prof_ptr,
    window,
    layer,
    spin_limit,
    stall,
    eps,
    scale,
    HIDDEN: tl.constexpr,
    NQKV: tl.constexpr,
    Q: tl.constexpr,
    KV: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    KVH: tl.constexpr,
    H: tl.constexpr,
    S: tl.constexpr,
    BS: tl.constexpr,
    BT: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    QKV_TASKS: tl.constexpr,
    QKV_OFF: tl.constexpr,
    ATTN_TASKS: tl.constexpr,
    ATTN_OFF: tl.constexpr,
    COMB_TASKS: tl.constexpr,
    COMB_OFF: tl.constexpr,
    EPOCH_W: tl.constexpr,
    DONE_W: tl.constexpr,
    QKV_W: tl.constexpr,
    ACC_W: tl.constexpr,
    ML_W: tl.constexpr,
    NPROG: tl.constexpr,
    PROF_GRID: tl.constexpr,  # program slots per kernel in the timestamps (``config.prof_grid``)
    VP: tl.constexpr,
    QK_NORM: tl.constexpr,
    ONE_PLUS: tl.constexpr,
    FP8: tl.constexpr,
    FLAT: tl.constexpr,
    SPLIT: tl.constexpr,
    BF16MB: tl.constexpr = False,
    PROF: tl.constexpr = False,
    ATTN_STAGES: tl.constexpr = 1,
    STORE_1D: tl.constexpr = False,
    FP8_PAIR: tl.constexpr = False,
    QKV_SRC: tl.constexpr = 0,
    QKV_ROWS: tl.constexpr = 0,
    ATTN_LAUNCH: tl.constexpr = False,
    KA_MIN_CTX: tl.constexpr = 0,
    PDL: tl.constexpr = 0,
    ATTN_PREFETCH: tl.constexpr = False,
):
    # PDL (``overlap.py``): the stream's next launch dispatched at entry (1) or at the end (2);
    # nothing is read before the previous launch has completed
    launch_next(PDL, 1)
    await_previous(PDL)
    epoch_ptr = mbox_ptr + EPOCH_W
    # this step's attention runs here, or in the attention launch (``ka.py``; same rule there)
    if KA_MIN_CTX > 0:
        here = long_context(seq_ptr, window, W, KA_MIN_CTX) == 0
    else:
        here = tl.zeros([], dtype=tl.int32) == (1 if ATTN_LAUNCH else 0)
    attn_tasks = tl.where(here, ATTN_TASKS, 0)
    comb_tasks = tl.where(here, COMB_TASKS, 0)
    epoch, tag = launch_epoch(epoch_ptr, NPROG)
    budget = tl.zeros([], dtype=tl.int64) + spin_limit
    code = 1 + (1 << 8) + (layer + 1) * 1024  # wait_timeout in k1 of this layer (base.health_code)
    bad_code = 3 + (1 << 8) + (layer + 1) * 1024  # kernel_error: a word without this launch's tag
    done_qkv = mbox_ptr + DONE_W
    done_attn = mbox_ptr + DONE_W + 1
    if BF16MB:
        qkv_mb = region(mbox_ptr, QKV_W, tl.bfloat16)
        acc_mb = region(mbox_ptr, ACC_W, tl.float32)
        ml_mb = region(mbox_ptr, ML_W, tl.float32)
    else:
        qkv_mb = mbox_ptr + QKV_W
        acc_mb = mbox_ptr + ACC_W
        ml_mb = mbox_ptr + ML_W
    rows = tl.arange(0, WP)
    rmask = rows < W

    # stage qkv: fused pre-norm + QKV GEMV, published as tagged words
    stamp(prof_ptr, layer, tl.program_id(0), 0, 0, 0, PROF_GRID, PROF)
    stamp(prof_ptr, layer, tl.program_id(0), 0, 0, 1, PROF_GRID, PROF)
    if QKV_SRC == 0:
        rstd = row_rstd(x_ptr, HIDDEN, rows, rmask, eps, HIDDEN, BK, WP, NUM_STAGES)
    else:  # applied to the QKV rows by gemv_task (``Target.deferred_rstd``)
        rstd = tl.zeros([WP], dtype=tl.float32)
    for v in tl.static_range(VP):
        pid = tl.program_id(0) * VP + v
        first = (pid - QKV_OFF + NPROG) % NPROG
        for t in tl.range(first, QKV_TASKS, NPROG, flatten=FLAT):
            n0 = t * QKV_ROWS
            y, _y = gemv_task(
                w_ptr,
                s_ptr,
                w_ptr,
                s_ptr,
                n0,
                NQKV,
                x_ptr,
                HIDDEN,
                norm_ptr,
                rstd,
                eps,
                tag,
                health_ptr,
                bad_code,
                HIDDEN,
                W,
                WP,
                BN,
                BK,
                QKV_SRC,
                False,
                FP8,
                ONE_PLUS,
                NUM_STAGES,
                SPLIT,
                FP8_PAIR,
                0,
                QKV_ROWS,
            )
            n, own = task_rows(n0, NQKV, BN, QKV_ROWS)
            # fault injection (stall != 0): never publish, so the waits below expire
            if STORE_1D and WP == 1:  # a 1-D store: its layout cannot leak back into the FMA tile
                publish(qkv_mb + n, tl.sum(y, axis=1), own & (stall == 0), tag, BF16MB)
            else:
                publish(
                    qkv_mb + rows[None, :] * NQKV + n[:, None],
                    y,
                    own[:, None] & rmask[None, :] & (stall == 0),
                    tag,
                    BF16MB,
                )
        if stall == 0:
            signal_tasks(done_qkv, first, QKV_TASKS, NPROG)
    stamp(prof_ptr, layer, tl.program_id(0), 0, 0, 2, PROF_GRID, PROF)

    # stage attn: (row, KV head, context split) partials
    stamp(prof_ptr, layer, tl.program_id(0), 0, 1, 0, PROF_GRID, PROF)
    for v in tl.static_range(VP):
        pid = tl.program_id(0) * VP + v
        first = (pid - ATTN_OFF + NPROG) % NPROG
        kv = (kc_ptr, vc_ptr, k_sb, k_st, k_sh, v_sb, v_st, v_sh)
        step = (pos_ptr, slot_ptr, bt_ptr, bt_stride, seq_ptr, window)
        if ATTN_PREFETCH:  # the first task's first K/V tile in flight across the wait
            pre = (
                first,
                attn_first_tile(first, first < attn_tasks, kv, step, (NQKV, Q, KV, D, G, GP, KVH, H, S, BS, BT)),
            )
        else:
            pre = None
        if first < attn_tasks:
            budget = wait_done(done_qkv, epoch * QKV_TASKS, budget, health_ptr, code)
        stamp(prof_ptr, layer, tl.program_id(0), 0, 1, 1, PROF_GRID, PROF)
        for t in range(first, attn_tasks, NPROG):
            attn_task(
                t,
                qkv_mb,
                acc_mb,
                ml_mb,
                (qnorm_ptr, knorm_ptr, inv_freq_ptr),
                kv,
                step,
                eps,
                scale,
                tag,
                health_ptr,
                bad_code,
                (NQKV, Q, KV, D, G, GP, KVH, H, S, BS, BT),
                QK_NORM,
                ONE_PLUS,
                BF16MB,
                ATTN_STAGES,
                pre,
                ATTN_PREFETCH,
            )
            signal_done(done_attn)
    stamp(prof_ptr, layer, tl.program_id(0), 0, 1, 2, PROF_GRID, PROF)

    # stage combine: merge the splits of each query head -> attn_out (bf16)
    stamp(prof_ptr, layer, tl.program_id(0), 0, 2, 0, PROF_GRID, PROF)
    for v in tl.static_range(VP):
        pid = tl.program_id(0) * VP + v
        first = (pid - COMB_OFF + NPROG) % NPROG
        if first < comb_tasks:
            budget = wait_done(done_attn, epoch * ATTN_TASKS, budget, health_ptr, code)
        stamp(prof_ptr, layer, tl.program_id(0), 0, 2, 1, PROF_GRID, PROF)
        for t in range(first, comb_tasks, NPROG):  # K1's S is a power of two: it is its own SP
            combine_task(t, acc_mb, ml_mb, out_ptr, tag, health_ptr, bad_code, Q, D, H, S, S, BF16MB)
    stamp(prof_ptr, layer, tl.program_id(0), 0, 2, 2, PROF_GRID, PROF)

    # when the attention launch runs this step's attention, it waits for this counter itself, and
    # settles it (``ka.py``)
    qkv_settled = tl.where(here, epoch * QKV_TASKS, 0)
    launch_next(PDL, 2)
    finish_launch(
        epoch_ptr,
        VP,
        NPROG,
        done_qkv,
        qkv_settled,
        done_attn,
        epoch * ATTN_TASKS,
        done_attn,
        epoch * ATTN_TASKS,
        done_attn,
        epoch * ATTN_TASKS,
        done_attn,
        epoch * ATTN_TASKS,
    )
