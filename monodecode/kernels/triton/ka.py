"""KA: K1's attention in a launch of its own, a plain grid of one program per task.

With ``Target.attn_launch`` K1 runs only its QKV stage, and this launch runs the attention:
task ``t`` is ``attention.attn_task`` (row, KV head, context split) over ``S`` splits chosen
for this launch (``config.attn_launch_splits``: several tasks per SM), not K1's one wave.

Why a separate launch: a persistent program is alone on its SM, and one program's attention
loop keeps too few K/V bytes in flight. At 32k positions x 8 rows (8B) K1's tasks read the
cache at 2.7-3.4 TB/s; this grid, whose programs share each SM three or four at a time, at
4.1 TB/s (``benchmarks/attention_probe.py``, run 45). Nothing here waits on another program
of the launch, so no co-residency is needed.

The merge needs no third launch: the last of a (row, KV head)'s ``S`` split tasks to finish
(an arrival counter per pair: every launch adds exactly ``S``, and the last arrival takes them
away again, so the int32 never grows however long a server runs) merges the group's query heads
(``attention.combine_task``) into K1's output. Its reads follow an acq_rel atomic that the other
splits' release ordered their partials before.

It waits, bounded, for K1's QKV stage counter, so a QKV stage that never signals (an injected
stall) still sets the health word with K1's wait site, and then settles the counter as K1's
last program would (``mailbox.finish_launch``). Only the bf16 mailbox (plain values, no tags).
"""

import triton
import triton.language as tl

from monodecode.kernels.triton.attention import attn_task, combine_group, combine_task
from monodecode.kernels.triton.mailbox import region, wait_done
from monodecode.kernels.triton.overlap import await_previous, launch_next


@triton.jit
def long_context(seq_ptr, window, W: tl.constexpr, MIN_CTX: tl.constexpr):
    """Whether a row of this step sees at least ``MIN_CTX`` positions in this layer
    (``Target.attn_launch_min_context``; a sliding layer sees at most its window): read from the
    step's sequence lengths, so every program of K1 and of this launch decides the same. (A step
    has at most 16 rows: ``config.MAX_WIDTH``.)"""
    rows = tl.arange(0, 16)
    seen = tl.max(tl.load(seq_ptr + rows, mask=rows < W, other=0), axis=0)
    seen = tl.where(window > 0, tl.minimum(seen, window), seen)
    return seen >= MIN_CTX


@triton.jit
def ka_kernel(
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
    part_ptr,
    arrive_ptr,
    window,
    layer,
    spin_limit,
    eps,
    scale,
    NQKV: tl.constexpr,
    Q: tl.constexpr,
    KV: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    KVH: tl.constexpr,
    H: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,
    BS: tl.constexpr,
    BT: tl.constexpr,
    W: tl.constexpr,
    QKV_TASKS: tl.constexpr,
    EPOCH_W: tl.constexpr,
    DONE_W: tl.constexpr,
    QKV_W: tl.constexpr,
    NPROG: tl.constexpr,
    QK_NORM: tl.constexpr,
    ONE_PLUS: tl.constexpr,
    ATTN_STAGES: tl.constexpr,
    KA_MIN_CTX: tl.constexpr = 0,
    PDL: tl.constexpr = 0,
    GQ: tl.constexpr = 0,
    DC: tl.constexpr = 0,
):
    launch_next(PDL, 1)  # ``overlap.py``: K2 dispatched now, or (2) as this program ends
    await_previous(PDL)
    go = True
    if KA_MIN_CTX > 0:  # both paths built: K1 ran the attention itself unless a row's context is long
        go = long_context(seq_ptr, window, W, KA_MIN_CTX)
    if go:  # one task: wait for K1's QKV stage, attend, and merge if last of its group
        t = tl.program_id(0)
        # K1 has ended (stream order): its launch counter reads epoch * NPROG (``launch_epoch``)
        epoch = tl.load(mbox_ptr + EPOCH_W, volatile=True) // NPROG
        code = 1 + (1 << 8) + (layer + 1) * 1024  # wait_timeout in k1 of this layer (base.health_code)
        bad_code = 3 + (1 << 8) + (layer + 1) * 1024
        budget = tl.zeros([], dtype=tl.int64) + spin_limit
        if tl.load(health_ptr, volatile=True) != 0:  # a failure is already recorded: do not spin again
            budget = budget * 0
        done_qkv = mbox_ptr + DONE_W
        budget = wait_done(done_qkv, epoch * QKV_TASKS, budget, health_ptr, code)
        tl.atomic_max(done_qkv, epoch * QKV_TASKS, sem="relaxed")
        qkv_mb = region(mbox_ptr, QKV_W, tl.bfloat16)
        acc_mb = part_ptr
        ml_mb = part_ptr + W * H * S * D
        tag = epoch & 0x7FFFFFFF  # unused by the bf16 mailbox's reads
        attn_task(
            t,
            qkv_mb,
            acc_mb,
            ml_mb,
            (qnorm_ptr, knorm_ptr, inv_freq_ptr),
            (kc_ptr, vc_ptr, k_sb, k_st, k_sh, v_sb, v_st, v_sh),
            (pos_ptr, slot_ptr, bt_ptr, bt_stride, seq_ptr, window),
            eps,
            scale,
            tag,
            health_ptr,
            bad_code,
            (NQKV, Q, KV, D, G, GP, KVH, H, S, BS, BT),
            QK_NORM,
            ONE_PLUS,
            True,
            ATTN_STAGES,
        )
        pair = t // S  # (row, KV head)
        tl.debug_barrier()  # every thread's partials stored before the release below
        old = tl.atomic_add(arrive_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if old % S == S - 1:
            tl.atomic_add(arrive_ptr + pair, -S, sem="relaxed", scope="gpu")  # every split has arrived
            if DC > 0:  # ``Target.attn_launch_group_merge``: the group's heads in one merge
                combine_group(
                    pair, acc_mb, ml_mb, out_ptr, tag, health_ptr, bad_code, Q, D, H, G, GQ, KVH, S, SP, DC, True
                )
            else:
                r = pair // KVH
                g = pair % KVH
                for hh in range(G):
                    combine_task(
                        r * H + g * G + hh, acc_mb, ml_mb, out_ptr, tag, health_ptr, bad_code, Q, D, H, S, SP, True
                    )
    launch_next(PDL, 2)
