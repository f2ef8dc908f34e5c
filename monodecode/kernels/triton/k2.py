"""K2: O proj -> (Gemma post-attn norm) -> residual -> pre-MLP norm -> gate/up -> act -> down ->
(Gemma post-MLP norm) -> residual (one persistent launch; stages from ``kernels/plan.py``).

Rounding follows the reference (``k2_reference``): every projection output, norm, activation,
product and residual add is rounded to bf16 where Hugging Face rounds it; accumulation is fp32.
``BF16MB`` selects the bf16 mailbox format, ``PROF`` the stage timestamps (as in K1). Where the
plan halves gate/up and down (``plan.early_down_waves``), each runs its two halves through one
copy of its task loop, a program's first down half as soon as gate/up's first half is done.
"""

import triton
import triton.language as tl

from monodecode.kernels.triton.gemv import gemv_task, rms_apply, task_rows
from monodecode.kernels.triton.mailbox import (
    fetch,
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
def _activation(g, GELU: tl.constexpr):
    """act(g) for fp32 g: GELU-tanh (tanh through exp) or SiLU."""
    if GELU:
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        th = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        return 0.5 * g * (1.0 + th)
    else:
        return g / (1.0 + tl.exp(-g))


@triton.jit
def _residual(base, y):
    """bf16(base + bf16(y)) as fp32: a GEMV's output rounded to bf16, added to the residual,
    rounded again (HF's bf16 residual add)."""
    return (base + y.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _check_finite(val, mask, health_ptr, code):
    bad = tl.sum(tl.ravel((mask & ((val != val) | (tl.abs(val) == float("inf")))).to(tl.int32)), axis=0)
    if bad > 0:
        tl.atomic_cas(health_ptr, 0, code)


@triton.jit
def _residual_out(
    h_mb, out_ptr, y, n, rows, om, nan_fault, tag, health_ptr, bad_code, nf_code,
    HIDDEN: tl.constexpr, BF16MB: tl.constexpr,
):  # fmt: skip
    """The layer's output rows ``n``: bf16(h + bf16(y)), checked finite (the NaN drill injects one
    at row 0, column 0), stored where ``om``."""
    hv = fetch(h_mb + rows[None, :] * HIDDEN + n[:, None], om, tag, health_ptr, bad_code, BF16MB)
    out = _residual(hv, y)
    out = tl.where((nan_fault != 0) & (rows[None, :] == 0) & (n[:, None] == 0), float("nan"), out)
    _check_finite(out, om, health_ptr, nf_code)
    tl.store(out_ptr + rows[None, :] * HIDDEN + n[:, None], out.to(tl.bfloat16), mask=om)


@triton.jit
def _tile_slice(t, rows, TILES: tl.constexpr, ROWS: tl.constexpr, KT: tl.constexpr, KS: tl.constexpr, W: tl.constexpr):
    """GEMV task ``t``'s first output row, first K column and output rows in its mailbox region:
    row tile ``t % TILES`` of K slice ``t // TILES`` (partials of slice s at rows s*W..), or,
    unsplit, tile ``t`` over all of K (the same code as before split-K existed)."""
    if KS > 1:
        return (t % TILES) * ROWS, (t // TILES) * KT, (t // TILES) * W + rows
    else:
        return t * ROWS, 0, rows


@triton.jit
def _row_sum(
    mb,
    r,
    k,
    km,
    tag,
    health_ptr,
    bad_code,
    HIDDEN: tl.constexpr,
    W: tl.constexpr,
    KS: tl.constexpr,
    BF16MB: tl.constexpr,
):
    """Row ``r`` of a GEMV stage's output: its values, or the sum of its ``KS`` fp32 K-slice
    partials in slice order (split-K; deterministic)."""
    v = fetch(mb + r * HIDDEN + k, km, tag, health_ptr, bad_code, BF16MB)
    for s in tl.static_range(1, KS):
        v += fetch(mb + (s * W + r) * HIDDEN + k, km, tag, health_ptr, bad_code, BF16MB)
    return v


@triton.jit
def _post_task(
    r,
    x_ptr,
    o_mb,
    h_mb,
    hn_mb,
    post_w_ptr,
    mlp_w_ptr,
    eps,
    tag,
    health_ptr,
    bad_code,
    HIDDEN: tl.constexpr,
    HP: tl.constexpr,
    POST_NORMS: tl.constexpr,
    ONE_PLUS: tl.constexpr,
    BF16MB: tl.constexpr,
    W: tl.constexpr,
    KS: tl.constexpr,
):
    """Row r, whole row in registers: h = bf16(x + o'), o' = bf16(o) or Gemma's bf16(norm(o) * (1 + w));
    hn = norm(h). Both published. ``KS`` > 1: o arrives as that many K-slice partials."""
    k = tl.arange(0, HP)
    km = k < HIDDEN
    o = tl.where(km, _row_sum(o_mb, r, k, km, tag, health_ptr, bad_code, HIDDEN, W, KS, BF16MB), 0.0)
    o = o.to(tl.bfloat16).to(tl.float32)
    if POST_NORMS:
        rstd_o = 1.0 / tl.sqrt_rn(tl.sum(o * o, axis=0) / HIDDEN + eps)
        o = rms_apply(o, rstd_o, tl.load(post_w_ptr + k, mask=km, other=0.0).to(tl.float32), ONE_PLUS).to(tl.float32)
    xr = tl.load(x_ptr + r * HIDDEN + k, mask=km, other=0.0).to(tl.float32)
    h = tl.where(km, (xr + o).to(tl.bfloat16).to(tl.float32), 0.0)
    publish(h_mb + r * HIDDEN + k, h, km, tag, BF16MB)
    rstd_h = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / HIDDEN + eps)
    hn = rms_apply(h, rstd_h, tl.load(mlp_w_ptr + k, mask=km, other=0.0).to(tl.float32), ONE_PLUS)
    publish(hn_mb + r * HIDDEN + k, hn.to(tl.float32), km, tag, BF16MB)


@triton.jit
def _final_task(
    r,
    d_mb,
    h_mb,
    w_ptr,
    out_ptr,
    eps,
    nan_fault,
    tag,
    health_ptr,
    bad_code,
    nf_code,
    HIDDEN: tl.constexpr,
    HP: tl.constexpr,
    ONE_PLUS: tl.constexpr,
    BF16MB: tl.constexpr,
    W: tl.constexpr,
    KS: tl.constexpr,
    POST_NORMS: tl.constexpr,
):
    """Row r: out = bf16(h + d'), d' = Gemma's bf16(norm(d) * (1 + w)) or, after a split down
    (``KS`` > 1 K-slice partials of d), bf16(d)."""
    k = tl.arange(0, HP)
    km = k < HIDDEN
    dv = tl.where(km, _row_sum(d_mb, r, k, km, tag, health_ptr, bad_code, HIDDEN, W, KS, BF16MB), 0.0)
    dv = dv.to(tl.bfloat16).to(tl.float32)
    hv = fetch(h_mb + r * HIDDEN + k, km, tag, health_ptr, bad_code, BF16MB)
    if POST_NORMS:
        rstd = 1.0 / tl.sqrt_rn(tl.sum(dv * dv, axis=0) / HIDDEN + eps)
        dv = rms_apply(dv, rstd, tl.load(w_ptr + k, mask=km, other=0.0).to(tl.float32), ONE_PLUS).to(tl.float32)
    out = (hv + dv).to(tl.bfloat16).to(tl.float32)
    out = tl.where((nan_fault != 0) & (r == 0) & (k == 0), float("nan"), out)
    _check_finite(out, km, health_ptr, nf_code)
    tl.store(out_ptr + r * HIDDEN + k, out.to(tl.bfloat16), mask=km)


@triton.jit
def _merge_tile(
    arrive_ptr, tile, part_mb, n, rows, om, tag, health_ptr, bad_code,
    HIDDEN: tl.constexpr, W: tl.constexpr, KS: tl.constexpr, BF16MB: tl.constexpr,
):  # fmt: skip
    """One K slice of a split row tile (output rows ``n``) arrives, its partial already published
    (and the program's threads synchronised since): the tile's arrival counter says whether it is
    the last (every launch adds exactly ``KS``; the last arrival takes them away again, so the
    int32 never grows however long a server runs, and stream order keeps launches apart). Returns (last, sum):
    the KS partials added in slice order, loaded only where ``last`` (the other slices' partials
    are visible there: their release ordered them before the counter, this acq_rel atomic the
    reads after it). The slice order gives the same bits whichever slice arrives last, and the
    same as the post / final stages' ``_row_sum``."""
    old = tl.atomic_add(arrive_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = (old % KS) == KS - 1
    tl.atomic_add(arrive_ptr + tile, -KS, mask=last, sem="relaxed", scope="gpu")
    m = om & last
    total = fetch(part_mb + rows[None, :] * HIDDEN + n[:, None], m, tag, health_ptr, bad_code, BF16MB)
    for s in tl.static_range(1, KS):
        total += fetch(part_mb + (s * W + rows)[None, :] * HIDDEN + n[:, None], m, tag, health_ptr, bad_code, BF16MB)
    return last, total


@triton.jit
def _gate_up_tasks(
    first,
    tasks,
    row0,
    wg_ptr,
    sg_ptr,
    wu_ptr,
    su_ptr,
    gu_in,
    mlp_w_ptr,
    act_mb,
    zero,
    eps,
    tag,
    health_ptr,
    bad_code,
    HIDDEN: tl.constexpr,
    I: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    GU_BN: tl.constexpr,
    GU_BK: tl.constexpr,
    GU_ROWS: tl.constexpr,
    GU_SRC: tl.constexpr,
    GU_SPLIT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    NPROG: tl.constexpr,
    FLAT: tl.constexpr,
    FP8: tl.constexpr,
    FP8_PAIR: tl.constexpr,
    ONE_PLUS: tl.constexpr,
    GELU: tl.constexpr,
    BF16MB: tl.constexpr,
):
    """This program's gate/up tasks ``first, first + NPROG, ...`` below ``tasks``, task t on
    rows ``row0 + t * GU_ROWS``: act = bf16(act(bf16(g)) * bf16(u)) published to ``act_mb``."""
    rows = tl.arange(0, WP)
    rmask = rows < W
    for t in tl.range(first, tasks, NPROG, flatten=FLAT):
        n0 = row0 + t * GU_ROWS
        g, u = gemv_task(
            wg_ptr,
            sg_ptr,
            wu_ptr,
            su_ptr,
            n0,
            I,
            gu_in,
            HIDDEN,
            mlp_w_ptr,
            zero,
            eps,
            tag,
            health_ptr,
            bad_code,
            HIDDEN,
            W,
            WP,
            GU_BN,
            GU_BK,
            GU_SRC,
            True,
            FP8,
            ONE_PLUS,
            NUM_STAGES,
            GU_SPLIT,
            FP8_PAIR,
            0,
            GU_ROWS,
        )
        gb = g.to(tl.bfloat16).to(tl.float32)
        ub = u.to(tl.bfloat16).to(tl.float32)
        a = _activation(gb, GELU).to(tl.bfloat16).to(tl.float32)
        m = (a * ub).to(tl.bfloat16).to(tl.float32)
        n, own = task_rows(n0, I, GU_BN, GU_ROWS)
        publish(act_mb + rows[None, :] * I + n[:, None], m, own[:, None] & rmask[None, :], tag, BF16MB)


@triton.jit
def k2_kernel(
    x_ptr,
    attn_ptr,
    wo_ptr,
    so_ptr,
    post_w_ptr,
    mlp_w_ptr,
    wg_ptr,
    sg_ptr,
    wu_ptr,
    su_ptr,
    wd_ptr,
    sd_ptr,
    mlp_post_w_ptr,
    out_ptr,
    mbox_ptr,
    health_ptr,
    prof_ptr,
    arrive_ptr,
    layer,
    spin_limit,
    nan_fault,
    eps,
    HIDDEN: tl.constexpr,
    HP: tl.constexpr,
    Q: tl.constexpr,
    I: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    O_BN: tl.constexpr,
    O_BK: tl.constexpr,
    GU_BN: tl.constexpr,
    GU_BK: tl.constexpr,
    D_BN: tl.constexpr,
    D_BK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    O_TASKS: tl.constexpr,
    O_OFF: tl.constexpr,
    POST_OFF: tl.constexpr,
    GU_TASKS: tl.constexpr,
    GU_OFF: tl.constexpr,
    D_TASKS: tl.constexpr,
    D_OFF: tl.constexpr,
    FIN_OFF: tl.constexpr,
    EPOCH_W: tl.constexpr,
    DONE_W: tl.constexpr,
    O_W: tl.constexpr,
    H_W: tl.constexpr,
    HN_W: tl.constexpr,
    ACT_W: tl.constexpr,
    D_W: tl.constexpr,
    NPROG: tl.constexpr,
    PROF_GRID: tl.constexpr,  # program slots per kernel in the timestamps (``config.prof_grid``)
    VP: tl.constexpr,
    POST_NORMS: tl.constexpr,
    ONE_PLUS: tl.constexpr,
    FP8: tl.constexpr,
    GELU: tl.constexpr,
    FLAT: tl.constexpr,
    O_SPLIT: tl.constexpr,
    GU_SPLIT: tl.constexpr,
    D_SPLIT: tl.constexpr,
    BF16MB: tl.constexpr = False,
    PROF: tl.constexpr = False,
    FP8_PAIR: tl.constexpr = False,
    NO_POST: tl.constexpr = False,
    FINAL: tl.constexpr = False,
    O_KS: tl.constexpr = 1,
    D_KS: tl.constexpr = 1,
    O_ROWS: tl.constexpr = 0,
    GU_ROWS: tl.constexpr = 0,
    D_ROWS: tl.constexpr = 0,
    GU_LO_TASKS: tl.constexpr = 0,
    GU_LO_OFF: tl.constexpr = 0,
    GU_ROW0: tl.constexpr = 0,
    D_K0: tl.constexpr = 0,
    D_LO_W: tl.constexpr = 0,
    O_MERGE: tl.constexpr = False,
    D_MERGE: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    # FINAL: a final row stage (Gemma's post-MLP norm, or the residual add after a split down).
    # O_KS / D_KS > 1: o_proj / down split along K (task t: row tile t % *_TILES, K slice
    # t // *_TILES), publishing fp32 partials that post / final sum in slice order.
    # GU_LO_TASKS > 0 (``plan.early_down_waves``): gate/up runs its first GU_LO_TASKS tasks as a
    # stage of their own (counted on its own), then GU_TASKS more from row GU_ROW0; down runs
    # columns [0, D_K0) of each of this program's row tiles into d_lo once that first half is
    # done, then columns [D_K0, I) once all of gate/up is, adding its own d_lo partial.
    # O_MERGE / D_MERGE (``config.split_k_merges``): the last K slice of a split o_proj / down row
    # tile to finish sums the tile's partials in slice order (``_merge_tile``) and adds the
    # residual itself, so a split o_proj needs no post stage (NO_POST) and a split down no final
    # one (FINAL off).
    # PDL (``overlap.py``): the stream's next launch dispatched at entry (1) or at the end (2).
    O_TILES: tl.constexpr = O_TASKS // O_KS
    D_TILES: tl.constexpr = D_TASKS // D_KS
    D_ARRIVE: tl.constexpr = O_TILES if O_MERGE else 0  # down's arrival counters follow o_proj's
    launch_next(PDL, 1)
    await_previous(PDL)
    epoch_ptr = mbox_ptr + EPOCH_W
    epoch, tag = launch_epoch(epoch_ptr, NPROG)
    budget = tl.zeros([], dtype=tl.int64) + spin_limit
    code = 1 + (2 << 8) + (layer + 1) * 1024  # wait_timeout in k2 of this layer
    nf_code = 2 + (2 << 8) + (layer + 1) * 1024  # nonfinite in k2 of this layer
    bad_code = 3 + (2 << 8) + (layer + 1) * 1024  # kernel_error: a word without this launch's tag
    done_o = mbox_ptr + DONE_W
    done_post = mbox_ptr + DONE_W + 1
    done_gu = mbox_ptr + DONE_W + 2
    done_down = mbox_ptr + DONE_W + 3
    HALVES: tl.constexpr = 2 if GU_LO_TASKS > 0 else 1
    # gate/up's first half (plan.OPTIONAL_DONE_STAGES); without it, down's counter stands in
    # where the launch's exit settles the counters
    if HALVES == 2:
        gu_lo_ctr = mbox_ptr + DONE_W + 4
    else:
        gu_lo_ctr = done_down
    GU_LO_COUNT: tl.constexpr = GU_LO_TASKS if HALVES == 2 else D_TASKS
    # h's producers: the post stage, or with NO_POST o_proj's tasks (they add the residual)
    if NO_POST:
        h_done = done_o
    else:
        h_done = done_post
    H_TASKS: tl.constexpr = O_TASKS if NO_POST else W
    if BF16MB:
        o_mb = region(mbox_ptr, O_W, tl.float32 if O_KS > 1 else tl.bfloat16)
        h_mb = region(mbox_ptr, H_W, tl.bfloat16)
        hn_mb = region(mbox_ptr, HN_W, tl.bfloat16)
        act_mb = region(mbox_ptr, ACT_W, tl.bfloat16)
        d_mb = region(mbox_ptr, D_W, tl.float32 if D_KS > 1 else tl.bfloat16)
        dlo_mb = region(mbox_ptr, D_LO_W, tl.float32)
    else:
        o_mb = mbox_ptr + O_W
        h_mb = mbox_ptr + H_W
        hn_mb = mbox_ptr + HN_W
        act_mb = mbox_ptr + ACT_W
        d_mb = mbox_ptr + D_W
        dlo_mb = mbox_ptr + D_LO_W
    MB_SRC: tl.constexpr = 3 if BF16MB else 2  # gemv input: bf16 mailbox or tagged words
    O_K: tl.constexpr = Q // O_KS  # the reduction length of one o_proj / down task
    D_K: tl.constexpr = (I - D_K0) // D_KS  # with HALVES, each half's (the plan cuts I in two)
    me = tl.program_id(0)
    rows = tl.arange(0, WP)
    rmask = rows < W
    zero = tl.zeros([WP], dtype=tl.float32)

    # o_proj (input: K1's bf16 output, a launch input)
    stamp(prof_ptr, layer, me, 1, 0, 0, PROF_GRID, PROF)
    stamp(prof_ptr, layer, me, 1, 0, 1, PROF_GRID, PROF)
    for v in tl.static_range(VP):
        pid = tl.program_id(0) * VP + v
        first = (pid - O_OFF + NPROG) % NPROG
        for t in tl.range(first, O_TASKS, NPROG, flatten=FLAT):
            n0, k0, o_rows = _tile_slice(t, rows, O_TILES, O_ROWS, O_K, O_KS, W)
            y, _y = gemv_task(
                wo_ptr + k0,
                so_ptr,
                wo_ptr + k0,
                so_ptr,
                n0,
                HIDDEN,
                attn_ptr + k0,
                Q,
                post_w_ptr,
                zero,
                0.0,
                tag,
                health_ptr,
                bad_code,
                O_K,
                W,
                WP,
                O_BN,
                O_BK,
                1,
                False,
                FP8,
                ONE_PLUS,
                NUM_STAGES,
                O_SPLIT,
                FP8_PAIR,
                Q,
                O_ROWS,
            )
            n, own = task_rows(n0, HIDDEN, O_BN, O_ROWS)
            om = own[:, None] & rmask[None, :]
            if NO_POST and O_KS == 1:  # the residual add of the post stage, h = bf16(x + bf16(o)), done here
                xr = tl.load(x_ptr + rows[None, :] * HIDDEN + n[:, None], mask=om, other=0.0).to(tl.float32)
                publish(h_mb + rows[None, :] * HIDDEN + n[:, None], _residual(xr, y), om, tag, BF16MB)
            else:
                publish(o_mb + o_rows[None, :] * HIDDEN + n[:, None], y, om, tag, BF16MB, O_KS > 1)
        if O_MERGE:  # h = bf16(x + bf16(o)) by each tile's last slice (after the K loop,
            # which then pipelines as without it: no barrier or atomic inside)
            tl.debug_barrier()  # every thread's partials stored before the releases below
            for t in range(first, O_TASKS, NPROG):
                n0, _k0, _r = _tile_slice(t, rows, O_TILES, O_ROWS, O_K, O_KS, W)
                n, own = task_rows(n0, HIDDEN, O_BN, O_ROWS)
                om = own[:, None] & rmask[None, :]
                last, o = _merge_tile(arrive_ptr, t % O_TILES, o_mb, n, rows, om, tag, health_ptr, bad_code,
                                      HIDDEN, W, O_KS, BF16MB)  # fmt: skip
                hm = om & last
                xr = tl.load(x_ptr + rows[None, :] * HIDDEN + n[:, None], mask=hm, other=0.0).to(tl.float32)
                publish(h_mb + rows[None, :] * HIDDEN + n[:, None], _residual(xr, o), hm, tag, BF16MB)
        signal_tasks(done_o, first, O_TASKS, NPROG)
    stamp(prof_ptr, layer, me, 1, 0, 2, PROF_GRID, PROF)

    # post: one task per row (none with NO_POST: o_proj adds the residual, gate/up normalises)
    if not NO_POST:  # (no stamps either: the timeline reads a stage never stamped as absent)
        stamp(prof_ptr, layer, me, 1, 1, 0, PROF_GRID, PROF)
        for v in tl.static_range(VP):
            pid = tl.program_id(0) * VP + v
            first = (pid - POST_OFF + NPROG) % NPROG
            if first < W:
                budget = wait_done(done_o, epoch * O_TASKS, budget, health_ptr, code)
            stamp(prof_ptr, layer, me, 1, 1, 1, PROF_GRID, PROF)
            for r in range(first, W, NPROG):
                _post_task(
                    r,
                    x_ptr,
                    o_mb,
                    h_mb,
                    hn_mb,
                    post_w_ptr,
                    mlp_w_ptr,
                    eps,
                    tag,
                    health_ptr,
                    bad_code,
                    HIDDEN,
                    HP,
                    POST_NORMS,
                    ONE_PLUS,
                    BF16MB,
                    W,
                    O_KS,
                )
                signal_done(done_post)
        stamp(prof_ptr, layer, me, 1, 1, 2, PROF_GRID, PROF)

    # gate/up + activation; with NO_POST its input is h, normalised on the way (``gemv`` SRC 5)
    if NO_POST:
        gu_in = h_mb
    else:
        gu_in = hn_mb
    GU_SRC: tl.constexpr = 5 if NO_POST else MB_SRC
    stamp(prof_ptr, layer, me, 1, 2, 0, PROF_GRID, PROF)
    for v in tl.static_range(VP):
        pid = tl.program_id(0) * VP + v
        first_lo = (pid - GU_LO_OFF + NPROG) % NPROG
        first_hi = (pid - GU_OFF + NPROG) % NPROG
        if (first_lo < GU_LO_TASKS) | (first_hi < GU_TASKS):
            budget = wait_done(h_done, epoch * H_TASKS, budget, health_ptr, code)
        stamp(prof_ptr, layer, me, 1, 2, 1, PROF_GRID, PROF)
        for part in range(HALVES):  # a loop, not unrolled: one copy of the task loop's code
            lo = (HALVES == 2) & (part == 0)
            first = tl.where(lo, first_lo, first_hi)
            tasks = tl.where(lo, GU_LO_TASKS, GU_TASKS)
            _gate_up_tasks(
                first,
                tasks,
                tl.where(lo, 0, GU_ROW0),
                wg_ptr,
                sg_ptr,
                wu_ptr,
                su_ptr,
                gu_in,
                mlp_w_ptr,
                act_mb,
                zero,
                eps,
                tag,
                health_ptr,
                bad_code,
                HIDDEN,
                I,
                W,
                WP,
                GU_BN,
                GU_BK,
                GU_ROWS,
                GU_SRC,
                GU_SPLIT,
                NUM_STAGES,
                NPROG,
                FLAT,
                FP8,
                FP8_PAIR,
                ONE_PLUS,
                GELU,
                BF16MB,
            )
            signal_tasks(tl.where(lo, gu_lo_ctr, done_gu), first, tasks, NPROG)
    stamp(prof_ptr, layer, me, 1, 2, 2, PROF_GRID, PROF)

    # down (+ residual, unless a final norm stage follows). Waiting for gate/up also covers h:
    # every gate/up task acquired h's producers (post, or o_proj with NO_POST) before releasing
    # its own count; programs without gate/up tasks acquire them here. With HALVES, the first
    # pass covers columns [0, D_K0) of this program's row tiles (an fp32 partial in d_lo, after
    # gate/up's first half), the second the rest, adding that partial first (K order).
    stamp(prof_ptr, layer, me, 1, 3, 0, PROF_GRID, PROF)
    for v in tl.static_range(VP):
        pid = tl.program_id(0) * VP + v
        first = (pid - D_OFF + NPROG) % NPROG
        for part in range(HALVES):
            lo = (HALVES == 2) & (part == 0)
            if first < D_TASKS:
                if lo:
                    budget = wait_done(gu_lo_ctr, epoch * GU_LO_TASKS, budget, health_ptr, code)
                else:
                    budget = wait_done(done_gu, epoch * GU_TASKS, budget, health_ptr, code)
                    budget = wait_done(h_done, epoch * H_TASKS, budget, health_ptr, code)
            if part == 0:
                stamp(prof_ptr, layer, me, 1, 3, 1, PROF_GRID, PROF)
            else:
                tl.debug_barrier()  # d_lo is read back by this program's threads, whichever wrote it
            for t in tl.range(first, D_TASKS, NPROG, flatten=FLAT):
                n0, k0, d_rows = _tile_slice(t, rows, D_TILES, D_ROWS, D_K, D_KS, W)
                k0 += part * D_K0
                y, _y = gemv_task(
                    wd_ptr + k0,
                    sd_ptr,
                    wd_ptr + k0,
                    sd_ptr,
                    n0,
                    HIDDEN,
                    act_mb + k0,
                    I,
                    post_w_ptr,
                    zero,
                    0.0,
                    tag,
                    health_ptr,
                    bad_code,
                    D_K,
                    W,
                    WP,
                    D_BN,
                    D_BK,
                    MB_SRC,
                    False,
                    FP8,
                    ONE_PLUS,
                    NUM_STAGES,
                    D_SPLIT,
                    FP8_PAIR,
                    I,
                    D_ROWS,
                )
                n, own = task_rows(n0, HIDDEN, D_BN, D_ROWS)
                om = own[:, None] & rmask[None, :]
                lo_rows = dlo_mb + rows[None, :] * HIDDEN + n[:, None]
                if lo:
                    publish(lo_rows, y, om, tag, BF16MB, True)
                else:
                    if HALVES == 2:
                        y = fetch(lo_rows, om, tag, health_ptr, bad_code, BF16MB) + y
                    if FINAL or D_MERGE:
                        publish(d_mb + d_rows[None, :] * HIDDEN + n[:, None], y, om, tag, BF16MB, D_KS > 1)
                    else:
                        _residual_out(h_mb, out_ptr, y, n, rows, om, nan_fault, tag, health_ptr, bad_code, nf_code,
                                      HIDDEN, BF16MB)  # fmt: skip
        if D_MERGE:  # out = bf16(h + bf16(d)) by each tile's last slice (as o_proj's)
            tl.debug_barrier()
            for t in range(first, D_TASKS, NPROG):
                n0, _k0, _r = _tile_slice(t, rows, D_TILES, D_ROWS, D_K, D_KS, W)
                n, own = task_rows(n0, HIDDEN, D_BN, D_ROWS)
                om = own[:, None] & rmask[None, :]
                last, d = _merge_tile(arrive_ptr, D_ARRIVE + t % D_TILES, d_mb, n, rows, om, tag, health_ptr,
                                      bad_code, HIDDEN, W, D_KS, BF16MB)  # fmt: skip
                _residual_out(h_mb, out_ptr, d, n, rows, om & last, nan_fault, tag, health_ptr, bad_code, nf_code,
                              HIDDEN, BF16MB)  # fmt: skip
        if FINAL:
            signal_tasks(done_down, first, D_TASKS, NPROG)
    stamp(prof_ptr, layer, me, 1, 3, 2, PROF_GRID, PROF)

    if FINAL:
        stamp(prof_ptr, layer, me, 1, 4, 0, PROF_GRID, PROF)
        for v in tl.static_range(VP):
            pid = tl.program_id(0) * VP + v
            first = (pid - FIN_OFF + NPROG) % NPROG
            if first < W:
                budget = wait_done(done_down, epoch * D_TASKS, budget, health_ptr, code)
                budget = wait_done(h_done, epoch * H_TASKS, budget, health_ptr, code)
            stamp(prof_ptr, layer, me, 1, 4, 1, PROF_GRID, PROF)
            for r in range(first, W, NPROG):
                _final_task(
                    r,
                    d_mb,
                    h_mb,
                    mlp_post_w_ptr,
                    out_ptr,
                    eps,
                    nan_fault,
                    tag,
                    health_ptr,
                    bad_code,
                    nf_code,
                    HIDDEN,
                    HP,
                    ONE_PLUS,
                    BF16MB,
                    W,
                    D_KS,
                    POST_NORMS,
                )
        stamp(prof_ptr, layer, me, 1, 4, 2, PROF_GRID, PROF)

    launch_next(PDL, 2)
    finish_launch(
        epoch_ptr,
        VP,
        NPROG,
        done_o,
        epoch * O_TASKS,
        done_post,
        epoch * W,
        done_gu,
        epoch * GU_TASKS,
        done_down,
        epoch * D_TASKS,
        gu_lo_ctr,
        epoch * GU_LO_COUNT,
    )
