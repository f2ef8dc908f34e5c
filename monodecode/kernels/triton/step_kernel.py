"""The step launch: decoder layers ``first .. first + nlayers - 1`` of a decode step in ONE persistent launch.

Gluon (Triton's explicit-layout dialect) for NVIDIA sm_90: the weight ring is filled by TMA
(width 1, and above where it is 4 slots deep) or ``cp.async``, the attention's K/V ring by
``cp.async``, and the GEMV at widths 2-8 and the attention run on ``mma.sync``. The plan is
``step_plan.py``'s; the design was measured first as ``benchmarks/step_probe.py`` (runs 86-104),
whose fastest form this is, with what serving needs added: vLLM's paged KV cache (block tables,
slot mapping, per-layer caches), each row at its own position and context, inert padded rows
(slot -1), bf16 residuals in and out, bounded waits and non-finite checks that set the health
word, and one-shot fault injection.

One program per SM walks one fixed sequence of [16 rows, WX x 1024 columns] weight chunks (its
row tiles of QKV, o_proj, gate/up and down, layer after layer) through ``NBUF`` shared-memory
slots (32 KiB by default: bf16, or FP8 in two 1024-column parts), ``NBUF - 1`` chunks ahead of
the arithmetic across every wait and the attention task.
Stages hand off through int64 completion counters (one count per program, or per merged KV head
and row) that never reset: launch ``e`` waits for ``e * count`` (the epoch comes from a launch
counter every program advances at exit). Down waits for gate/up's rounds but its last (a count
of their own) and for the rest only where its first task reaches their chunks (``DE``). A wait
polls at most ``spin`` times in all per program;
an expired wait records ``wait_timeout`` in the health word and the launch runs on with whatever
it reads, so it always ends.

Numerics follow ``monodecode.model.reference`` (fp32 sums; bf16 where the reference rounds:
q/k/v, RoPE's cos/sin and results, the attention output, each projection, SiLU(g)·u, both
residual adds). One difference: RMSNorm's rstd multiplies each output row's sum (the staged input
carries ``x · w``), where the reference rounds ``x̂`` before the weight.

Gemma-3 (``GEMMA``, width 1 only): each attention task normalises its q rows and k per head
before RoPE (the K it writes is the normed, rotated one), a sliding layer's task reads only its
row's last ``window`` positions, and RoPE has a table per layer kind. The post norms need a whole
row: o_proj and down store their raw sums, and the staging pass that reads them anyway (gate/up's
input; the next layer's QKV input; after the last layer, a stage of its own) normalises them in
every program, adds the residual, writes this program's tiles' rows of the new residual (so the
rows are written once, in one order of summation) and stages the next norm's input. Gate/up
makes GELU-tanh(g)·u; a stage of K = hidden (5376) ends in a zero-filled chunk.

The weights of every layer are one block of bf16, or of e4m3fn with ``FP8`` (each packed row's
fp32 scale in ``ws``, which multiplies the row's sum as the reference's FP8 ``Linear`` does;
``StepGeometry.layer_weights`` elements a layer):
[qkv (QKV, H) | o (H, H) | gate/up (2I, H), rows interleaved 8 gate then their 8 up | pad |
down (H, I) | pad]. Activations (fp32, ``act``): per local layer and row [qkv | att | h1 | SiLU(g)·u],
and SiLU(g)·u again as bf16 where down's input streams (widths 2-8 of 8B: ``StepGeometry.streams_down``).
Residuals leaving local layers 0 .. nlayers - 2 go to ``res`` (bf16 [nlayers, NB, H]); the last layer's to ``out``.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from monodecode.kernels.triton import timeline

ROWS = gl.constexpr(16)  # a weight chunk's rows
BK = gl.constexpr(1024)  # a weight chunk's columns
TB = gl.constexpr(256)  # TMA's box: a chunk is [16, 4, 256]
NPAD = gl.constexpr(8)  # widths 2-8: rows padded to mma.sync's 8 columns
MINSPAN = gl.constexpr(128)  # positions a context split holds at least (``step_plan.MIN_SPLIT``)
NCTR = gl.constexpr(6)  # a layer's counters: qkv, heads merged, o_proj, gate/up, down, gate/up but its last round
# health sites and kernels (``monodecode.kernels.health``): the attention half reports as k1
WAIT_TIMEOUT = gl.constexpr(1)
NONFINITE = gl.constexpr(2)
# the timeline buffer's layout (``triton/timeline.py``, which the two-launch kernels stamp too)
PROF_STAGES = gl.constexpr(timeline.MAX_STAGES)
PROF_SLOTS = gl.constexpr(timeline.SLOTS)
# where an attention task stamps its partial stored, before the merge's counter: the attention
# stage's fourth slot; its q, k and v in (q staged): the first slot of K1's third stage, which the
# step has no stage for (``decode_bench.timeline.STEP``). Stamps inside the task's K/V loop or
# after it spilled 8-16 bytes at width 8.
ATT_PART = gl.constexpr(3)
ATT_Q_STAGE = gl.constexpr(2)


@gluon.jit
def _code(site, kid, glayer):
    """``health.health_code(site, layer, kernel)`` on device."""
    return site + kid * 256 + (glayer + 1) * 1024


@gluon.jit
def _wait_for(ctr_ptr, target, spin, health_ptr, code):
    """Wait (acquire) until a completion counter reaches ``target``; at most ``spin`` polls left
    for this program (returned less those used). Expired: the health word gets ``code`` (the first
    failure wins) and the caller carries on."""
    seen = gl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
    while (seen < target) & (spin > 0):
        seen = gl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
        spin -= 1
    if seen < target:
        gl.atomic_cas(health_ptr, 0, code, sem="relaxed", scope="gpu")
    return spin


@gluon.jit
def _stamp(prof_ptr, layer, pid, kid, stage, slot, NPROG: gl.constexpr, PROF: gl.constexpr):
    """``%globaltimer`` (ns) into ``prof[layer, kid, pid, stage, slot]`` (``triton/timeline.py``'s
    layout), only when ``PROF`` (the benchmark's timelines)."""
    if PROF:
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(prof_ptr + (((layer * 2 + kid) * NPROG + pid) * PROF_STAGES + stage) * PROF_SLOTS + slot, t)


@gluon.jit
def _chunk(i, C: gl.constexpr, C0: gl.constexpr, C1: gl.constexpr, C2: gl.constexpr, HIDDEN: gl.constexpr,
           INTER: gl.constexpr, QKVR: gl.constexpr, OFF_O: gl.constexpr, OFF_GU: gl.constexpr, OFF_D: gl.constexpr,
           TD: gl.constexpr, DSTREAM: gl.constexpr, WX: gl.constexpr, QS: gl.constexpr, KH: gl.constexpr):  # fmt: skip
    """Chunk ``i`` of a program's sequence -> (local layer, stage, task slot, its K chunk, K chunks,
    output tiles, K, the stage's first weight). Stages, each ``C*`` chunks a program: 0 qkv, 1
    o_proj, 2 gate/up, 3 down (the rest of ``C``). A task's chunks are consecutive, except down's
    where its input streams (``DSTREAM``): k-outer over the ``TD`` tiles, so each X chunk serves all.
    A weight chunk is ``WX`` x ``BK`` columns (``StepGeometry.chunk_span``); a stage of K = HIDDEN
    has ``KH`` of them (the last zero-padded where BK does not divide HIDDEN), o_proj's K is ``QS``."""
    layer = i // C
    r = i % C
    s = gl.where(r < C0, 0, gl.where(r < C0 + C1, 1, gl.where(r < C0 + C1 + C2, 2, 3)))
    rs = r - gl.where(s == 0, 0, gl.where(s == 1, C0, gl.where(s == 2, C0 + C1, C0 + C1 + C2)))
    nk = gl.where(s == 3, INTER // (BK * WX), gl.where(s == 1, QS // (BK * WX), KH))
    kdim = gl.where(s == 3, INTER, gl.where(s == 1, QS, HIDDEN))
    tiles = gl.where(s == 0, QKVR // ROWS, gl.where(s == 2, 2 * INTER // ROWS, HIDDEN // ROWS))
    base = gl.where(s == 0, 0, gl.where(s == 1, OFF_O, gl.where(s == 2, OFF_GU, OFF_D)))
    if DSTREAM:
        return layer, s, gl.where(s == 3, rs % TD, rs // nk), gl.where(s == 3, rs // TD, rs % nk), nk, tiles, kdim, base
    else:
        return layer, s, rs // nk, rs % nk, nk, tiles, kdim, base


@gluon.jit
def _refill(ring, boxes, bars, w_ptr, wh_desc, wi_desc, wo_desc, i, total, pid, first, rr, cc, C: gl.constexpr,
            C0: gl.constexpr, C1: gl.constexpr, C2: gl.constexpr, HIDDEN: gl.constexpr, INTER: gl.constexpr,
            QKVR: gl.constexpr, OFF_O: gl.constexpr, OFF_GU: gl.constexpr, OFF_D: gl.constexpr,
            LAYER_W: gl.constexpr, NPROG: gl.constexpr, NBUF: gl.constexpr, TMA: gl.constexpr, TD: gl.constexpr,
            DSTREAM: gl.constexpr, MMAV: gl.constexpr, NW: gl.constexpr, FP8: gl.constexpr,
            WX: gl.constexpr, ONEBOX: gl.constexpr, QS: gl.constexpr, KH: gl.constexpr):  # fmt: skip
    """Start chunk ``i`` into its ring slot: by TMA, one box on the slot's mbarrier (a chunk past
    the end or the tiles copies nothing and arrives itself, so every slot completes one phase a
    chunk; widths 2-8 in mma's operand order, ``step_launch.weight_descriptors``), or by
    ``cp.async`` (one commit group a chunk, zero bytes past the end). ``rr``/``cc``: each copied
    element's row and column in the chunk, broadcast to the slot's shape. ``ONEBOX``: width 1's
    chunk of WX parts is one TMA box (``StepGeometry.box_parts``)."""
    layer, s, j, k, nk, tiles, kdim, base = _chunk(i, C, C0, C1, C2, HIDDEN, INTER, QKVR, OFF_O, OFF_GU, OFF_D, TD,
                                                   DSTREAM, WX, QS, KH)  # fmt: skip
    tile = pid + j * NPROG
    ok = (i < total) & (tile < tiles)
    glayer = first + layer
    if TMA:
        bar = bars.index(i % NBUF)
        row = glayer * (LAYER_W // kdim) + base // kdim + tile * ROWS  # in rows of the stage's K
        mbarrier.expect(bar, ROWS * BK * WX * (2 - FP8), pred=ok)  # bf16 or fp8 bytes
        if MMAV:  # each part's halves of the warps' column blocks: [column block, row, 64] at column 0 and 64
            for p in gl.static_range(WX):
                for h in gl.static_range(2):
                    box = boxes.index(2 * (WX * (i % NBUF) + p) + h)
                    _tma_box(wh_desc, wi_desc, wo_desc, s, [(k * WX + p) * NW, row, h * (BK // NW // 2)], bar, box, ok,
                             QS != HIDDEN)  # fmt: skip
        elif ONEBOX:  # (one [16, 4 WX, 256] box)
            _tma_box(wh_desc, wi_desc, wo_desc, s, [row, k * WX * (BK // TB), 0], bar, boxes.index(i % NBUF), ok,
                 QS != HIDDEN)  # fmt: skip
        else:  # (a chunk of WX boxes on one mbarrier)
            for h in gl.static_range(WX):
                box = boxes.index(WX * (i % NBUF) + h)
                _tma_box(wh_desc, wi_desc, wo_desc, s, [row, (k * WX + h) * (BK // TB), 0], bar, box, ok, QS != HIDDEN)
        mbarrier.arrive(bar, pred=~ok)
    else:  # (a chunk's WX parts in one commit group)
        for p in gl.static_range(WX):
            off = glayer.to(gl.int64) * LAYER_W + base + (tile * ROWS + rr).to(gl.int64) * kdim + (k * WX + p) * BK + cc
            async_copy.async_copy_global_to_shared(
                ring.index(WX * (i % NBUF) + p), w_ptr + off, mask=ok & (rr >= 0) & (cc >= 0)
            )
        async_copy.commit_group()


@gluon.jit
def _tma_box(wh_desc, wi_desc, wo_desc, s, coord, bar, box, ok, SPLIT_O: gl.constexpr):
    """One TMA box of stage ``s``'s weights at ``coord`` into ``box`` on ``bar``: through the view
    in rows of INTER for down (stage 3), with ``SPLIT_O`` of heads x head_dim for o_proj (stage
    1; Gemma-3's 4096 against hidden 5376), of HIDDEN for the others. A box past a view's row
    (hidden's last chunk where 1024 does not divide it) is zero-filled, its bytes counted."""
    if s == 3:
        tma.async_copy_global_to_shared(wi_desc, coord, bar, box, pred=ok)
    elif SPLIT_O:
        if s == 1:
            tma.async_copy_global_to_shared(wo_desc, coord, bar, box, pred=ok)
        else:
            tma.async_copy_global_to_shared(wh_desc, coord, bar, box, pred=ok)
    else:
        tma.async_copy_global_to_shared(wh_desc, coord, bar, box, pred=ok)


@gluon.jit
def _normed_input(xbuf, src, g_ptr, cf, HIDDEN: gl.constexpr, EPS: gl.constexpr, ONESUM: gl.constexpr = 0):
    """Width 1: stage row ``src`` (HIDDEN values) times the norm weight into ``xbuf`` (its BK
    chunks, zero past HIDDEN); returns its rstd, which each output row's sum takes at the end.
    ``ONESUM``: the squares summed per thread over the chunks, then once across the block (one
    block-wide reduction and its barriers, not one a chunk)."""
    NX: gl.constexpr = (HIDDEN + BK - 1) // BK  # (staged chunks: a weight chunk may span WX of them)
    # every chunk asked for before the first is used: each chunk's block-wide sum and store put
    # barriers between its loads and the next chunk's, one L2 round trip a chunk in series
    vs = ()
    gs = ()
    for c in gl.static_range(NX):
        if HIDDEN % BK:
            e = c * BK + cf
            vs = vs + (gl.load(src + e, mask=e < HIDDEN, other=0.0, cache_modifier=".cg"),)
            gs = gs + (gl.load(g_ptr + e, mask=e < HIDDEN, other=0.0),)
        else:
            vs = vs + (gl.load(src + c * BK + cf, cache_modifier=".cg"),)
            gs = gs + (gl.load(g_ptr + c * BK + cf),)
    sq = gl.zeros_like(cf, dtype=gl.float32)
    ss = 0.0
    for c in gl.static_range(NX):
        v = vs[c].to(gl.float32)
        if ONESUM:
            sq += v * v
        else:
            ss += gl.sum(v * v, axis=0)
        xbuf.index(c).store((v * gs[c].to(gl.float32)).to(xbuf.dtype))
    if ONESUM:
        ss = gl.sum(sq, axis=0)
    return gl.rsqrt(ss / HIDDEN + EPS)


@gluon.jit
def _post_normed(xbuf, sums, res, rows, dst, cf, pid, health_ptr, code, live, HIDDEN: gl.constexpr,
                 EPS: gl.constexpr, NPROG: gl.constexpr, STAGE: gl.constexpr, CHECK: gl.constexpr,
                 ONESUM: gl.constexpr = 0):  # fmt: skip
    """Gemma-3, width 1: the residual after a post norm, v = bf16(res + bf16(sums' RMSNorm x
    gp)), where ``sums`` are o_proj's or down's raw bf16 sums (fp32, HIDDEN values; the norm
    needs the whole row, so every program makes v) and ``res`` the residual they join. ``rows``:
    gp and the next norm's weight g (``_norm_rows``, asked for before the caller's wait). This
    program's tiles' rows of v (16-row tiles ``pid``, ``pid + NPROG``, ..., the ones its own
    o_proj and down tasks own) go to ``dst``, with ``CHECK`` a non-finite one in a ``live`` row
    setting the health word (``code``). With ``STAGE``, v times g is staged into ``xbuf`` as
    ``_normed_input`` does, and v's rstd returned (else 1.0); ``ONESUM`` as there, for both norms."""
    NX: gl.constexpr = (HIDDEN + BK - 1) // BK
    ds = ()
    rs = ()
    for c in gl.static_range(NX):  # every chunk asked for at once (``_normed_input``'s reason)
        e = c * BK + cf
        ds = ds + (gl.load(sums + e, mask=e < HIDDEN, other=0.0, cache_modifier=".cg"),)
        rs = rs + (gl.load(res + e, mask=e < HIDDEN, other=0.0, cache_modifier=".cg"),)
    gps, gs = rows
    sq = gl.zeros_like(cf, dtype=gl.float32)
    ss = 0.0
    for c in gl.static_range(NX):
        if ONESUM:
            sq += ds[c] * ds[c]
        else:
            ss += gl.sum(ds[c] * ds[c], axis=0)
    if ONESUM:
        ss = gl.sum(sq, axis=0)
    rd = gl.rsqrt(ss / HIDDEN + EPS)
    sq = gl.zeros_like(cf, dtype=gl.float32)
    sv = 0.0
    for c in gl.static_range(NX):
        e = c * BK + cf
        v = _bf(rs[c].to(gl.float32) + _bf(ds[c] * rd * gps[c]))
        mine = (e < HIDDEN) & ((e // ROWS) % NPROG == pid)
        gl.store(dst + e, v.to(dst.dtype.element_ty), mask=mine)
        if CHECK:
            _flag_nonfinite(v, health_ptr, code, mine, live)
        if STAGE:
            if ONESUM:
                sq += v * v
            else:
                sv += gl.sum(v * v, axis=0)
            xbuf.index(c).store((v * gs[c]).to(xbuf.dtype))
    if STAGE:
        if ONESUM:
            sv = gl.sum(sq, axis=0)
        return gl.rsqrt(sv / HIDDEN + EPS)
    else:
        return 1.0


@gluon.constexpr_function
def _stage_layout(NW):
    """Widths 2-8's staged [NW, NPAD, BK // NW] tiles: 4 columns a thread, a warp's column block in its lanes."""
    return gl.BlockedLayout([1, 1, 4], [1, 1, 32], [NW, 1, 1], [2, 1, 0])


@gluon.jit
def _stage_rows(xbuf, src, stride, g_ptr, NCH: gl.constexpr, XMAX: gl.constexpr, NB: gl.constexpr,
                NORM: gl.constexpr, HIDDEN: gl.constexpr, EPS: gl.constexpr, NW: gl.constexpr,
                C0: gl.constexpr = 0, C1: gl.constexpr = -1, GRP: gl.constexpr = 4, ONESUM: gl.constexpr = 0):  # fmt: skip
    """Widths 2-8: the ``NB`` rows ``src + b * stride`` (``NCH`` chunks of BK) into ``xbuf``'s last
    ``NCH`` chunks as mma's X operand ([NW column blocks, NPAD rows, BK // NW], rows past ``NB``
    zero), times the norm weight when ``NORM``. Returns the rows' rstd ([NPAD]; 1 without ``NORM``).
    ``C0``/``C1``: only chunks ``C0 .. C1 - 1`` (without ``NORM``; -1: to the last). ``GRP``: the
    chunks asked for at once (``_normed_input``'s reason; each holds 32 registers a thread).
    ``ONESUM``: the squares summed per warp over the chunks, then across the warps once."""
    KW: gl.constexpr = BK // NW
    CE: gl.constexpr = NCH if C1 < 0 else C1
    st: gl.constexpr = _stage_layout(NW)
    w3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, st))), 1), 2)
    b3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NPAD, layout=gl.SliceLayout(0, gl.SliceLayout(2, st))), 0), 2)
    k3 = gl.expand_dims(gl.expand_dims(gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(0, st))), 0), 0)
    ss = gl.zeros([NPAD], gl.float32, gl.SliceLayout(0, gl.SliceLayout(2, st)))
    sq = gl.zeros([NW, NPAD], gl.float32, gl.SliceLayout(2, st))
    for c0 in gl.static_range(C0, CE, GRP):
        vs = ()
        gs = ()
        for c in gl.static_range(c0, c0 + GRP):
            if c < CE:
                col = c * BK + w3 * KW + k3  # [NW, 1, KW]
                x = src + b3 * stride + col
                vs = vs + (gl.load(x, mask=(b3 < NB) & (col >= 0), other=0.0, cache_modifier=".cg"),)
                if NORM:
                    gs = gs + (gl.load(g_ptr + col),)
        for c in gl.static_range(c0, c0 + GRP):
            if c < CE:
                v = vs[c - c0].to(gl.float32)
                if NORM:
                    if ONESUM:
                        sq += gl.sum(v * v, axis=2)
                    else:
                        ss += gl.sum(gl.sum(v * v, axis=2), axis=0)
                    v = v * gs[c - c0].to(gl.float32)
                xbuf.index(XMAX - NCH + c).store(v.to(xbuf.dtype))
    if NORM:
        if ONESUM:
            ss = gl.sum(sq, axis=0)
        return gl.rsqrt(ss / HIDDEN + EPS)
    else:
        return ss + 1.0


@gluon.jit
def _down_input(xbuf, src, cf, C0: gl.constexpr, C1: gl.constexpr, LAYER_A: gl.constexpr, INTER: gl.constexpr,
                XMAX: gl.constexpr, NB: gl.constexpr, MMAV: gl.constexpr, NW: gl.constexpr):  # fmt: skip
    """Stage chunks ``C0 .. C1 - 1`` of down's whole input (SiLU(g)·u, fp32 at ``src``, a row each
    ``LAYER_A``) as bf16: width 1 into chunk ``c``, widths 2-8 as ``_stage_rows`` would."""
    if MMAV:
        _stage_rows(xbuf, src, LAYER_A, src, INTER // BK, XMAX, NB, False, INTER, 1.0, NW, C0, C1, 2)
    else:
        _staged_bf16(xbuf, src, cf, C0, C1)


@gluon.jit
def _staged_bf16(xbuf, src, cf, C0: gl.constexpr, C1: gl.constexpr):
    """Width 1: chunks ``C0 .. C1 - 1`` of the fp32 row at ``src`` into ``xbuf``'s chunks ``c`` as
    bf16, every chunk asked for before the first is stored (``_normed_input``'s reason)."""
    vs = ()
    for c in gl.static_range(C0, C1):
        vs = vs + (gl.load(src + c * BK + cf, cache_modifier=".cg"),)
    for c in gl.static_range(C0, C1):
        xbuf.index(c).store(vs[c - C0].to(gl.bfloat16))


@gluon.jit
def _x_copy(xbuf, slot, g16, k, LAYER_A: gl.constexpr, NB: gl.constexpr, NW: gl.constexpr):
    """Streamed down (widths 2-8): start copying X chunk ``k`` of the ``NB`` rows' bf16 SiLU(g)·u
    (``g16``: row b's at ``g16 + 2 * b * LAYER_A``) into ``xbuf`` slot ``slot`` as mma's X
    operand ([NW column blocks, NPAD rows, BK // NW], rows past ``NB`` zero-filled). No commit:
    it joins the weight chunk's commit group that ``_refill`` closes next."""
    KW: gl.constexpr = BK // NW
    cp3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [NW, 1, 1], [2, 1, 0])
    w3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, cp3))), 1), 2)
    b3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NPAD, layout=gl.SliceLayout(0, gl.SliceLayout(2, cp3))), 0), 2)
    c3 = gl.expand_dims(gl.expand_dims(gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(0, cp3))), 0), 0)
    src = g16 + b3 * (2 * LAYER_A) + k * BK + w3 * KW + c3
    async_copy.async_copy_global_to_shared(xbuf.index(slot), src, mask=(b3 < NB) & (w3 >= 0) & (c3 >= 0))


@gluon.jit
def _bf16_of_e4m3(q):
    """e4m3fn ``q`` as bf16, exactly, by integer ops on 4 values a register: each byte's sign,
    exponent and mantissa moved to a bf16's places (``prmt``, then the magnitude 4 bits right),
    which is the value times 2^-120 (subnormal e4m3 land on subnormal bf16), then times 2^120.
    ``.to(gl.bfloat16)`` goes through the conversion instructions (e4m3 -> f16 -> bf16), which run
    at a fraction of the integer rate and bounded the loop (run 137: 8B FP8 at widths 2-8 slower
    than bf16, 1.9 µs a 16 KiB chunk). e4m3fn's NaN (never in quantized weights) maps to 480."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 a<2>, b<2>, s;
        mov.b32 s, 0x7B807B80;
        prmt.b32 a0, $2, 0, 0x1404;
        prmt.b32 a1, $2, 0, 0x3424;
        and.b32 b0, a0, 0x7FFF7FFF;
        and.b32 b1, a1, 0x7FFF7FFF;
        shr.b32 b0, b0, 4;
        shr.b32 b1, b1, 4;
        lop3.b32 b0, b0, 0x80008000, a0, 0xF8;
        lop3.b32 b1, b1, 0x80008000, a1, 0xF8;
        mul.rn.bf16x2 $0, b0, s;
        mul.rn.bf16x2 $1, b1, s;
        }""",
        "=r,=r,r",
        [q],
        dtype=gl.bfloat16,
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _w_operand(tile, a_l: gl.constexpr, FP8: gl.constexpr):
    """A ring slot's [.., 16, KW] weights as mma's bf16 A operand (FP8: read as e4m3, 4 columns a
    register, and widened)."""
    if FP8:
        return _bf16_of_e4m3(tile.load(a_l))
    else:
        return tile.load(a_l)


@gluon.jit
def _chunk_mma(ring, slot, x, acc, HALVES: gl.constexpr, NW: gl.constexpr, FP8: gl.constexpr):
    """The mma path: ``acc`` + each warp's W[16, KW] @ X[KW, NPAD] over its column block of the
    chunk in ``ring``'s ``slot`` (``x`` the staged chunk [NW, NPAD, KW]). ``HALVES``: the slot is
    the ring's entries 2 slot and 2 slot + 1, the blocks' two [16, KW / 2] halves (the TMA ring's
    order): two products over the halves in column order, the same k16 steps in the same order as one.
    ``FP8``: both operands with ``k_width`` 4 (4 consecutive columns a thread, as e4m3 packs a
    register), the weights widened to bf16 (``_bf16_of_e4m3``), the activations as they are."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2 + 2 * FP8)
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2 + 2 * FP8)
    if HALVES:
        h: gl.constexpr = BK // NW // 2
        acc = mma_v2(_w_operand(ring.index(2 * slot), a_l, FP8), x.slice(0, h, dim=2).permute([0, 2, 1]).load(b_l), acc)
        return mma_v2(
            _w_operand(ring.index(2 * slot + 1), a_l, FP8), x.slice(h, h, dim=2).permute([0, 2, 1]).load(b_l), acc
        )
    else:
        return mma_v2(_w_operand(ring.index(slot), a_l, FP8), x.permute([0, 2, 1]).load(b_l), acc)


@gluon.jit
def _warps_summed(acc, red, NW: gl.constexpr):
    """Widths 2-8: the warps' [NW, ROWS, NPAD] partial products (each warp its own column blocks)
    summed over the warps in fixed order through ``red`` -> [ROWS, NPAD]."""
    gl.thread_barrier()  # every warp is past the task's last chunk (``red`` aliases the staged input)
    red.store(acc)
    gl.thread_barrier()
    return gl.sum(red.load(_sum_layout(NW)), axis=0)


@gluon.constexpr_function
def _sum_layout(NW):
    """``_warps_summed``'s [NW, ROWS, NPAD] partials with the warps in registers (its result: the
    slice at dim 0)."""
    return gl.BlockedLayout([NW, 1, 1], [1, 8, 4], [1, 2, 4], [2, 1, 0])


@gluon.jit
def _bf(v):
    """``v`` rounded to bf16, kept in fp32 (where the reference rounds)."""
    return v.to(gl.bfloat16).to(gl.float32)


@gluon.jit
def _rope(a, b, d, cos, sin, D: gl.constexpr):
    """``a`` at dims ``d`` rotated, with ``b`` its rotate-half partners (d + D/2 mod D), by the
    row's ``cos`` and ``sin`` at ``d`` (``_cos_sin``); the result rounded to bf16 (broadcast)."""
    return _bf(a * cos + gl.where(d < D // 2, -1.0, 1.0) * b * sin)


@gluon.jit
def _cos_sin(cs, pos, inv_ptr, D: gl.constexpr, NW: gl.constexpr):
    """RoPE's cos and sin of ``pos * inv_freq`` for dims 0..D-1 (rotate-half layout), rounded to
    bf16 as the reference's caches are, into ``cs`` (fp32 [cos | sin]): once a launch, where every
    layer's attention task reads them (computed per task they cost ~2500 instructions of code and
    32 transcendental evaluations a thread on the attention's critical path, every layer)."""
    dl: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    d = gl.arange(0, D, layout=dl)
    f = pos.to(gl.float32) * gl.load(inv_ptr + d % (D // 2))
    cs.slice(0, D).store(_bf(gl.cos(f)))
    cs.slice(D, D).store(_bf(gl.sin(f)))


@gluon.jit
def _norm_rows(gp_ptr, g_ptr, cf, HIDDEN: gl.constexpr, STAGE: gl.constexpr):
    """``_post_normed``'s weight rows as its chunks: the post norm's (fp32 (1 + w)) and, with
    ``STAGE``, the next norm's. Asked for before the wait for the sums they scale, which they do
    not depend on (run 166, 27B batch 1: 0.3-0.5 % faster than after it)."""
    NX: gl.constexpr = (HIDDEN + BK - 1) // BK
    gps = ()
    gs = ()
    for c in gl.static_range(NX):
        e = c * BK + cf
        gps = gps + (gl.load(gp_ptr + e, mask=e < HIDDEN, other=0.0),)
        if STAGE:
            gs = gs + (gl.load(g_ptr + e, mask=e < HIDDEN, other=0.0),)
    return gps, gs


@gluon.jit
def _cos_sin_2(cs, pos, inv_ptr, inv2_ptr, D: gl.constexpr, NW: gl.constexpr):
    """Gemma-3: ``_cos_sin`` of the full layers' RoPE (``inv_ptr``) and the sliding layers'
    (``inv2_ptr``) into ``cs`` (bf16 [cos | sin | cos | sin]: the values are bf16 already, and
    the two fp32 tables would not fit beside 27B's rings)."""
    dl: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    d = gl.arange(0, D, layout=dl)
    f = pos.to(gl.float32) * gl.load(inv_ptr + d % (D // 2))
    f2 = pos.to(gl.float32) * gl.load(inv2_ptr + d % (D // 2))
    cs.slice(0, D).store(gl.cos(f).to(gl.bfloat16))
    cs.slice(D, D).store(gl.sin(f).to(gl.bfloat16))
    cs.slice(2 * D, D).store(gl.cos(f2).to(gl.bfloat16))
    cs.slice(3 * D, D).store(gl.sin(f2).to(gl.bfloat16))


@gluon.constexpr_function
def _tile_layout(NW):
    """The attention's [NW, PW, D] K/V tiles in registers: 16-byte rows, a warp's positions in
    its own lanes."""
    return gl.BlockedLayout([1, 1, 8], [1, 4, 8], [NW, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _q_layout(NW):
    """An attention task's [16, D] query rows in registers (the slice at dim 0 of this [1, 16, D]
    layout, which stores them into one warp's q slot): each row's dims as ``_tile_layout``'s
    (8-element runs, 8 lanes, so q·k sums over D in its order), 4 rows a warp, the warps past 16
    rows repeating them."""
    return gl.SliceLayout(0, gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, NW, 1], [2, 1, 0]))


@gluon.jit
def _qkv_in(act, kvh, QH: gl.constexpr, KVH: gl.constexpr, D: gl.constexpr, NW: gl.constexpr):
    """An attention task's new q (its group's query heads, rows 0 .. G - 1 of 16; 0 past them), k
    and v ([D], ``_q_layout``'s columns), q and k each with its rotate-half partners, bf16-rounded:
    all asked for at once, before ``_kv_first``'s block-table reads, so the two share one round
    trip. Read once a program (twice at 8 warps), not once a warp: every warp reading all 16
    padded rows was 128 KiB a task at 8B, 16 MiB of L2 reads at once across the grid."""
    G: gl.constexpr = QH // KVH
    ql: gl.constexpr = _q_layout(NW)
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, ql))[:, None]
    d = gl.arange(0, D, layout=gl.SliceLayout(0, ql))
    dd = d[None, :]
    qrow = act + (kvh * G + r) * D
    qm = (r < G) & (dd >= 0)
    qx = _bf(gl.load(qrow + dd, mask=qm, other=0.0, cache_modifier=".cg"))
    qr = _bf(gl.load(qrow + (dd + D // 2) % D, mask=qm, other=0.0, cache_modifier=".cg"))
    krow = act + QH * D + kvh * D
    kx = _bf(gl.load(krow + d, cache_modifier=".cg"))
    kr = _bf(gl.load(krow + (d + D // 2) % D, cache_modifier=".cg"))
    v = _bf(gl.load(act + (QH + KVH) * D + kvh * D + d, cache_modifier=".cg"))
    return qx, qr, kx, kr, v


@gluon.jit
def _qk_normed(qx, qr, kx, kr, qkn, D: gl.constexpr, EPS: gl.constexpr, NW: gl.constexpr):
    """Gemma-3's q/k-norm on an attention task's new q rows and k (``_qkv_in``'s, each with its
    rotate-half partners): each head's RMSNorm over D times (1 + w) (``qkn``: fp32 [q's | k's],
    D each), rounded to bf16 once, as the reference's; rows past the group's heads stay 0."""
    ql: gl.constexpr = _q_layout(NW)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, ql))
    dr = (d + D // 2) % D
    wq = gl.load(qkn + d)[None, :]
    wqr = gl.load(qkn + dr)[None, :]
    wk = gl.load(qkn + D + d)
    wkr = gl.load(qkn + D + dr)
    rq = gl.rsqrt(gl.sum(qx * qx, axis=1) / D + EPS)[:, None]
    rk = gl.rsqrt(gl.sum(kx * kx, axis=0) / D + EPS)
    return _bf(qx * rq * wq), _bf(qr * rq * wqr), _bf(kx * rk * wk), _bf(kr * rk * wkr)


@gluon.jit
def _kv_blocks(bt_row, b, end, BS: gl.constexpr, NW: gl.constexpr, PW: gl.constexpr):
    """The cache blocks ([NW, PW], ``_tile_layout``'s rows) of positions ``b + w * PW + p``; 0 from ``end`` on."""
    t3: gl.constexpr = _tile_layout(NW)
    w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, t3)))
    p = gl.arange(0, PW, layout=gl.SliceLayout(0, gl.SliceLayout(2, t3)))
    pos = b + w[:, None] * PW + p[None, :]
    return gl.load(bt_row + pos // BS, mask=pos < end, other=0)


@gluon.jit
def _kv_copy(kvs, slot, kc_ptr, vc_ptr, koff, voff, blocks, kvh, b, end, k_sb, k_st, k_sh, v_sb, v_st, v_sh,
             BS: gl.constexpr, D: gl.constexpr, NW: gl.constexpr, PW: gl.constexpr):  # fmt: skip
    """Start copying the [NW, PW, D] K and V tiles at positions ``b ..`` (their cache ``blocks``)
    into ``kvs`` slot ``slot`` (one commit group; positions from ``end`` on are zero-filled)."""
    t3: gl.constexpr = _tile_layout(NW)
    w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, t3)))
    p = gl.arange(0, PW, layout=gl.SliceLayout(0, gl.SliceLayout(2, t3)))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, t3)))
    pos = b + w[:, None] * PW + p[None, :]  # [NW, PW]
    d3 = gl.expand_dims(d[None, :], 1)
    ok = (pos[:, :, None] < end) & (d3 >= 0)
    blk = blocks.to(gl.int64)[:, :, None]
    tok = (pos % BS)[:, :, None]
    ko = koff + blk * k_sb + tok * k_st + kvh * k_sh + d3
    vo = voff + blk * v_sb + tok * v_st + kvh * v_sh + d3
    async_copy.async_copy_global_to_shared(kvs.index(2 * slot), kc_ptr + ko, mask=ok)
    async_copy.async_copy_global_to_shared(kvs.index(2 * slot + 1), vc_ptr + vo, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _kv_span(task, ctx, lo, NSPLIT: gl.constexpr, NW: gl.constexpr, PW: gl.constexpr):
    """An attention task -> (KV head, split, first position, end) of its row's cached positions
    ``lo .. ctx - 1`` (``lo`` past 0 on a sliding-window layer): spans of at least ``MINSPAN``
    positions, whole K/V tiles; a short context leaves later splits empty."""
    sp = task % NSPLIT
    span = gl.maximum((ctx - lo + NSPLIT - 1) // NSPLIT, MINSPAN)
    span = (span + NW * PW - 1) // (NW * PW) * (NW * PW)
    start = gl.minimum(lo + sp * span, ctx)
    return task // NSPLIT, sp, start, gl.minimum(start + span, ctx)


@gluon.jit
def _kv_first(kvs, kc_ptr, vc_ptr, koff, voff, bt_row, kvh, start, end, k_sb, k_st, k_sh, v_sb, v_st, v_sh,
              BS: gl.constexpr, D: gl.constexpr, KVS: gl.constexpr, NW: gl.constexpr, PW: gl.constexpr):  # fmt: skip
    """An attention task's first ``KVS - 1`` K/V tiles (``KVS`` 2 or 3) into the ring (their blocks,
    then their copies), right after the task's QKV wait. Returns the blocks of the next tile, which
    ``_attend``'s first step copies."""
    # every tile's blocks asked for at once (one round trip, not one a tile), then the copies
    b0 = _kv_blocks(bt_row, start, end, BS, NW, PW)
    b1 = _kv_blocks(bt_row, start + NW * PW, end, BS, NW, PW)
    if KVS == 3:
        b2 = _kv_blocks(bt_row, start + 2 * NW * PW, end, BS, NW, PW)
    _kv_copy(kvs, 0, kc_ptr, vc_ptr, koff, voff, b0, kvh, start, end, k_sb, k_st, k_sh, v_sb, v_st, v_sh, BS, D, NW,
             PW)  # fmt: skip
    if KVS == 3:
        _kv_copy(kvs, 1, kc_ptr, vc_ptr, koff, voff, b1, kvh, start + NW * PW, end, k_sb, k_st, k_sh, v_sb, v_st,
                 v_sh, BS, D, NW, PW)  # fmt: skip
        return b2
    else:
        return b1


@gluon.jit
def _attend(qx, qr, kx, kr, vn, kc_ptr, vc_ptr, koff, voff, cs, part_ptr, bt_row, bnext, task, ctx, slot, kvs,
            k_sb, k_st, k_sh, v_sb, v_st, v_sh, QH: gl.constexpr, KVH: gl.constexpr, D: gl.constexpr,
            BS: gl.constexpr, SCALE: gl.constexpr, NSPLIT: gl.constexpr, KVS: gl.constexpr, NW: gl.constexpr,
            PW: gl.constexpr, prof_ptr=0, layer=0, pid=0, NPROG: gl.constexpr = 1, PROF: gl.constexpr = 0, lo=0,
            sliding=False, GEMMA: gl.constexpr = 0, APAD: gl.constexpr = 1):  # fmt: skip
    """One attention task of a row: KV head ``task // NSPLIT``, split ``task % NSPLIT`` of the row's
    ``ctx`` cached positions on tensor cores: each warp its own ``PW`` positions a step as ``mma.sync``
    products (the group's query heads padded to 16 rows, q and P in bf16), S = Q·Kᵀ, the online
    softmax, O += P·V; the tiles stream through ``kvs``, a ring of ``KVS`` shared-memory slots
    filled by ``cp.async`` ``KVS - 1`` tiles ahead (the first ones by ``_kv_first``, whose
    ``bnext`` are the blocks of the next), their blocks read one tile earlier still.
    The last split also writes the new position's K/V at the row's ``slot`` (unless -1) and
    attends to it from registers. Stores the partial [G, D] and its max and sum for the merge.
    ``qx`` .. ``vn``: the task's new q, k and v as ``_qkv_in`` read them.
    With ``PROF``, stamps its q, k and v in (``decode_bench.timeline.STEP.q_in``). ``lo``: the
    first cached position the row may see (a sliding window's). ``GEMMA``: ``cs`` holds the
    full and the sliding layers' tables (``_cos_sin_2``), ``sliding`` picks the second. ``APAD``:
    the warps' partials summed through padded shared-memory rows (``_att_sum_layout``)."""
    G: gl.constexpr = QH // KVH
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    r2: gl.constexpr = gl.SliceLayout(2, mma)  # [NW, 16] row statistics
    kvh, sp, start, end = _kv_span(task, ctx, lo, NSPLIT, NW, PW)
    last = sp == NSPLIT - 1
    ql: gl.constexpr = _q_layout(NW)
    d1 = gl.arange(0, D, layout=gl.SliceLayout(0, ql))
    if GEMMA:
        if sliding:
            c1 = cs.slice(2 * D, D).load(d1.type.layout).to(gl.float32)
            s1 = cs.slice(3 * D, D).load(d1.type.layout).to(gl.float32)
        else:
            c1 = cs.slice(0, D).load(d1.type.layout).to(gl.float32)
            s1 = cs.slice(D, D).load(d1.type.layout).to(gl.float32)
    else:
        c1 = cs.slice(0, D).load(d1.type.layout)
        s1 = cs.slice(D, D).load(d1.type.layout)
    qf = _rope(qx, qr, d1[None, :], c1[None, :], s1[None, :], D)  # [16, D], 0 past the group's G heads
    kn = _rope(kx, kr, d1, c1, s1, D)
    # every warp its copy of q, into the operand layout through the ring's last slot (its first
    # copy is issued in step 0)
    if PW == 16:
        qs = kvs.index(2 * (KVS - 1))
    else:  # the slot's first 16 positions' bytes
        qs = kvs.index(2 * (KVS - 1)).slice(0, 16, dim=1)
    q16 = gl.expand_dims(qf.to(gl.bfloat16), 0)
    for w in gl.static_range(NW):
        qs.slice(w, 1).store(q16)
    gl.thread_barrier()
    qop = qs.load(a_l)
    _stamp(prof_ptr, layer, pid, 0, ATT_Q_STAGE, 0, NPROG, PROF)  # q, k, v in, q staged
    if last & (slot >= 0):  # the new position into the paged cache
        blk = (slot // BS).to(gl.int64)
        gl.store(kc_ptr + koff + blk * k_sb + (slot % BS) * k_st + kvh * k_sh + d1, kn.to(gl.bfloat16))
        gl.store(vc_ptr + voff + blk * v_sb + (slot % BS) * v_st + kvh * v_sh + d1, vn.to(gl.bfloat16))
    s_new = gl.convert_layout(gl.sum(qf * kn[None, :], axis=1) * SCALE, gl.SliceLayout(0, r2))
    wm = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(1, mma))), 1), 1)
    pm = gl.expand_dims(gl.arange(0, PW, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))[None, :], 1)
    m = gl.full([NW, 16], -1e30, gl.float32, r2)
    lsum = gl.zeros([NW, 16], gl.float32, r2)
    o = gl.zeros([NW, 16, D], gl.float32, mma)
    i = 0
    for b in range(start, end, NW * PW):
        async_copy.wait_group(KVS - 2)  # tile i has landed
        gl.thread_barrier()  # ... for every thread, and every thread is past the slot refilled next
        nb = b + (KVS - 1) * NW * PW
        _kv_copy(kvs, (i + KVS - 1) % KVS, kc_ptr, vc_ptr, koff, voff, bnext, kvh, nb, end, k_sb, k_st, k_sh,
                 v_sb, v_st, v_sh, BS, D, NW, PW)  # fmt: skip
        bnext = _kv_blocks(bt_row, nb + NW * PW, end, BS, NW, PW)
        kb = kvs.index(2 * (i % KVS)).permute([0, 2, 1]).load(b_l)
        vb = kvs.index(2 * (i % KVS) + 1).load(b_l)
        sc = mma_v2(qop, kb, gl.zeros([NW, 16, PW], gl.float32, mma)) * SCALE  # q.k then the scale, as the reference
        ok = b + wm * PW + pm < end
        sc = gl.where(ok, sc, -1e30)
        m2 = gl.maximum(m, gl.max(sc, axis=2))
        e = gl.where(ok, gl.exp(sc - m2[:, :, None]), 0.0)
        alpha = gl.exp(m - m2)
        lsum = lsum * alpha + gl.sum(e, axis=2)
        o = mma_v2(gl.convert_layout(e.to(gl.bfloat16), a_l), vb, o * alpha[:, :, None])
        m = m2
        i += 1
    async_copy.wait_group(0)  # the tail's zero-byte groups: the weight ring counts its own again
    # the warps' partials merged, then the new position (last split); rows past G are not stored
    mw = gl.max(m, axis=0)  # [16]
    mt = gl.where(last, gl.maximum(mw, s_new), mw)
    wgt = gl.exp(m - mt[None, :])
    e_new = gl.where(last, gl.exp(s_new - mt), 0.0)
    lt = gl.sum(lsum * wgt, axis=0) + e_new
    gl.thread_barrier()  # the warps' sum through the drained K/V ring
    red = kvs._reinterpret(gl.float32, [NW, 16, D], _att_sum_layout(NW, D, APAD))
    red.store(o * wgt[:, :, None])
    gl.thread_barrier()
    red_l: gl.constexpr = gl.BlockedLayout([NW, 1, 4], [1, 2, 16], [1, NW, 1], [2, 1, 0])  # warps in registers
    ot = gl.sum(red.load(red_l), axis=0)
    ol: gl.constexpr = ot.type.layout
    ro = gl.arange(0, 16, layout=gl.SliceLayout(1, ol))
    do = gl.arange(0, D, layout=gl.SliceLayout(0, ol))
    ot = (
        ot
        + gl.convert_layout(e_new, gl.SliceLayout(1, ol))[:, None]
        * gl.convert_layout(vn, gl.SliceLayout(0, ol))[None, :]
    )
    gs = gl.arange(0, 16, layout=gl.SliceLayout(0, r2))
    pslot = part_ptr + ((kvh * NSPLIT + sp) * G + ro) * (D + 2)
    gl.store(pslot[:, None] + do[None, :], ot, mask=(ro < G)[:, None])
    sslot = part_ptr + ((kvh * NSPLIT + sp) * G + gs) * (D + 2)
    gl.store(sslot + D, mt, mask=gs < G)
    gl.store(sslot + D + 1, lt, mask=gs < G)


@gluon.constexpr_function
def _att_sum_layout(NW, D, APAD):
    """``_attend``'s [NW, 16, D] fp32 warp partials in shared memory. mma.sync's accumulator puts
    a warp's rows in its lane quads, D * 4 bytes apart: in plain rows (``APAD`` 0) the same banks,
    4 quads a store phase, so every store takes 4 times its wavefronts. ``APAD``: 32 bytes after
    each row put a phase's 4 rows 8 banks apart (the addresses stay a constant past each
    thread's; a swizzle's XOR of row and column bits spilled 8-48 bytes at widths 1-8)."""
    if APAD:
        return gl.PaddedSharedLayout.with_identity_for([[D, 8]], [NW, 16, D], [2, 1, 0])
    return gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])


@gluon.jit
def _merge_splits(att_ptr, part_ptr, hctr, done, epoch, kvh, G: gl.constexpr, D: gl.constexpr,
                  NSPLIT: gl.constexpr, NW: gl.constexpr):  # fmt: skip
    """Count this split of KV head ``kvh`` on the head's counter ``hctr``; the head's last split to
    arrive merges the group's partials in split order (fixed: replays are bit-identical) into the
    attention output (bf16) and counts the head on ``done`` (release)."""
    gl.thread_barrier()
    old = gl.atomic_add(hctr, 1, sem="acq_rel", scope="gpu")
    if old == epoch * NSPLIT - 1:
        # [NSPLIT, G, D]: a head's splits in each thread, its G query heads and the columns
        # across the lanes and warps
        lm: gl.constexpr = gl.BlockedLayout([NSPLIT, 1, 1], [1, G, 32 // G], [1, 1, NW], [2, 1, 0])
        w2: gl.constexpr = gl.SliceLayout(2, lm)
        o2: gl.constexpr = gl.SliceLayout(0, lm)
        ss = gl.arange(0, NSPLIT, layout=gl.SliceLayout(1, w2))
        gw = gl.arange(0, G, layout=gl.SliceLayout(0, w2))
        rows = part_ptr + ((kvh * NSPLIT + ss[:, None]) * G + gw[None, :]) * (D + 2)
        d3 = gl.arange(0, D, layout=gl.SliceLayout(0, o2))
        # volatile, so that ptxas keeps this order: the maxes, which the arithmetic needs first,
        # are asked for last and all three loads are in flight at once (as .cg loads, ptxas
        # issued the outputs' after the weights: a second L2 round trip on the critical path)
        os = gl.load(rows[:, :, None] + gl.expand_dims(d3[None, :], 0), volatile=True)
        ls = gl.load(rows + D + 1, volatile=True)
        ms = gl.load(rows + D, volatile=True)
        w = gl.exp(ms - gl.max(ms, axis=0)[None, :])
        total = gl.sum(w * ls, axis=0)
        att = gl.sum(os * w[:, :, None], axis=0) / gl.convert_layout(total, gl.SliceLayout(1, o2))[:, None]
        go = gl.arange(0, G, layout=gl.SliceLayout(1, o2))
        gl.store(att_ptr + (kvh * G + go)[:, None] * D + d3[None, :], _bf(att))
        gl.thread_barrier()
        gl.atomic_add(done, 1, sem="release", scope="gpu")


@gluon.jit
def _residual_out(v, res_dst, out_dst, health_ptr, code, mask, live, layer, nlayers):
    """A layer's outgoing residual ``v`` (bf16-rounded fp32): into ``res`` for the next layer, or
    ``out`` after the last (every row, inert ones too: nothing returned is left unwritten); a
    non-finite value in a ``live`` row sets the health word."""
    if layer == nlayers - 1:
        gl.store(out_dst, v.to(gl.bfloat16), mask=mask)
    else:
        gl.store(res_dst, v.to(gl.bfloat16), mask=mask)
    _flag_nonfinite(v, health_ptr, code, mask, live)


@gluon.jit
def _flag_nonfinite(v, health_ptr, code, mask, live):
    """A non-finite ``v`` where ``mask`` and ``live`` sets the health word to ``code`` (the first failure wins)."""
    # per element, a predicated compare-and-swap from 0 (the first failure wins, as every wait's);
    # a reduction to one flag here costs ~20 registers at widths 4-8 and spills
    bad = (mask & live & ((v != v) | (gl.abs(v) == float("inf")))).to(gl.int32)
    zero = gl.zeros_like(bad)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p atom.relaxed.gpu.global.cas.b32 $0, [$1], 0, $3; @!p mov.u32 $0, 0; }",
        "=r,l,r,r",
        [health_ptr + zero, bad, zero + code],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _store_row(y, rstd, gbuf, act, h_in, res_dst, out_dst, health_ptr, code, live, layer, s, rows, tile,
               A_H1: gl.constexpr, A_GU: gl.constexpr, nlayers, NW: gl.constexpr, GEMMA: gl.constexpr = 0,
               A_O: gl.constexpr = 0, A_DN: gl.constexpr = 0):  # fmt: skip
    """Width 1: stage ``s``'s task result ``y`` (the tile's ROWS sums) into the activations: QKV
    times rstd; o_proj plus the residual; gate/up's 8 gate then 8 up rows times rstd -> 8
    SiLU(g)·u (through ``gbuf``); down plus h1 -> the outgoing residual. ``GEMMA``: o_proj's and
    down's sums go to ``A_O`` / ``A_DN`` as they are (bf16-rounded; ``_post_normed`` joins them
    to the residual), and gate/up makes GELU-tanh(g)·u."""
    if s == 0:
        gl.store(act + rows, _bf(y * rstd))
    elif s == 1:
        if GEMMA:
            gl.store(act + A_O + rows, _bf(y))
        else:
            gl.store(act + A_H1 + rows, _bf(_bf(y) + gl.load(h_in + rows, cache_modifier=".cg").to(gl.float32)))
    elif s == 2:
        hl: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        gbuf.store(_bf(y * rstd))
        gl.thread_barrier()
        gv = gbuf.slice(0, ROWS // 2).load(hl)
        uv = gbuf.slice(ROWS // 2, ROWS // 2).load(hl)
        hh = gl.arange(0, ROWS // 2, layout=hl)
        if GEMMA:
            gl.store(act + A_GU + tile * (ROWS // 2) + hh, _bf(_bf(_gelu_tanh(gv)) * uv))
        else:
            gl.store(act + A_GU + tile * (ROWS // 2) + hh, _bf(_bf(gv / (1.0 + gl.exp(-gv))) * uv))
    elif GEMMA:
        gl.store(act + A_DN + rows, _bf(y))
    else:
        v = _bf(_bf(y) + gl.load(act + A_H1 + rows, cache_modifier=".cg"))
        # 1-D, as the sums came: a [ROWS, 1] view would hold 16 copies a thread (16 checks each)
        _residual_out(v, res_dst + rows, out_dst + rows, health_ptr, code, rows >= 0, live, layer, nlayers)


@gluon.jit
def _gelu_tanh(g):
    """GELU's tanh form in fp32, as torch's ``gelu(approximate="tanh")``: 0.5 g (1 + tanh(u)),
    u = sqrt(2 / pi) (g + 0.044715 g^3), tanh(u) = 1 - 2 / (exp(2 u) + 1) (exact at both ends)."""
    u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return 0.5 * g * (2.0 - 2.0 / (gl.exp(2.0 * u) + 1.0))


@gluon.jit
def _store_rows(y, rstd, gbuf, act, g16, h_in, res_dst, out_dst, health_ptr, code, live_ptr, layer, s, tile, tiles,
                HIDDEN: gl.constexpr, A_H1: gl.constexpr, A_GU: gl.constexpr, LAYER_A: gl.constexpr,
                nlayers, NB: gl.constexpr, DSTREAM: gl.constexpr, NW: gl.constexpr):  # fmt: skip
    """``_store_row`` for widths 2-8's [ROWS, NPAD] result: column b is row b's (rows ``LAYER_A``
    apart in ``act``, ``HIDDEN`` in ``h_in``, ``res`` and ``out``; columns from ``NB`` on are padding).
    Where down's input streams (``DSTREAM``), SiLU(g)·u goes to ``g16`` as bf16 too."""
    yl: gl.constexpr = y.type.layout
    yr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, yl))
    yb = gl.arange(0, NPAD, layout=gl.SliceLayout(0, yl))
    rows = tile * ROWS + yr[:, None]
    ok = (yb[None, :] < NB) & (tile < tiles) & (rows >= 0)
    a = act + yb[None, :] * LAYER_A
    rs = gl.convert_layout(rstd, gl.SliceLayout(0, yl))[None, :]
    if s == 0:
        gl.store(a + rows, _bf(y * rs), mask=ok)
    elif s == 1:
        h = gl.load(h_in + yb[None, :] * HIDDEN + rows, mask=ok, cache_modifier=".cg").to(gl.float32)
        gl.store(a + A_H1 + rows, _bf(_bf(y) + h), mask=ok)
    elif s == 2:  # the tile's 8 gate rows, then their 8 up rows -> 8 SiLU(g)·u a row
        gbuf.store(_bf(y * rs))
        gl.thread_barrier()
        hl: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [2, NW // 2], [1, 0])  # [ROWS // 2, NPAD]
        gv = gbuf.slice(0, ROWS // 2).load(hl)
        uv = gbuf.slice(ROWS // 2, ROWS // 2).load(hl)
        hh = gl.arange(0, ROWS // 2, layout=gl.SliceLayout(1, hl))[:, None]
        hb = gl.arange(0, NPAD, layout=gl.SliceLayout(0, hl))[None, :]
        gu = _bf(_bf(gv / (1.0 + gl.exp(-gv))) * uv)
        gok = (hb < NB) & (tile < tiles) & (hh >= 0)
        gl.store(act + hb * LAYER_A + A_GU + tile * (ROWS // 2) + hh, gu, mask=gok)
        if DSTREAM:
            gl.store(g16 + hb * (2 * LAYER_A) + tile * (ROWS // 2) + hh, gu.to(gl.bfloat16), mask=gok)
    else:
        v = _bf(_bf(y) + gl.load(a + A_H1 + rows, mask=ok, cache_modifier=".cg"))
        live = gl.load(live_ptr + yb, mask=yb < NB, other=-1)[None, :] >= 0
        o = yb[None, :] * HIDDEN + rows
        _residual_out(v, res_dst + o, out_dst + o, health_ptr, code, ok, live, layer, nlayers)


# The runtime integers take every value in service (the first layer of a launch, the block table's
# width, the drills): one compiled kernel a width and cache layout, never a compile inside vLLM's
# graph capture for a value that differs from warm-up's
@gluon.jit(do_not_specialize=["bt_stride", "first", "nlayers", "spin", "fault_layer", "fault_kind"])
def step_kernel(w_ptr, wh_desc, wi_desc, wo_desc, ws_ptr, gin_ptr, gpost_ptr, gpp_ptr, qkn_ptr, wnd_ptr, inv_ptr, inv2_ptr,
                x_ptr, res_ptr, out_ptr, act_ptr, part_ptr,
                kc_ptr, vc_ptr, koff_ptr, voff_ptr, k_sb, k_st, k_sh, v_sb, v_st, v_sh, pos_ptr, slot_ptr, bt_ptr,
                bt_stride, seq_ptr, ctr_ptr, hctr_ptr, epoch_ptr, health_ptr, prof_ptr, first, nlayers, spin, fault_layer,
                fault_kind,
                HIDDEN: gl.constexpr, INTER: gl.constexpr, QH: gl.constexpr, KVH: gl.constexpr, D: gl.constexpr,
                OFF_O: gl.constexpr, OFF_GU: gl.constexpr, OFF_D: gl.constexpr, LAYER_W: gl.constexpr,
                A_ATT: gl.constexpr, A_H1: gl.constexpr, A_GU: gl.constexpr, LAYER_A: gl.constexpr,
                NPROG: gl.constexpr, NBUF: gl.constexpr, T0: gl.constexpr, TO: gl.constexpr,
                T1: gl.constexpr, TD: gl.constexpr, NSPLIT: gl.constexpr, KVS: gl.constexpr, NB: gl.constexpr,
                MMAV: gl.constexpr, TMA: gl.constexpr, BS: gl.constexpr, EPS: gl.constexpr, SCALE: gl.constexpr,
                XMAX: gl.constexpr, XS: gl.constexpr, DSTREAM: gl.constexpr, A_G16: gl.constexpr, PW: gl.constexpr,
                DE: gl.constexpr, FP8: gl.constexpr, LAYER_S: gl.constexpr, WX: gl.constexpr, ONEBOX: gl.constexpr,
                APAD: gl.constexpr, ONESUM: gl.constexpr,
                QS: gl.constexpr, KH: gl.constexpr, GEMMA: gl.constexpr, A_O: gl.constexpr, A_DN: gl.constexpr,
                PROF: gl.constexpr = 0,
                NW: gl.constexpr = 8):  # fmt: skip
    """Layers ``first .. first + nlayers - 1`` of a decode step of ``NB`` rows, one program per SM.

    ``w_ptr`` every layer's packed weights, bf16 or with ``FP8`` e4m3 (``wh_desc``/``wi_desc``
    their TMA views in rows of HIDDEN and of INTER), a weight chunk ``WX`` parts of 1024 columns
    (``StepGeometry.chunk_span``; with ``ONEBOX`` one TMA box at width 1); ``ws_ptr`` with
    ``FP8`` each packed row's scale (fp32, ``LAYER_S`` a layer, ``StepGeometry.scale_offsets``), which its sum takes at the end;
    ``gin``/``gpost`` the norms [layers, HIDDEN]; ``inv_ptr`` RoPE's
    inverse frequencies [D / 2]. ``GEMMA`` (Gemma-3, width 1; ``StepGeometry.gemma``): the norms
    are fp32 (1 + w), ``gpp`` the post norms [layers, 2, HIDDEN] (attention's, the MLP's), ``qkn``
    the q/k norms [layers, 2, D], ``wnd`` each layer's window (int32, 0: full), ``inv2_ptr`` the
    sliding layers' RoPE; o_proj's K is ``QS`` (``wo_desc`` its TMA view), a stage of K = HIDDEN
    ``KH`` chunks; ``A_O``/``A_DN`` o_proj's and down's raw sums in ``act``. ``x`` the residuals entering (bf16 [NB, HIDDEN]); ``res`` bf16
    [nlayers, NB, HIDDEN]; ``out`` bf16 [NB, HIDDEN]; ``act`` fp32 [nlayers, NB, LAYER_A]; ``part`` fp32
    [NB, KVH, NSPLIT, G, D + 2]. K/V: layer l's caches start ``koff[l]``/``voff[l]`` elements past
    ``kc_ptr``/``vc_ptr`` (int64 [layers]), blocks/tokens/heads strided by ``*_sb``, ``*_st``,
    ``*_sh``; ``pos``/``slot`` int64 [NB], ``bt`` int32 [NB, bt_stride], ``seq`` int32 [NB] (the
    row's context including the new position). Counters int64: ``ctr`` [nlayers, NCTR], ``hctr``
    [nlayers, NB, KVH], ``epoch`` [1]; ``health`` int32. ``spin``: polls a program may spend waiting.
    ``fault_layer``/``fault_kind``: local layer + 1 (0 none) and 1 stall (its QKV never counts) or 2
    non-finite (its outgoing residual is NaN). ``XMAX``: the staged input's chunks; ``DSTREAM``:
    down's input streams through ``XS`` X slots (chunks 1 ..) from ``act``'s bf16 copy at ``A_G16``
    (``StepGeometry.streams_down``). ``PW``: positions a warp's attention step reads (16 or 32,
    ``StepGeometry.kv_groups``); ``APAD``: the attention's warp partials summed through padded
    shared-memory rows (``_att_sum_layout``). ``ONESUM``: the norms sum their squares across the
    block once a row, not once a chunk (``StepGeometry.one_sum``). ``DE``: down's first input chunks
    that gate/up's rounds but the last produce (``StepGeometry.down_early_chunks``; 0: none): down starts on them once every
    program counts those rounds, and waits for the whole of gate/up only where its first task
    reaches chunk ``DE``. ``PROF``: each program stamps its stages into ``prof`` where K1's
    (QKV, attention) and K2's (o_proj, gate/up, down) would be: entry (before the wait), the input
    staged, the stage's part counted, and each attention task its q, k and v in and its partial stored
    (``decode_bench.timeline.STEP``)."""
    G: gl.constexpr = QH // KVH
    QKVR: gl.constexpr = (QH + 2 * KVH) * D
    cp_lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])  # copies and width 1's arithmetic
    col: gl.constexpr = gl.SliceLayout(0, cp_lay)
    row: gl.constexpr = gl.SliceLayout(1, cp_lay)
    KW: gl.constexpr = BK // NW  # widths 2-8: a warp's column block of a chunk
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    mma_sw: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])  # 16-byte columns XOR row: ldmatrix's rows
    wdt: gl.constexpr = w_ptr.dtype.element_ty  # the weights' (bf16, or e4m3 with FP8)
    w_sw: gl.constexpr = gl.SwizzledSharedLayout(8 * (1 + FP8), 1, 8, [2, 1, 0])  # the cp.async ring's (16-byte runs)
    pid = gl.program_id(0)
    target = (gl.load(epoch_ptr, volatile=True) // NPROG + 1) * NPROG
    epoch = target // NPROG
    C0: gl.constexpr = T0 * KH
    C1: gl.constexpr = TO * (QS // (BK * WX))
    C2: gl.constexpr = T1 * KH
    C: gl.constexpr = C0 + C1 + C2 + TD * (INTER // (BK * WX))
    total = nlayers * C
    ring_lay: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 1, [1, 0])
    if TMA:
        if MMAV:  # slot n's part p's halves at 2 (WX n + p) and 2 (WX n + p) + 1, each [column block, row, 64]
            boxes = gl.allocate_shared_memory(wdt, [2 * NBUF * WX, NW, ROWS, KW // 2], wh_desc.layout)
            ring = boxes
        elif ONEBOX:  # a slot as TMA writes it (one [16, 4 WX, 256] box), read as [16, WX 1024] rows
            boxes = gl.allocate_shared_memory(wdt, [NBUF, ROWS, WX * BK // TB, TB], wh_desc.layout)
            ring = boxes._reinterpret(wdt, [NBUF, ROWS, WX * BK], ring_lay)
        else:  # the slots as TMA writes them (WX [16, 4, 256] boxes), read as the same bytes' [16, 1024] rows
            boxes = gl.allocate_shared_memory(wdt, [NBUF * WX, ROWS, BK // TB, TB], wh_desc.layout)
            ring = boxes._reinterpret(wdt, [NBUF * WX, ROWS, BK], ring_lay)
        bars = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(NBUF):
            mbarrier.init(bars.index(b), count=1)
        fence_async_shared()
    elif MMAV:  # a slot as [NW column blocks, ROWS, KW]: warp w's A operand is block w
        ring = gl.allocate_shared_memory(wdt, [NBUF * WX, NW, ROWS, KW], w_sw)  # slot n's part p at WX n + p
        boxes = ring
        bars = ring
    else:
        ring = gl.allocate_shared_memory(wdt, [NBUF * WX, ROWS, BK], ring_lay)
        boxes = ring
        bars = ring
    if MMAV:  # the staged input as the X operand, [chunks, NW column blocks, NPAD rows, KW] (bf16)
        XR: gl.constexpr = max(XMAX, 2 * KVS * NW * PW * D // (BK * NPAD))
        xbuf = gl.allocate_shared_memory(gl.bfloat16, [XR, NW, NPAD, KW], mma_sw)
        # a task's products summed over the warps through the first chunk: stages of K = HIDDEN
        # stage into the last chunks, and down (all chunks) has one task a program
        red = xbuf._reinterpret(gl.float32, [NW, ROWS, NPAD], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        gbuf = gl.allocate_shared_memory(gl.float32, [ROWS, NPAD], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    else:  # bf16 staged input, as long as the attention's K/V ring too (held from QKV's end to o_proj's staging)
        XR: gl.constexpr = max(XMAX, 2 * KVS * NW * PW * D // BK)
        xbuf = gl.allocate_shared_memory(gl.bfloat16, [XR, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        gbuf = gl.allocate_shared_memory(gl.float32, [ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        red = gbuf
    kvs = xbuf._reinterpret(gl.bfloat16, [2 * KVS, NW, PW, D], mma_sw)  # the attention's K/V ring
    if MMAV:  # each element's row and column in a chunk, as [NW column blocks, ROWS, KW] (16-byte copies)
        cp3: gl.constexpr = gl.BlockedLayout([1, 1, 8 * (1 + FP8)], [1, 2 + 2 * FP8, 16 // (1 + FP8)], [NW, 1, 1],
                                             [2, 1, 0])  # fmt: skip
        rr = gl.expand_dims(gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, cp3))), 0), 2)
        wc = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, cp3)))
        kc3 = gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(0, cp3)))
        cc = gl.expand_dims(gl.expand_dims(wc, 1), 2) * KW + gl.expand_dims(gl.expand_dims(kc3, 0), 0)
    else:
        rr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, cp_lay))[:, None]
        cc = gl.arange(0, BK, layout=gl.SliceLayout(0, cp_lay))[None, :]
    ry = gl.arange(0, ROWS, layout=row)
    cf = gl.arange(0, BK, layout=gl.BlockedLayout([BK // (32 * NW)], [32], [NW], [0]))  # staging: one element a thread
    for i in range(NBUF - 1):
        _refill(ring, boxes, bars, w_ptr, wh_desc, wi_desc, wo_desc, i, total, pid, first, rr, cc, C, C0, C1, C2, HIDDEN,
                INTER, QKVR, OFF_O, OFF_GU, OFF_D, LAYER_W, NPROG, NBUF, TMA, TD, DSTREAM, MMAV, NW, FP8, WX,
                ONEBOX, QS, KH)  # fmt: skip
    # streamed down: the X chunks whose first weight chunk was asked for before down's wait
    # (0 .. XPRE - 1) are copied at the stage's start, the rest with their weight chunk's refill
    XPRE: gl.constexpr = (NBUF - 2) // TD + 1
    # down waits for gate/up but its last round (counter 5) and stages DE chunks, or for all of it
    DOWN_CTR: gl.constexpr = 5 if DE > 0 else 3
    DOWN_FIRST: gl.constexpr = DE * WX if DE > 0 else INTER // BK  # (staged chunks; DE counts weight chunks)
    if MMAV:
        acc = gl.zeros([NW, ROWS, NPAD], gl.float32, mma)
        if DSTREAM:
            acc2 = gl.zeros([NW, ROWS, NPAD], gl.float32, mma)  # the second down tile's (k-outer)
        rstd = gl.full([NPAD], 1.0, gl.float32, gl.SliceLayout(0, gl.SliceLayout(2, _stage_layout(NW))))
        srow = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(0, _sum_layout(NW))))  # a task's rows
        if DSTREAM:
            wsc2 = gl.full([ROWS], 1.0, gl.float32, srow.type.layout)
    else:
        acc = gl.zeros([ROWS, BK], gl.float32, cp_lay)
        rstd = 1.0
        srow = gl.arange(0, ROWS, layout=row)
    wsc = gl.full([ROWS], 1.0, gl.float32, srow.type.layout)  # FP8: the task's rows' weight scales
    # this program's attention task (programs past NB * KVH * NSPLIT have none): its row and task
    arow = pid // (KVH * NSPLIT)
    task = pid % (KVH * NSPLIT)
    has_task = pid < NB * KVH * NSPLIT
    arow_c = gl.minimum(arow, NB - 1)
    aslot = gl.load(slot_ptr + arow_c)
    apos = gl.load(pos_ptr + arow_c)
    actx = gl.where(aslot >= 0, gl.maximum(gl.load(seq_ptr + arow_c) - 1, 0), 0)  # cached positions before the new one
    bt_row = bt_ptr + arow_c.to(gl.int64) * bt_stride
    if GEMMA:  # the full and the sliding layers' tables
        cs = gl.allocate_shared_memory(gl.bfloat16, [4 * D], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        _cos_sin_2(cs, apos, inv_ptr, inv2_ptr, D, NW)
    else:
        cs = gl.allocate_shared_memory(gl.float32, [2 * D], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        _cos_sin(cs, apos, inv_ptr, D, NW)  # the task row's (read after the QKV stage's barriers)
    live1 = gl.load(slot_ptr) >= 0  # width 1's row
    for i in range(total):
        layer, s, j, k, nk, tiles, kdim, base = _chunk(i, C, C0, C1, C2, HIDDEN, INTER, QKVR, OFF_O, OFF_GU, OFF_D,
                                                       TD, DSTREAM, WX, QS, KH)  # fmt: skip
        tile = pid + j * NPROG
        glayer = first + layer
        act = act_ptr + layer * (NB * LAYER_A)  # the layer's first row
        g16 = act.to(gl.pointer_type(gl.bfloat16)) + 2 * A_G16  # its bf16 SiLU(g)·u (streamed down)
        second = DSTREAM & (s == 3) & (j == 1)  # streamed down's second tile: its own accumulator
        mk = gl.where(s == 0, 0, 1)  # the stage's timeline slot: qkv K1 0, o_proj K2 0, gate/up K2 2, down K2 3
        ms = gl.where(s == 1, 0, s)
        h_in = res_ptr + (layer - 1) * (NB * HIDDEN)  # the layer's incoming residuals
        if layer == 0:
            h_in = x_ptr
        res_dst = res_ptr + layer * (NB * HIDDEN)
        if k == 0:  # a task starts (the old sums are dead here)
            if j == 0:  # a stage starts: wait for its input, stage it
                _stamp(prof_ptr, layer, pid, gl.where(s >= 2, 1, 0), gl.where(s == 1, 1, ms), 0, NPROG, PROF)
                if s == 0:
                    if GEMMA:
                        if layer > 0:  # the previous layer's down sums joined to its h1 here: this layer's input
                            rows = _norm_rows(gpp_ptr + ((glayer - 1) * 2 + 1) * HIDDEN, gin_ptr + glayer * HIDDEN, cf,
                                              HIDDEN, True)  # fmt: skip
                            spin = _wait_for(ctr_ptr + (layer - 1) * NCTR + 4, target, spin, health_ptr,
                                             _code(WAIT_TIMEOUT, 2, glayer - 1))  # fmt: skip
                            gl.thread_barrier()
                            pa = act_ptr + (layer - 1) * (NB * LAYER_A)
                            rstd = _post_normed(xbuf, pa + A_DN, pa + A_H1, rows, h_in, cf, pid, health_ptr,
                                                _code(NONFINITE, 2, glayer - 1), live1, HIDDEN, EPS, NPROG, True,
                                                True, ONESUM)  # fmt: skip
                        else:
                            gl.thread_barrier()
                            rstd = _normed_input(xbuf, h_in, gin_ptr + glayer * HIDDEN, cf, HIDDEN, EPS, ONESUM)
                    else:
                        if layer > 0:
                            spin = _wait_for(ctr_ptr + (layer - 1) * NCTR + 4, target, spin, health_ptr,
                                             _code(WAIT_TIMEOUT, 2, glayer - 1))  # fmt: skip
                        gl.thread_barrier()
                        if MMAV:
                            rstd = _stage_rows(xbuf, h_in, HIDDEN, gin_ptr + glayer * HIDDEN, HIDDEN // BK, XMAX, NB, True,
                                               HIDDEN, EPS, NW, ONESUM=ONESUM)  # fmt: skip
                        else:
                            rstd = _normed_input(xbuf, h_in, gin_ptr + glayer * HIDDEN, cf, HIDDEN, EPS, ONESUM)
                elif s == 1:
                    koff = gl.multiple_of(gl.load(koff_ptr + glayer), 16)
                    voff = gl.multiple_of(gl.load(voff_ptr + glayer), 16)
                    if GEMMA:  # a sliding layer's row sees its last ``window`` positions, the new one included
                        wnd = gl.load(wnd_ptr + glayer)
                        alo = gl.where(wnd > 0, gl.minimum(gl.maximum(apos - wnd + 1, 0), actx), 0)
                    else:
                        wnd = 0
                        alo = 0
                    kvh0, sp0, start0, end0 = _kv_span(task, actx, alo, NSPLIT, NW, PW)
                    bnext = gl.zeros([NW, PW], gl.int32, gl.SliceLayout(2, _tile_layout(NW)))
                    spin = _wait_for(ctr_ptr + layer * NCTR, target, spin, health_ptr, _code(WAIT_TIMEOUT, 1, glayer))
                    _stamp(prof_ptr, layer, pid, 0, 1, 1, NPROG, PROF)  # the attention's input is there
                    # the task's first K/V tiles after the wait, not before it: run 106 timed them before
                    # it 0.4-1.2 % slower (1B, widths 1 and 8), their blocks held in registers across it
                    if has_task:
                        ab = act + arow_c * LAYER_A  # the task's row
                        qx, qr, kx, kr, vn = _qkv_in(ab, kvh0, QH, KVH, D, NW)
                        if GEMMA:
                            qx, qr, kx, kr = _qk_normed(qx, qr, kx, kr, qkn_ptr + glayer * (2 * D), D, EPS, NW)
                        bnext = _kv_first(kvs, kc_ptr, vc_ptr, koff, voff, bt_row, kvh0, start0, end0, k_sb, k_st,
                                          k_sh, v_sb, v_st, v_sh, BS, D, KVS, NW, PW)  # fmt: skip
                        pb = part_ptr + arow_c * (KVH * NSPLIT * G * (D + 2))
                        _attend(qx, qr, kx, kr, vn, kc_ptr, vc_ptr, koff, voff, cs, pb, bt_row, bnext, task, actx, aslot, kvs,
                                k_sb, k_st, k_sh, v_sb, v_st, v_sh, QH, KVH, D, BS, SCALE, NSPLIT, KVS, NW, PW,
                                prof_ptr, layer, pid, NPROG, PROF, alo, wnd > 0, GEMMA, APAD)  # fmt: skip
                        _stamp(prof_ptr, layer, pid, 0, 1, ATT_PART, NPROG, PROF)  # its partial stored
                        _merge_splits(ab + A_ATT, pb, hctr_ptr + (layer * NB + arow_c) * KVH + task // NSPLIT,
                                      ctr_ptr + layer * NCTR + 1, epoch, task // NSPLIT, G, D, NSPLIT, NW)  # fmt: skip
                    _stamp(prof_ptr, layer, pid, 0, 1, 2, NPROG, PROF)  # its heads merged
                    _stamp(prof_ptr, layer, pid, 1, 0, 0, NPROG, PROF)  # o_proj waits for every head
                    spin = _wait_for(ctr_ptr + layer * NCTR + 1, epoch * (KVH * NB), spin, health_ptr,
                                     _code(WAIT_TIMEOUT, 1, glayer))  # fmt: skip
                    gl.thread_barrier()
                    if MMAV:
                        _stage_rows(xbuf, act + A_ATT, LAYER_A, gin_ptr, HIDDEN // BK, XMAX, NB, False, HIDDEN, EPS, NW)
                    else:
                        _staged_bf16(xbuf, act + A_ATT, cf, 0, QS // BK)
                elif s == 2:
                    if GEMMA:  # o_proj's sums joined to the residual here: h1, this program's rows of it kept
                        rows = _norm_rows(gpp_ptr + glayer * 2 * HIDDEN, gpost_ptr + glayer * HIDDEN, cf, HIDDEN, True)
                    spin = _wait_for(
                        ctr_ptr + layer * NCTR + 2, target, spin, health_ptr, _code(WAIT_TIMEOUT, 2, glayer)
                    )
                    gl.thread_barrier()
                    if GEMMA:
                        rstd = _post_normed(xbuf, act + A_O, h_in, rows, act + A_H1, cf, pid, health_ptr, 0, live1,
                                            HIDDEN, EPS, NPROG, True, False, ONESUM)  # fmt: skip
                    elif MMAV:
                        rstd = _stage_rows(xbuf, act + A_H1, LAYER_A, gpost_ptr + glayer * HIDDEN, HIDDEN // BK, XMAX,
                                           NB, True, HIDDEN, EPS, NW, ONESUM=ONESUM)  # fmt: skip
                    else:
                        rstd = _normed_input(xbuf, act + A_H1, gpost_ptr + glayer * HIDDEN, cf, HIDDEN, EPS, ONESUM)
                else:  # (with DE, for the first DE chunks: gate/up's rounds but its last)
                    spin = _wait_for(ctr_ptr + layer * NCTR + DOWN_CTR, target, spin, health_ptr,
                                     _code(WAIT_TIMEOUT, 2, glayer))  # fmt: skip
                    gl.thread_barrier()
                    if DSTREAM:  # the first X chunks (in every thread's own group), landed before their use
                        for kk in gl.static_range(XPRE):
                            for p in gl.static_range(WX):
                                _x_copy(xbuf, 1 + WX * (kk % XS) + p, g16, WX * kk + p, LAYER_A, NB, NW)
                        async_copy.commit_group()
                        async_copy.wait_group(0)
                    else:  # (gate/up's tasks stored SiLU(g)·u)
                        _down_input(xbuf, act + A_GU, cf, 0, DOWN_FIRST, LAYER_A, INTER, XMAX, NB, MMAV, NW)
                gl.thread_barrier()
                _stamp(prof_ptr, layer, pid, mk, ms, 1, NPROG, PROF)  # the stage's input staged
            if DSTREAM:
                if second:
                    acc2 = gl.zeros([NW, ROWS, NPAD], gl.float32, mma)
                else:
                    acc = gl.zeros([NW, ROWS, NPAD], gl.float32, mma)
            elif MMAV:
                acc = gl.zeros([NW, ROWS, NPAD], gl.float32, mma)
            else:
                acc = gl.zeros([ROWS, BK], gl.float32, cp_lay)
            if FP8:  # the task's rows' scales, asked for at its start (their round trip off its end)
                sbase = gl.where(
                    s == 0, 0, gl.where(s == 1, QKVR, gl.where(s == 2, QKVR + HIDDEN, QKVR + HIDDEN + 2 * INTER))
                )
                sc = gl.load(ws_ptr + glayer * LAYER_S + sbase + tile * ROWS + srow, mask=tile < tiles, other=1.0)
                if DSTREAM:
                    if second:
                        wsc2 = sc
                    else:
                        wsc = sc
                else:
                    wsc = sc
        if DE > 0:  # down reaches the chunks of gate/up's last round: wait for all of it
            if DSTREAM:  # (streamed: before the refill below asks for X chunk DE, NBUF - 1 chunks ahead)
                if (s == 3) & (k == DE - (NBUF + TD - 2) // TD) & (j == (DE * TD - (NBUF - 1)) % TD):
                    spin = _wait_for(ctr_ptr + layer * NCTR + 3, target, spin, health_ptr,
                                     _code(WAIT_TIMEOUT, 2, glayer))  # fmt: skip
            elif (s == 3) & (j == 0) & (k == DE):  # (staged: where the first task reaches them)
                spin = _wait_for(ctr_ptr + layer * NCTR + 3, target, spin, health_ptr, _code(WAIT_TIMEOUT, 2, glayer))
                gl.thread_barrier()
                _down_input(xbuf, act + A_GU, cf, DE * WX, INTER // BK, LAYER_A, INTER, XMAX, NB, MMAV, NW)
        if TMA:  # chunk i is its slot's (i // NBUF)-th phase
            mbarrier.wait(bars.index(i % NBUF), (i // NBUF) & 1)
            if DSTREAM:  # down's X chunk k: its own commit group, younger ones for the next (NBUF - 2) // TD
                if (s == 3) & (j == 0):
                    async_copy.wait_group((NBUF - 2) // TD)
        else:
            async_copy.wait_group(NBUF - 2)  # chunk i has landed once at most NBUF - 2 younger groups pend
        gl.thread_barrier()
        # streamed down: the refill below asks for down's k-th chunk of tile 0, whose X chunk is copied
        # with it (joining its group in the cp.async ring; k >= XPRE: this program is past down's
        # wait; X slot 1 + k % XS was last read NBUF - 1 chunks ago)
        if DSTREAM:
            l2, s2, j2, k2, nk2, t2, kd2, b2 = _chunk(i + NBUF - 1, C, C0, C1, C2, HIDDEN, INTER, QKVR, OFF_O, OFF_GU,
                                                      OFF_D, TD, DSTREAM, WX, QS, KH)  # fmt: skip
            if (s2 == 3) & (j2 == 0) & (k2 >= XPRE) & (i + NBUF - 1 < total):
                for p in gl.static_range(WX):
                    _x_copy(xbuf, 1 + WX * (k2 % XS) + p, g16, WX * k2 + p, LAYER_A, NB, NW)
                if TMA:  # no cp.async group of the ring's to join
                    async_copy.commit_group()
        # refill the slot chunk i - 1 left (every thread is past it: the barrier above), before the arithmetic
        _refill(ring, boxes, bars, w_ptr, wh_desc, wi_desc, wo_desc, i + NBUF - 1, total, pid, first, rr, cc, C, C0, C1,
                C2, HIDDEN, INTER, QKVR, OFF_O, OFF_GU, OFF_D, LAYER_W, NPROG, NBUF, TMA, TD, DSTREAM, MMAV, NW,
                FP8, WX, ONEBOX, QS, KH)  # fmt: skip
        if MMAV:  # W[16, KW] @ X[KW, NPAD] for the warp's column block, part by part
            for p in gl.static_range(WX):
                if DSTREAM:
                    xs = xbuf.index(gl.where(s == 3, 1 + WX * (k % XS) + p, WX * (k - nk) + p + XMAX))
                    if second:
                        acc2 = _chunk_mma(ring, WX * (i % NBUF) + p, xs, acc2, TMA, NW, FP8)
                    else:
                        acc = _chunk_mma(ring, WX * (i % NBUF) + p, xs, acc, TMA, NW, FP8)
                else:
                    acc = _chunk_mma(ring, WX * (i % NBUF) + p, xbuf.index(WX * (k - nk) + p + XMAX), acc, TMA, NW, FP8)
        else:  # (a chunk of WX [16, 1024] boxes, each over its staged chunk)
            for h in gl.static_range(WX):
                if ONEBOX:
                    w = ring.index(i % NBUF).slice(h * BK, BK, dim=1).load(cp_lay).to(gl.float32)
                else:
                    w = ring.index(WX * (i % NBUF) + h).load(cp_lay).to(gl.float32)
                acc += w * xbuf.index(WX * k + h).load(col).to(gl.float32)[None, :]
        if k == nk - 1:  # the task's rows are done
            nan = (fault_kind == 2) & (fault_layer == layer + 1) & (s == 3)
            code = _code(NONFINITE, 2, glayer)
            if MMAV:
                if DSTREAM:
                    if second:
                        y = _warps_summed(acc2, red, NW)
                        if FP8:
                            y = y * wsc2[:, None]
                    else:
                        y = _warps_summed(acc, red, NW)
                        if FP8:
                            y = y * wsc[:, None]
                else:
                    y = _warps_summed(acc, red, NW)
                    if FP8:
                        y = y * wsc[:, None]
                if nan:
                    y = y + float("nan")
                _store_rows(y, rstd, gbuf, act, g16, h_in, res_dst, out_ptr, health_ptr, code, slot_ptr, layer, s,
                            tile, tiles, HIDDEN, A_H1, A_GU, LAYER_A, nlayers, NB, DSTREAM, NW)  # fmt: skip
            elif tile < tiles:
                y = gl.sum(acc, axis=1)
                if FP8:
                    y = y * wsc
                if nan:
                    y = y + float("nan")
                _store_row(y, rstd, gbuf, act, h_in, res_dst, out_ptr, health_ptr, code, live1, layer, s,
                           tile * ROWS + ry, tile, A_H1, A_GU, nlayers, NW, GEMMA, A_O, A_DN)  # fmt: skip
            if DE > 0:
                if (s == 2) & (j == T1 - 2):  # gate/up's rounds but its last stored (down's first DE chunks)
                    gl.thread_barrier()
                    gl.atomic_add(ctr_ptr + layer * NCTR + 5, 1, sem="release", scope="gpu")
            if j == gl.where(s == 0, T0 - 1, gl.where(s == 1, TO - 1, gl.where(s == 2, T1 - 1, TD - 1))):  # part stored
                stall = (fault_kind == 1) & (fault_layer == layer + 1) & (s == 0)
                gl.thread_barrier()
                if not stall:
                    gl.atomic_add(ctr_ptr + layer * NCTR + gl.where(s == 0, 0, s + 1), 1, sem="release", scope="gpu")
                _stamp(prof_ptr, layer, pid, mk, ms, 2, NPROG, PROF)  # the stage's part counted
    if GEMMA:  # the last layer's down sums joined to its h1: this program's rows of the step's output
        rows = _norm_rows(gpp_ptr + ((first + nlayers - 1) * 2 + 1) * HIDDEN, gpp_ptr, cf, HIDDEN, False)
        spin = _wait_for(ctr_ptr + (nlayers - 1) * NCTR + 4, target, spin, health_ptr,
                         _code(WAIT_TIMEOUT, 2, first + nlayers - 1))  # fmt: skip
        pa = act_ptr + (nlayers - 1) * (NB * LAYER_A)
        _post_normed(xbuf, pa + A_DN, pa + A_H1, rows, out_ptr, cf, pid, health_ptr,
                     _code(NONFINITE, 2, first + nlayers - 1), live1, HIDDEN, EPS, NPROG, False, True, ONESUM)  # fmt: skip
    async_copy.wait_group(0)
    if TMA:  # every chunk's phase was waited for in the loop: none is in flight
        for b in gl.static_range(NBUF):
            mbarrier.invalidate(bars.index(b))
    old = gl.atomic_add(epoch_ptr, 1, sem="acq_rel", scope="gpu")
    if (old + 1) % NPROG == 0:  # the last program out: after a failed launch, settle every counter
        if gl.load(health_ptr, volatile=True) != 0:  # at its healthy value, so the next launch starts consistent
            cl: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
            n = gl.arange(0, 32 * NW, layout=cl)
            for c0 in range(0, nlayers * NCTR, 32 * NW):
                cc0 = c0 + n
                want = gl.where(cc0 % NCTR == 1, epoch * (KVH * NB), target).to(gl.int64)
                gl.atomic_max(ctr_ptr + cc0, want, mask=cc0 < nlayers * NCTR, sem="relaxed", scope="gpu")
            for c0 in range(0, nlayers * NB * KVH, 32 * NW):
                cc0 = c0 + n
                want = cc0.to(gl.int64) * 0 + epoch * NSPLIT
                gl.atomic_max(hctr_ptr + cc0, want, mask=cc0 < nlayers * NB * KVH, sem="relaxed", scope="gpu")
