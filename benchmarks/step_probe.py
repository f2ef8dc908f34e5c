"""Issue 26's item 7 with a whole decoder layer: every stage of a decode step in ONE launch (one GPU).

``loader_probe.py`` measured the weight ring on K2's chain alone (o_proj -> gate/up -> down). This
probe runs Llama-3-1B's whole decoder layer (``--model llama3-8b``: 8B's) the same way, ``--layers`` distinct layers in one
persistent launch of one program per SM, with every piece the two-launch kernels run at batch 1:
RMSNorm (its rstd deferred to each row's sum: the staged input carries the norm weight), QKV,
RoPE (rotate-half, from a cos/sin row as vLLM passes it), the new position's K/V written into a
bf16 cache, split-KV attention over the cached context (GQA: one task per KV head and split, the
last split of a head to arrive merges the head's partials in fixed split order), o_proj plus the
residual, the second norm, gate/up, SiLU(g)·u and down plus the residual. Residual and stage
outputs are fp32.

Each program walks one fixed sequence of [16 rows, 1024 columns] weight chunks (its row tiles of
QKV, o_proj, gate/up and down of every layer) through a ring of ``--ring`` 32 KiB shared-memory
slots filled by ``cp.async`` (``loader_probe``'s fastest form), always ``ring - 1`` chunks ahead of
the compute, across every wait and the attention task: while a program waits for QKV, attends
and waits for the merges, its first o_proj and gate/up chunks are already on chip. Stages wait on
completion counters (one count per program, or per merged KV head), as the kernels' mailbox does.
``--tma 1`` fills the same slots by TMA instead: one [16, 4, 256] box a chunk on the slot's
mbarrier, one instruction where cp.async takes 2048 (run 101: 1-2 % faster, the default).

``--batch`` decodes 1 to 8 rows at once, each with its own context (the served shape: several rows,
thousands of positions). Above 1 it needs ``--mmav 1``: the GEMV on tensor cores, each warp's 128
columns of a chunk as ``mma.sync`` W[16, 128] @ X[128, 8] (the rows padded to mma's 8 columns,
the warps' products summed once a task), so a weight chunk costs the same instructions at every
batch; the staged input, 8 rows of up to 8192 bf16, also holds the attention task's K/V ring.

The attention task comes in five forms (``ATTENTION``, runs 86-96): one query head after another;
the group's heads together; each warp its own online softmax over its own positions; that on
tensor cores (``mma.sync``, q and P in bf16); and that fed by a ``cp.async`` K/V ring in shared
memory, the fastest (run 100: 1.12-1.14x the strongest stock at 1k-32k, with the staged inputs
in bf16). Each other choice the runs
compared is a knob too (``VARIANTS``), so any two forms can be timed side by side.

Not the product kernel: Llama's shapes (1B; 8B at batch 1: the tensor-core GEMV's 8-row staged
input of down would not fit at 14336 columns), every row at the same position, fp32 stage outputs, a
contiguous cache, no health word, no fallbacks. It answers how far the one-launch design goes on
the whole layer against issue 26's targets (1B at 1k: 0.70 of the read probe; >= 1.00x the
strongest stock at batch 1-8), side by side with the kernels and the strongest stock in the same
device command.

Output checked against a torch fp32 reference of the same layers, row by row (relative error of
the last layer's residuals, and the new position's K/V in the cache).

``--stock fullgraph,fullgraph-cdt`` also runs the benchmark harness's strongest stock steps over
the same weights, caches and rows, timed the same way (``probe_stock.py``), and prints per context
and batch the fastest of each within the harness's error bound and their ratio: the one honest
comparison of the probe with the stock, where the harness's ratios mix two timing methods. Every
cell, probe and stock, is also timed the harness's way, one step a graph replay after a
synchronize (``us_per_layer_one_replay``: what a served step pays, its graph's launch included).

Usage (GPU machine, repository root): ``python benchmarks/step_probe.py --layers 8 --contexts
1024,8192,32768 [--ring 3,5 --attention 2,4 ... (every ``VARIANTS`` knob)] [--stock KINDS] [--timeline]
[--out DIR]``:
every combination of the knobs' values is checked and timed, side by side in one process; the
defaults are the fastest form measured (runs 100-103).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path[:0] = [
    str(Path(__file__).resolve().parents[1]),
    str(Path(__file__).resolve().parents[1] / "ops"),
    str(Path(__file__).resolve().parent),
]

import probe_stock  # noqa: E402
from loader_probe import _epoch_target, _wait  # noqa: E402

from monodecode.kernels.triton.step_kernel import _stage_layout, _tile_layout, _warps_summed  # noqa: E402  (the product's port)
from monodecode.model.profiles import profile_dims  # noqa: E402

# The model profile whose decoder layer the probe runs: Gluon reads the shapes below as module
# constants, so a process runs one model (``--model`` runs the script again with it set).
MODELS = ("llama3-1b", "llama3-8b")  # the Llama-shaped profiles: no q/k-norm, no post norms, SiLU
MODEL = os.environ.get("STEP_PROBE_MODEL", "llama3-1b")
if MODEL not in MODELS:
    sys.exit(f"error: STEP_PROBE_MODEL={MODEL!r} is not one of {', '.join(MODELS)}")
_dims = profile_dims(MODEL)
H_, I_, QH_, KVH_, D_ = _dims.hidden_size, _dims.intermediate_size, _dims.num_heads, _dims.num_kv_heads, _dims.head_dim
ROWS_, BK_, BLK_ = 16, 1024, 64  # a weight chunk: 16 rows x 1024 columns (32 KiB); 64 positions a KV block
TB_ = 256  # ``TMA`` 1: a chunk is one [16, 4, 256] box (TMA's boxes are at most 256 elements a side)
QKV_ = (QH_ + 2 * KVH_) * D_
EPS_ = 1e-5  # RMSNorm's epsilon, the kernel's and the reference's
HIDDEN = gl.constexpr(H_)
INTER = gl.constexpr(I_)
QH = gl.constexpr(QH_)
KVH = gl.constexpr(KVH_)
D = gl.constexpr(D_)
G = gl.constexpr(QH_ // KVH_)
ROWS = gl.constexpr(ROWS_)
BK = gl.constexpr(BK_)
BLK = gl.constexpr(BLK_)
TB = gl.constexpr(TB_)
XMAX = gl.constexpr(I_ // BK_)  # the stage input buffer: down's input as [INTER // BK, BK]
NPAD_ = 8
NPAD = gl.constexpr(NPAD_)  # ``MMAV`` 1: the rows padded to mma.sync's 8 columns (m16n8k16: W[16, K] @ X[K, 8])
# a layer's weights, one bf16 block: [qkv (QKV, H) | o (H, H) | gate/up (2I, H) | down (H, I)], down and
# the next layer starting at whole rows of both H and I (TMA's row views; 1B needs no padding)
WEIGHTS_ = (QKV_ + H_ + 2 * I_) * H_ + H_ * I_  # a layer's weights, padding left out
_ROW_ = math.lcm(H_, I_)
OFF_O_ = QKV_ * H_
OFF_GU_ = OFF_O_ + H_ * H_
OFF_D_ = -(-(OFF_GU_ + 2 * I_ * H_) // _ROW_) * _ROW_
LAYER_W_ = -(-(OFF_D_ + H_ * I_) // _ROW_) * _ROW_
OFF_O = gl.constexpr(OFF_O_)
OFF_GU = gl.constexpr(OFF_GU_)
OFF_D = gl.constexpr(OFF_D_)
LAYER_W = gl.constexpr(LAYER_W_)
# a layer's fp32 activations: [qkv | attention out | h1 = h + o | gate/up | h2 = h1 + down]
A_QKV_, A_ATT_, A_H1_, A_GU_, A_H2_ = 0, QKV_, QKV_ + H_, QKV_ + 2 * H_, QKV_ + 2 * H_ + 2 * I_
LAYER_A_ = A_H2_ + H_
A_ATT = gl.constexpr(A_ATT_)
A_H1 = gl.constexpr(A_H1_)
A_GU = gl.constexpr(A_GU_)
A_H2 = gl.constexpr(A_H2_)
LAYER_A = gl.constexpr(LAYER_A_)
EPS = gl.constexpr(EPS_)
SCALE = gl.constexpr(D_**-0.5)  # softmax scale
NCTR_ = 5  # a layer's counters: qkv, heads merged, o_proj, gate/up, down
NCTR = gl.constexpr(NCTR_)
# timeline events of a layer on a program (``--timeline``): stage entries, waits done, parts counted
EVENTS = ("enter", "in_ready", "qkv_done", "qkv_ready", "attn_done", "heads_ready", "o_done", "o_ready",
          "gu_done", "gu_ready", "down_done", "qkv_staged", "attn_partial", "o_staged", "gu_staged",
          "down_staged")  # fmt: skip
NEV = gl.constexpr(len(EVENTS))
ATTENTION = ("per_head", "grouped", "warps", "mma", "mma_ring")  # the attention tasks, by ``ATT``
# the knobs a run times every combination of: default values (the fastest form measured, runs 100-103),
# meaning (``step_chain``'s constexprs)
VARIANTS = {
    "ring": ("3", "ring slots of 32 KiB (NBUF)"),
    "attention": (
        "4",
        "attention task: 0 per query head, 1 grouped, 2 per-warp, 3 per-warp mma (pw 16), 4 the same "
        "through a K/V ring in shared memory (ATT)",
    ),
    "rot": ("0", "K chunk order: 0 every task from chunk 0, 1 rotated by program (ROT)"),
    "splits": (
        "0",
        "attention splits per KV head and row, batch x 8 heads x splits <= SMs; 0: the most that fit, a "
        "power of two, with 128 positions or more each (16 at batch 1 from 2k on) (NSPLIT)",
    ),
    "poll": ("0", "counter polls: 0 atomic, 1 ld.acquire (POLL)"),
    "early": ("1", "refill issued 0 after, 1 before a chunk's arithmetic (EARLY)"),
    "gu": ("1", "gate/up rows 0 as loaded, 1 interleaved by 8 with SiLU(g)*u in the task (GU)"),
    "depth": ("1", "K/V tiles in flight in the per-warp attention task: 1 or 2 (DEPTH)"),
    "pw": ("16", "positions a warp scores per step of the per-warp attention task: 8 or 16 (PW)"),
    "kvs": ("3", "slots of attention 4's K/V ring, 2 or 3 (KVS)"),
    "lay": ("0", "GEMV arithmetic: 0 two rows a warp over the whole chunk, 1 16 rows x 4 columns a thread (LAY)"),
    "xbf": ("1", "each stage's staged input: 0 fp32, 1 bf16 (XBF)"),
    "merge": ("0", "the splits merged 0 by the last of each head, 1 by o_proj's programs staging (MERGE)"),
    "tma": ("1", "weight ring filled 0 by cp.async, 1 by TMA, one box a chunk on the slot's mbarrier (TMA)"),
    "pf": (
        "0",
        "chunks after the ring's window asked of L2 (prefetch.global.L2) as a program enters the QKV wait and the "
        "attention, so HBM streams on through them (PF)",
    ),
    "batch": ("1", "rows decoded at once, 1 to 8, each with its own context; above 1 needs mmav 1 (NB)"),
    "mmav": (
        "0",
        "GEMV arithmetic: 0 FMA (batch 1), 1 tensor cores: each warp's 128 columns of a chunk as "
        "mma.sync W[16, 128] @ X[128, 8], the rows padded to 8 columns (MMAV)",
    ),
}
SWITCHES = ("rot", "poll", "early", "gu", "lay", "xbf", "merge", "tma", "mmav")  # the knobs that are off (0) or on (1)
# TMA 1: the weights as boxes of a chunk's 16 rows x 4 blocks x 256 columns, unswizzled, so a slot
# holds the same bytes in the same order as cp.async leaves them
TMA_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)


def weight_descriptors(w: torch.Tensor) -> tuple[TensorDescriptor, TensorDescriptor]:
    """``TMA`` 1's views of every layer's weights: rows of ``HIDDEN`` columns (qkv, o_proj,
    gate/up) and rows of ``INTER`` (down), each row as blocks of ``TB`` (a layer's weights and every
    stage's offset are whole rows of both)."""
    assert LAYER_W_ % I_ == 0 and OFF_D_ % I_ == 0 and OFF_D_ % H_ == 0
    box = [ROWS_, BK_ // TB_, TB_]
    return (
        TensorDescriptor.from_tensor(w.view(-1, H_ // TB_, TB_), box, TMA_LAYOUT),
        TensorDescriptor.from_tensor(w.view(-1, I_ // TB_, TB_), box, TMA_LAYOUT),
    )


@gluon.jit
def _chunk(i, pid, C: gl.constexpr, C0: gl.constexpr, C1: gl.constexpr, C2: gl.constexpr, ROT: gl.constexpr):
    """Chunk ``i`` of this program's sequence -> (layer, weight stage, task slot, chunk's place in
    its task, its K chunk, K chunks, output tiles, K, the stage's first weight). Weight stages, each
    a number of task slots of HIDDEN // BK chunks (down: INTER // BK): 0 qkv (``C0`` chunks), 1
    o_proj (``C1``), 2 gate/up (``C2``), 3 down (the rest of ``C``). ``ROT``: a task walks its K chunks starting at ``pid % K chunks``, so
    the programs' concurrent reads spread over every column block of a stage instead of all
    striding through the same one (each tile's order is still fixed)."""
    layer = i // C
    r = i % C
    s = gl.where(r < C0, 0, gl.where(r < C0 + C1, 1, gl.where(r < C0 + C1 + C2, 2, 3)))
    rs = r - gl.where(s == 0, 0, gl.where(s == 1, C0, gl.where(s == 2, C0 + C1, C0 + C1 + C2)))
    nk = gl.where(s == 3, INTER // BK, HIDDEN // BK)
    tiles = gl.where(s == 0, (QH + 2 * KVH) * D // ROWS, gl.where(s == 2, 2 * INTER // ROWS, HIDDEN // ROWS))
    kdim = gl.where(s == 3, INTER, HIDDEN)
    base = gl.where(s == 0, 0, gl.where(s == 1, OFF_O, gl.where(s == 2, OFF_GU, OFF_D)))
    return layer, s, rs // nk, rs % nk, (rs + pid * ROT) % nk, nk, tiles, kdim, base


@gluon.jit
def _issue(ring, w_ptr, i, total, pid, rr, cc, C: gl.constexpr, C0: gl.constexpr, C1: gl.constexpr, C2: gl.constexpr,
           NPROG: gl.constexpr, NBUF: gl.constexpr, ROT: gl.constexpr):  # fmt: skip
    """Start copying chunk ``i`` into its ring slot (a zero-byte group past the end or the tiles).
    ``rr``/``cc``: each copied element's row and column in the chunk, broadcast to the slot's shape
    ([ROWS, BK], or ``MMAV``'s [NW, ROWS, BK // NW] with the column block first)."""
    layer, s, j, kq, k, nk, tiles, kdim, base = _chunk(i, pid, C, C0, C1, C2, ROT)
    tile = pid + j * NPROG
    ok = (i < total) & (tile < tiles)
    off = layer.to(gl.int64) * LAYER_W + base + (tile * ROWS + rr).to(gl.int64) * kdim + k * BK + cc
    m = ok & (rr >= 0) & (cc >= 0)
    async_copy.async_copy_global_to_shared(ring.index(i % NBUF), w_ptr + off, mask=m)
    async_copy.commit_group()


@gluon.jit
def _issue_tma(boxes, bars, wh_desc, wi_desc, i, total, pid, C: gl.constexpr, C0: gl.constexpr, C1: gl.constexpr, C2: gl.constexpr,
               NPROG: gl.constexpr, NBUF: gl.constexpr, ROT: gl.constexpr):  # fmt: skip
    """``_issue`` by TMA: chunk ``i`` as one box on its slot's barrier (one instruction, where
    cp.async takes 2048). A chunk past the end or the tiles copies nothing and arrives on the
    barrier itself, so every slot completes one phase per chunk and the waits stay in step."""
    layer, s, j, kq, k, nk, tiles, kdim, base = _chunk(i, pid, C, C0, C1, C2, ROT)
    tile = pid + j * NPROG
    ok = (i < total) & (tile < tiles)
    bar = bars.index(i % NBUF)
    row = layer * (LAYER_W // kdim) + base // kdim + tile * ROWS  # in rows of the stage's K
    mbarrier.expect(bar, ROWS * BK * 2, pred=ok)
    if s == 3:
        tma.async_copy_global_to_shared(wi_desc, [row, k * (BK // TB), 0], bar, boxes.index(i % NBUF), pred=ok)
    else:
        tma.async_copy_global_to_shared(wh_desc, [row, k * (BK // TB), 0], bar, boxes.index(i % NBUF), pred=ok)
    mbarrier.arrive(bar, pred=~ok)


@gluon.jit
def _refill(ring, boxes, bars, w_ptr, wh_desc, wi_desc, i, total, pid, rr, cc, C: gl.constexpr, C0: gl.constexpr,
            C1: gl.constexpr, C2: gl.constexpr, NPROG: gl.constexpr, NBUF: gl.constexpr, ROT: gl.constexpr, TMA: gl.constexpr):  # fmt: skip
    """Start chunk ``i`` into its slot the way ``TMA`` says: ``_issue_tma`` or ``_issue``."""
    if TMA:
        _issue_tma(boxes, bars, wh_desc, wi_desc, i, total, pid, C, C0, C1, C2, NPROG, NBUF, ROT)
    else:
        _issue(ring, w_ptr, i, total, pid, rr, cc, C, C0, C1, C2, NPROG, NBUF, ROT)


@gluon.jit
def _prefetch_l2(w_ptr, i, total, pid, C: gl.constexpr, C0: gl.constexpr, C1: gl.constexpr, C2: gl.constexpr, NPROG: gl.constexpr,
                 ROT: gl.constexpr, NW: gl.constexpr):  # fmt: skip
    """Ask L2 for chunk ``i``'s 256 lines of 128 bytes (``prefetch.global.L2``, one line a thread
    for 8 warps: no registers or shared memory held), so the ring's later refill of it reads L2.
    Past the end or the tiles: nothing."""
    layer, s, j, kq, k, nk, tiles, kdim, base = _chunk(i, pid, C, C0, C1, C2, ROT)
    tile = pid + j * NPROG
    ok = (i < total) & (tile < tiles)
    LINES: gl.constexpr = ROWS * BK * 2 // 128
    ln = gl.arange(0, LINES, layout=gl.BlockedLayout([LINES // (32 * NW)], [32], [NW], [0]))
    off = layer.to(gl.int64) * LAYER_W + base + (tile * ROWS + ln // (LINES // ROWS)).to(gl.int64) * kdim + k * BK
    off += (ln % (LINES // ROWS)) * 64  # 64 bf16 a line
    if ok:
        gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [w_ptr + off],
                                  dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _normed_input(xbuf, src, g_ptr, cf):
    """Stage ``src`` (HIDDEN fp32) times the norm weight into ``xbuf``; returns its rstd, which each
    row's sum takes at the end (one pass: no second read of the input)."""
    ss = 0.0
    for c in gl.static_range(HIDDEN // BK):
        v = gl.load(src + c * BK + cf, cache_modifier=".cg")
        ss += gl.sum(v * v, axis=0)
        xbuf.index(c).store((v * gl.load(g_ptr + c * BK + cf).to(gl.float32)).to(xbuf.dtype))
    return gl.rsqrt(ss / HIDDEN + EPS)


@gluon.jit
def _stage_rows(xbuf, src, stride, g_ptr, NCH: gl.constexpr, NB: gl.constexpr, NORM: gl.constexpr,
                NW: gl.constexpr):  # fmt: skip
    """``MMAV`` 1's staging: the ``NB`` rows ``src + b * stride`` (``NCH`` chunks of BK) into
    ``xbuf``'s last ``NCH`` chunks, each chunk as [NW column blocks, NPAD rows, BK // NW] (the
    mma's X operand, rows past ``NB`` zero), times the norm weight ``g_ptr`` when ``NORM``.
    Returns the rows' rstd ([NPAD], 1 past ``NB`` or without ``NORM``), which each output column
    takes at the end."""
    KW: gl.constexpr = BK // NW
    st: gl.constexpr = _stage_layout(NW)
    w3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, st))), 1), 2)
    b3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NPAD, layout=gl.SliceLayout(0, gl.SliceLayout(2, st))), 0), 2)
    k3 = gl.expand_dims(gl.expand_dims(gl.arange(0, KW, layout=gl.SliceLayout(0, gl.SliceLayout(0, st))), 0), 0)
    ss = gl.zeros([NPAD], gl.float32, gl.SliceLayout(0, gl.SliceLayout(2, st)))
    for c in gl.static_range(NCH):
        col = c * BK + w3 * KW + k3  # [NW, 1, KW]
        v = gl.load(src + b3 * stride + col, mask=(b3 < NB) & (col >= 0), other=0.0, cache_modifier=".cg")
        if NORM:
            ss += gl.sum(gl.sum(v * v, axis=2), axis=0)
            v = v * gl.load(g_ptr + col).to(gl.float32)
        xbuf.index(XMAX - NCH + c).store(v.to(xbuf.dtype))
    if NORM:
        return gl.rsqrt(ss / HIDDEN + EPS)
    else:
        return ss + 1.0


@gluon.constexpr_function
def _stage_rstd_layout(NW):
    """The layout of ``_stage_rows``' [NPAD] rstd."""
    return gl.SliceLayout(0, gl.SliceLayout(2, _stage_layout(NW)))


@gluon.jit
def _rope(base, cs_ptr, d):
    """``base[d]`` rotated (rotate-half pairs (d, d + D/2)) by the position's cos/sin row (``base``
    and ``d`` broadcast: rows of heads at once)."""
    partner = (d + D // 2) % D
    sign = gl.where(d < D // 2, -1.0, 1.0)
    return gl.load(base + d, cache_modifier=".cg") * gl.load(cs_ptr + d) + sign * gl.load(
        base + partner, cache_modifier=".cg"
    ) * gl.load(cs_ptr + D + d)


@gluon.jit
def _new_kv(act, kc_ptr, vc_ptr, cs_ptr, layer, kvh, ctx, maxctx, last, d):
    """KV head ``kvh``'s new k (RoPE'd) and v at dims ``d``; the head's last split (``last``) writes
    them into the cache at position ``ctx`` (this step attends to them from registers)."""
    kn = _rope(act + QH * D + kvh * D, cs_ptr, d)
    vn = gl.load(act + (QH + KVH) * D + kvh * D + d, cache_modifier=".cg")
    if last:
        head = (layer * KVH + kvh).to(gl.int64) * maxctx * D + ctx * D
        gl.store(kc_ptr + head + d, kn.to(gl.bfloat16))
        gl.store(vc_ptr + head + d, vn.to(gl.bfloat16))
    return kn, vn


@gluon.jit
def _attend(act, kc_ptr, vc_ptr, cs_ptr, part_ptr, hctr_ptr, ctr_ptr, layer, epoch, pid, ctx, maxctx,
            NSPLIT: gl.constexpr, NW: gl.constexpr):  # fmt: skip
    """This program's attention task: KV head ``pid // NSPLIT``, split ``pid % NSPLIT`` of the cached
    context (the last split also writes and attends to the new position), its G query heads one
    after another; the partials are stored and the last split of the head to arrive merges them in
    split order into the attention output, then counts the head (release)."""
    kv_lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    dcol: gl.constexpr = gl.SliceLayout(0, kv_lay)
    prow: gl.constexpr = gl.SliceLayout(1, kv_lay)
    kvh, sp, start, end = _kv_span(pid, ctx, NSPLIT)
    d = gl.arange(0, D, layout=dcol)
    pp = gl.arange(0, BLK, layout=prow)
    head_k = kc_ptr + (layer * KVH + kvh).to(gl.int64) * maxctx * D
    head_v = vc_ptr + (layer * KVH + kvh).to(gl.int64) * maxctx * D
    last = sp == NSPLIT - 1
    kn, vn = _new_kv(act, kc_ptr, vc_ptr, cs_ptr, layer, kvh, ctx, maxctx, last, d)
    for h in gl.static_range(G):
        q = _rope(act + (kvh * G + h) * D, cs_ptr, d) * SCALE
        s_new = gl.sum(kn * q, axis=0)
        m = gl.where(last, s_new, -1e30)
        lsum = gl.where(last, 1.0, 0.0)
        o = gl.where(last, vn, 0.0)
        for b in range(start, end, BLK):
            p = b + pp
            ok = p < end
            kt = gl.load(head_k + p[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(gl.float32)
            sc = gl.where(ok, gl.sum(kt * q[None, :], axis=1), -1e30)
            m2 = gl.maximum(m, gl.max(sc, axis=0))
            e = gl.exp(sc - m2)
            alpha = gl.exp(m - m2)
            vt = gl.load(head_v + p[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(gl.float32)
            o = o * alpha + gl.sum(vt * e[:, None], axis=0)
            lsum = lsum * alpha + gl.sum(e, axis=0)
            m = m2
        slot = part_ptr + ((kvh * NSPLIT + sp) * G + h) * (D + 2)
        gl.store(slot + d, o)
        gl.store(slot + D, m)
        gl.store(slot + D + 1, lsum)
    gl.thread_barrier()
    old = gl.atomic_add(hctr_ptr + layer * KVH + kvh, 1, sem="acq_rel", scope="gpu")
    if old == epoch * NSPLIT - 1:  # the head's last split: merge its partials in split order
        ss = gl.arange(0, NSPLIT, layout=prow)
        for h in gl.static_range(G):
            rows = part_ptr + ((kvh * NSPLIT + ss) * G + h) * (D + 2)
            ms = gl.load(rows + D, cache_modifier=".cg")
            w = gl.exp(ms - gl.max(ms, axis=0))
            total = gl.sum(w * gl.load(rows + D + 1, cache_modifier=".cg"), axis=0)
            os = gl.load(rows[:, None] + d[None, :], cache_modifier=".cg")
            gl.store(act + A_ATT + (kvh * G + h) * D + d, gl.sum(os * w[:, None], axis=0) / total)
        gl.thread_barrier()
        gl.atomic_add(ctr_ptr + layer * NCTR + 1, 1, sem="release", scope="gpu")


@gluon.jit
def _merge_splits(act, part_ptr, hctr, done, epoch, kvh, NSPLIT: gl.constexpr, NW: gl.constexpr):
    """Count this split's partials of KV head ``kvh`` (stored by the caller) on the head's counter
    ``hctr``; the head's last split to arrive merges the group's partials in split order ([NSPLIT,
    G, D], one pass) into the attention output and counts the head on ``done`` (release)."""
    gl.thread_barrier()
    old = gl.atomic_add(hctr, 1, sem="acq_rel", scope="gpu")
    if old == epoch * NSPLIT - 1:  # the head's last split: merge the group's partials in split order
        # [NSPLIT, G, D], the splits in registers: the sums over them need no shared memory
        lm: gl.constexpr = gl.BlockedLayout([NSPLIT, 1, 1], [1, G, 32 // G], [1, 1, NW], [2, 1, 0])
        w2: gl.constexpr = gl.SliceLayout(2, lm)  # [NSPLIT, G]
        o2: gl.constexpr = gl.SliceLayout(0, lm)  # [G, D]
        ss = gl.arange(0, NSPLIT, layout=gl.SliceLayout(1, w2))
        gw = gl.arange(0, G, layout=gl.SliceLayout(0, w2))
        rows = part_ptr + ((kvh * NSPLIT + ss[:, None]) * G + gw[None, :]) * (D + 2)  # [NSPLIT, G]
        ms = gl.load(rows + D, cache_modifier=".cg")
        w = gl.exp(ms - gl.max(ms, axis=0)[None, :])
        total = gl.sum(w * gl.load(rows + D + 1, cache_modifier=".cg"), axis=0)
        d3 = gl.arange(0, D, layout=gl.SliceLayout(0, o2))
        os = gl.load(rows[:, :, None] + gl.expand_dims(d3[None, :], 0), cache_modifier=".cg")
        att = gl.sum(os * w[:, :, None], axis=0) / gl.convert_layout(total, gl.SliceLayout(1, o2))[:, None]
        go = gl.arange(0, G, layout=gl.SliceLayout(1, o2))
        gl.store(act + A_ATT + (kvh * G + go)[:, None] * D + d3[None, :], att)
        gl.thread_barrier()
        gl.atomic_add(done, 1, sem="release", scope="gpu")


@gluon.jit
def _attend_mma(act, kc_ptr, vc_ptr, cs_ptr, part_ptr, layer, pid, ctx, maxctx, kt, vt, kvs, NSPLIT: gl.constexpr,
                NW: gl.constexpr, KVS: gl.constexpr):  # fmt: skip
    """``_attend_warps`` on tensor cores: each warp its own 16 positions a step as a batch of
    ``mma.sync`` products (the group's G query heads padded to 16 rows, q and P in bf16 as flash
    kernels keep them): S = Q·Kᵀ [16, 16], the online softmax over the warp's positions, O += P·V
    [16, D]; one cross-warp merge at the end. ``KVS`` 0: ``kt``/``vt`` hold the first [NW, 16, D]
    tile (issued by the caller) and the next tile's loads are in flight in registers while one is
    multiplied; ``KVS`` >= 2: the tiles stream through ``kvs``, a ring of ``KVS`` shared-memory
    slots filled by ``cp.async`` (``KVS`` - 1 tiles in flight, no registers held for them), and the
    operands load from it (``kt``/``vt`` unused)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)  # k_width: bf16 elements per 32 bits
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    bl: gl.constexpr = _tile_layout(NW)
    r2: gl.constexpr = gl.SliceLayout(2, mma)  # [NW, 16] row statistics
    kvh, sp, start, end = _kv_span(pid, ctx, NSPLIT)
    last = sp == NSPLIT - 1
    w3 = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, bl))), 1), 2)
    r3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, bl))), 0), 2)
    d1 = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, bl)))
    d3 = gl.expand_dims(d1[None, :], 1)
    # every warp its copy of q ([NW, 16, D]: rows past the group's G heads are zero)
    qf = gl.where(r3 < G, _rope(act + (kvh * G + r3 + 0 * w3) * D, cs_ptr, d3), 0.0) * SCALE
    if KVS > 0:  # into the operand layout through the ring's last slot (first filled in step 0)
        kvs.index(2 * (KVS - 1)).store(qf.to(gl.bfloat16))
        gl.thread_barrier()
        qa = kvs.index(2 * (KVS - 1)).load(a_l)
    else:
        qa = gl.convert_layout(qf.to(gl.bfloat16), a_l)
    kn, vn = _new_kv(act, kc_ptr, vc_ptr, cs_ptr, layer, kvh, ctx, maxctx, last, d1)
    s_new = gl.convert_layout(
        gl.max(gl.sum(qf * gl.expand_dims(kn[None, :], 1), axis=2), axis=0), gl.SliceLayout(0, r2)
    )
    wm = gl.expand_dims(gl.expand_dims(gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(1, mma))), 1), 1)
    pm = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))[None, :], 1)
    m = gl.full([NW, 16], -1e30, gl.float32, r2)
    lsum = gl.zeros([NW, 16], gl.float32, r2)
    o = gl.zeros([NW, 16, D], gl.float32, mma)
    if KVS > 0:
        for t in gl.static_range(KVS - 1):
            _kv_copy(kvs, t, kc_ptr, vc_ptr, layer, kvh, start + t * NW * 16, end, maxctx, NW)
    i = 0
    for b in range(start, end, NW * 16):
        if KVS > 0:
            async_copy.wait_group(KVS - 2)  # tile i has landed
            gl.thread_barrier()  # ... for every thread, and every thread is past the slot refilled next
            _kv_copy(kvs, (i + KVS - 1) % KVS, kc_ptr, vc_ptr, layer, kvh, b + (KVS - 1) * NW * 16, end, maxctx, NW)
            kb = kvs.index(2 * (i % KVS)).permute([0, 2, 1]).load(b_l)
            vb = kvs.index(2 * (i % KVS) + 1).load(b_l)
        else:
            kn_t, vn_t = _kv_tiles(kc_ptr, vc_ptr, layer, kvh, b + NW * 16, end, maxctx, NW, 16, True)
            kb = gl.convert_layout(gl.permute(kt, [0, 2, 1]), b_l)
            vb = gl.convert_layout(vt, b_l)
        sc = mma_v2(qa, kb, gl.zeros([NW, 16, 16], gl.float32, mma))
        ok = b + wm * 16 + pm < end
        sc = gl.where(ok, sc, -1e30)
        m2 = gl.maximum(m, gl.max(sc, axis=2))
        e = gl.where(ok, gl.exp(sc - m2[:, :, None]), 0.0)
        alpha = gl.exp(m - m2)
        lsum = lsum * alpha + gl.sum(e, axis=2)
        o = mma_v2(gl.convert_layout(e.to(gl.bfloat16), a_l), vb, o * alpha[:, :, None])
        m = m2
        if KVS == 0:
            kt, vt = kn_t, vn_t
        i += 1
    if KVS > 0:
        async_copy.wait_group(0)  # the tail's zero-byte groups: the weight ring counts its own again
    # the warps' partials merged, then the new position (last split); rows past G are not stored
    mw = gl.max(m, axis=0)  # [16]
    mt = gl.where(last, gl.maximum(mw, s_new), mw)
    wgt = gl.exp(m - mt[None, :])
    e_new = gl.where(last, gl.exp(s_new - mt), 0.0)
    lt = gl.sum(lsum * wgt, axis=0) + e_new
    if KVS > 0:  # the warps' sum through the drained K/V ring (a reduction's own 32 KiB would not fit)
        gl.thread_barrier()
        red = kvs._reinterpret(gl.float32, [NW, 16, D], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        red.store(o * wgt[:, :, None])
        gl.thread_barrier()
        red_l: gl.constexpr = gl.BlockedLayout([NW, 1, 4], [1, 2, 16], [1, NW, 1], [2, 1, 0])  # warps in registers
        ot = gl.sum(red.load(red_l), axis=0)
    else:
        ot = gl.sum(o * wgt[:, :, None], axis=0)
    ol: gl.constexpr = ot.type.layout
    ro = gl.arange(0, 16, layout=gl.SliceLayout(1, ol))
    do = gl.arange(0, D, layout=gl.SliceLayout(0, ol))
    ot = (
        ot
        + gl.convert_layout(e_new, gl.SliceLayout(1, ol))[:, None]
        * gl.convert_layout(vn, gl.SliceLayout(0, ol))[None, :]
    )
    slot = part_ptr + ((kvh * NSPLIT + sp) * G + ro) * (D + 2)
    gl.store(slot[:, None] + do[None, :], ot, mask=(ro < G)[:, None])
    gs = gl.arange(0, 16, layout=gl.SliceLayout(0, r2))
    sslot = part_ptr + ((kvh * NSPLIT + sp) * G + gs) * (D + 2)
    gl.store(sslot + D, mt, mask=gs < G)
    gl.store(sslot + D + 1, lt, mask=gs < G)


@gluon.jit
def _stage_merged(xbuf, part_ptr, NSPLIT: gl.constexpr, NW: gl.constexpr):
    """o_proj's input staged straight from the attention partials: every program merges all heads'
    NSPLIT partials in split order (the same sums as ``_merge_splits``), one [NSPLIT, 16 heads, D]
    block per 1024-column chunk, instead of waiting for a merge by the last split of each head."""
    HC: gl.constexpr = BK // D  # heads a chunk holds
    l3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 2, 16], [1, NW, 1], [2, 1, 0])  # [NSPLIT, HC, D]
    w2: gl.constexpr = gl.SliceLayout(2, l3)  # [NSPLIT, HC]
    o2: gl.constexpr = gl.SliceLayout(0, l3)  # [HC, D]
    ss = gl.arange(0, NSPLIT, layout=gl.SliceLayout(1, w2))
    hh = gl.arange(0, HC, layout=gl.SliceLayout(0, w2))
    d3 = gl.arange(0, D, layout=gl.SliceLayout(0, o2))
    for c in gl.static_range(HIDDEN // BK):
        h = c * HC + hh  # query head
        rows = part_ptr + (((h // G)[None, :] * NSPLIT + ss[:, None]) * G + (h % G)[None, :]) * (D + 2)
        ms = gl.load(rows + D, cache_modifier=".cg")
        w = gl.exp(ms - gl.max(ms, axis=0)[None, :])
        total = gl.sum(w * gl.load(rows + D + 1, cache_modifier=".cg"), axis=0)
        os = gl.load(rows[:, :, None] + gl.expand_dims(d3[None, :], 0), cache_modifier=".cg")
        att = gl.sum(os * w[:, :, None], axis=0) / gl.convert_layout(total, gl.SliceLayout(1, o2))[:, None]
        xbuf.index(c).reshape([HC, D]).store(att.to(xbuf.dtype))


@gluon.jit
def _attend_grouped(act, kc_ptr, vc_ptr, cs_ptr, part_ptr, layer, pid, ctx, maxctx, NSPLIT: gl.constexpr,
                    NW: gl.constexpr):  # fmt: skip
    """``_attend`` with the group's G query heads together: each K/V block is read once for all of
    them (a [G, BLK, D] product), the next block's loads are in flight while this one is scored,
    and the caller's ``_merge_splits`` merges all G heads in one pass ([NSPLIT, G, D])."""
    l3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, NW, 1], [2, 1, 0])  # [G, BLK, D]
    kv2: gl.constexpr = gl.SliceLayout(0, l3)  # [BLK, D]
    q2: gl.constexpr = gl.SliceLayout(1, l3)  # [G, D]
    s2: gl.constexpr = gl.SliceLayout(2, l3)  # [G, BLK]
    kvh, sp, start, end = _kv_span(pid, ctx, NSPLIT)
    head_k = kc_ptr + (layer * KVH + kvh).to(gl.int64) * maxctx * D
    head_v = vc_ptr + (layer * KVH + kvh).to(gl.int64) * maxctx * D
    pk = gl.arange(0, BLK, layout=gl.SliceLayout(1, kv2))
    dk = gl.arange(0, D, layout=gl.SliceLayout(0, kv2))
    ps = gl.arange(0, BLK, layout=gl.SliceLayout(0, s2))
    gq = gl.arange(0, G, layout=gl.SliceLayout(1, q2))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, q2))
    # the first block's loads go out before q, k and v are read and rotated
    ok = start + pk < end
    kt = gl.load(head_k + (start + pk)[:, None] * D + dk[None, :], mask=ok[:, None], other=0.0)
    vt = gl.load(head_v + (start + pk)[:, None] * D + dk[None, :], mask=ok[:, None], other=0.0)
    last = sp == NSPLIT - 1
    q = _rope(act + (kvh * G + gq)[:, None] * D, cs_ptr, dq[None, :]) * SCALE
    kn, vn = _new_kv(act, kc_ptr, vc_ptr, cs_ptr, layer, kvh, ctx, maxctx, last, dq)
    s_new = gl.convert_layout(gl.sum(q * kn[None, :], axis=1), gl.SliceLayout(1, s2))
    m = gl.where(last, s_new, -1e30)
    lsum = gl.where(last, 1.0, 0.0) + 0.0 * s_new
    o = gl.where(last, 1.0, 0.0) * (vn[None, :] + 0.0 * q)
    for b in range(start, end, BLK):
        nb = b + BLK + pk  # the next block's loads, in flight while this one is scored
        nok = nb < end
        kn_t = gl.load(head_k + nb[:, None] * D + dk[None, :], mask=nok[:, None], other=0.0)
        vn_t = gl.load(head_v + nb[:, None] * D + dk[None, :], mask=nok[:, None], other=0.0)
        sc = gl.sum(q[:, None, :] * kt.to(gl.float32)[None, :, :], axis=2)
        sc = gl.where((b + ps < end)[None, :], sc, -1e30)
        m2 = gl.maximum(m, gl.max(sc, axis=1))
        e = gl.exp(sc - m2[:, None])
        alpha = gl.exp(m - m2)
        pv = gl.sum(e[:, :, None] * vt.to(gl.float32)[None, :, :], axis=1)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, q2))[:, None] + pv
        lsum = lsum * alpha + gl.sum(e, axis=1)
        m = m2
        kt = kn_t
        vt = vn_t
    slot = part_ptr + ((kvh * NSPLIT + sp) * G + gq) * (D + 2)
    gl.store(slot[:, None] + dq[None, :], o)
    gm = gl.arange(0, G, layout=gl.SliceLayout(1, s2))
    sslot = part_ptr + ((kvh * NSPLIT + sp) * G + gm) * (D + 2)
    gl.store(sslot + D, m)
    gl.store(sslot + D + 1, lsum)


@gluon.jit
def _kv_tiles(kc_ptr, vc_ptr, layer, kvh, b, end, maxctx, NW: gl.constexpr, P: gl.constexpr, MMA: gl.constexpr):
    """Issue the loads of K and V at positions ``b + w * P + p`` (< ``end``) for warp ``w``: [NW, P, D]
    tiles in ``_attend_warps``' layout, or (``MMA``) in 16-byte rows for ``_attend_mma`` to convert
    (consumed later: the loads are in flight meanwhile)."""
    if MMA:
        t3: gl.constexpr = _tile_layout(NW)
    else:
        t3: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 1, 1, 4], [1, 1, 2, 16], [NW, 1, 1, 1], [3, 2, 1, 0]))
    off, ok = _kv_offsets(layer, kvh, b, end, maxctx, NW, P, t3)
    return gl.load(kc_ptr + off, mask=ok, other=0.0), gl.load(vc_ptr + off, mask=ok, other=0.0)


@gluon.jit
def _kv_offsets(layer, kvh, b, end, maxctx, NW: gl.constexpr, P: gl.constexpr, t3: gl.constexpr):
    """Cache offsets [NW, P, D] (layout ``t3``) of positions ``b + w * P + p`` for warp ``w``, and
    which are below ``end`` (broadcast over D)."""
    w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, t3)))
    p = gl.arange(0, P, layout=gl.SliceLayout(0, gl.SliceLayout(2, t3)))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, t3)))
    pos = b + w[:, None] * P + p[None, :]  # [NW, P]
    d3 = gl.expand_dims(d[None, :], 1)
    off = (layer * KVH + kvh).to(gl.int64) * maxctx * D + pos[:, :, None] * D + d3
    return off, (pos[:, :, None] < end) & (d3 >= 0)


@gluon.jit
def _kv_copy(kvs, slot, kc_ptr, vc_ptr, layer, kvh, b, end, maxctx, NW: gl.constexpr):
    """Start copying the [NW, 16, D] K and V tiles at ``b`` into ``kvs`` slot ``slot`` (one commit
    group; positions from ``end`` on are zero-filled)."""
    off, ok = _kv_offsets(layer, kvh, b, end, maxctx, NW, 16, _tile_layout(NW))
    async_copy.async_copy_global_to_shared(kvs.index(2 * slot), kc_ptr + off, mask=ok)
    async_copy.async_copy_global_to_shared(kvs.index(2 * slot + 1), vc_ptr + off, mask=ok)
    async_copy.commit_group()


@gluon.jit
def _kv_span(pid, ctx, NSPLIT: gl.constexpr):
    """This program's attention task: (KV head, split, first position, end) of the cached context."""
    sp = pid % NSPLIT
    span = ((ctx + NSPLIT - 1) // NSPLIT + BLK - 1) // BLK * BLK
    return pid // NSPLIT, sp, sp * span, gl.minimum(sp * span + span, ctx)


@gluon.jit
def _attend_warps(act, kc_ptr, vc_ptr, cs_ptr, part_ptr, layer, pid, ctx, maxctx, kt, vt, NSPLIT: gl.constexpr,
                  NW: gl.constexpr, P: gl.constexpr, DEPTH: gl.constexpr):  # fmt: skip
    """``_attend_grouped`` with each warp running its own online softmax over its own positions (a
    [NW, G, P, D] tile: every reduction stays inside a warp, every warp's loads are in flight at
    once) and one cross-warp merge at the end. ``kt``/``vt``: the first tile's K/V, issued by the
    caller before q, k and v were ready (the cached context does not depend on them); the next
    ``DEPTH`` (1 or 2) tiles' loads are in flight while one is scored."""
    l4: gl.constexpr = gl.BlockedLayout([1, 1, 1, 4], [1, 1, 2, 16], [NW, 1, 1, 1], [3, 2, 1, 0])  # [NW, G, P, D]
    s3: gl.constexpr = gl.SliceLayout(3, l4)  # [NW, G, P] scores
    o3: gl.constexpr = gl.SliceLayout(2, l4)  # [NW, G, D] per-warp outputs
    q2: gl.constexpr = gl.SliceLayout(0, o3)  # [G, D]
    kvh, sp, start, end = _kv_span(pid, ctx, NSPLIT)
    k1, v1 = _kv_tiles(kc_ptr, vc_ptr, layer, kvh, start + NW * P, gl.where(DEPTH == 2, end, 0), maxctx, NW, P, False)
    gq = gl.arange(0, G, layout=gl.SliceLayout(1, q2))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, q2))
    last = sp == NSPLIT - 1
    q = _rope(act + (kvh * G + gq)[:, None] * D, cs_ptr, dq[None, :]) * SCALE
    kn, vn = _new_kv(act, kc_ptr, vc_ptr, cs_ptr, layer, kvh, ctx, maxctx, last, dq)
    q4 = gl.expand_dims(gl.expand_dims(q, 0), 2)  # [1, G, 1, D]
    wp = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(1, s3)))
    pp = gl.arange(0, P, layout=gl.SliceLayout(0, gl.SliceLayout(1, s3)))
    rel = gl.expand_dims(wp[:, None] * P + pp[None, :], 1)  # [NW, 1, P]: a position's offset in the tile
    m = gl.full([NW, G], -1e30, gl.float32, gl.SliceLayout(2, s3))
    lsum = gl.zeros([NW, G], gl.float32, gl.SliceLayout(2, s3))
    o = gl.zeros([NW, G, D], gl.float32, o3)
    for b in range(start, end, NW * P):
        kn_t, vn_t = _kv_tiles(kc_ptr, vc_ptr, layer, kvh, b + DEPTH * NW * P, end, maxctx, NW, P, False)
        ok = b + rel < end
        sc = gl.where(ok, gl.sum(q4 * gl.expand_dims(kt, 1).to(gl.float32), axis=3), -1e30)
        m2 = gl.maximum(m, gl.max(sc, axis=2))
        e = gl.where(ok, gl.exp(sc - m2[:, :, None]), 0.0)
        alpha = gl.exp(m - m2)
        pv = gl.sum(gl.expand_dims(e, 3) * gl.expand_dims(vt, 1).to(gl.float32), axis=2)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(2, o3))[:, :, None] + pv
        lsum = lsum * alpha + gl.sum(e, axis=2)
        m = m2
        if DEPTH == 2:
            kt, vt, k1, v1 = k1, v1, kn_t, vn_t
        else:
            kt, vt = kn_t, vn_t
    # the warps' partials merged (the only cross-warp step), then the new position (last split)
    mw = gl.max(m, axis=0)  # [G]
    s_new = gl.convert_layout(gl.sum(q * kn[None, :], axis=1), mw.type.layout)
    mt = gl.where(last, gl.maximum(mw, s_new), mw)
    wgt = gl.exp(m - mt[None, :])
    e_new = gl.where(last, gl.exp(s_new - mt), 0.0)
    lt = gl.sum(lsum * wgt, axis=0) + e_new
    ot = gl.sum(o * gl.convert_layout(wgt, gl.SliceLayout(2, o3))[:, :, None], axis=0)
    ot = ot + gl.convert_layout(e_new, gl.SliceLayout(1, q2))[:, None] * vn[None, :]
    slot = part_ptr + ((kvh * NSPLIT + sp) * G + gq) * (D + 2)
    gl.store(slot[:, None] + dq[None, :], ot)
    gs = gl.arange(0, G, layout=mt.type.layout)
    sslot = part_ptr + ((kvh * NSPLIT + sp) * G + gs) * (D + 2)
    gl.store(sslot + D, mt)
    gl.store(sslot + D + 1, lt)


@gluon.jit
def _wait_for(ctr_ptr, target, POLL: gl.constexpr):
    """Wait until the counter reaches ``target`` (acquire). ``POLL`` 0: ``loader_probe``'s polls,
    atomic read-modify-writes of the counter's line (the waiters' polls queue with the producers'
    increments at L2); 1: ``ld.acquire.gpu`` loads (plain reads, each with acquire ordering)."""
    if POLL == 1:
        seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ctr_ptr], dtype=gl.int32,
                                         is_pure=False, pack=1)  # fmt: skip
        while seen < target:
            seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ctr_ptr], dtype=gl.int32,
                                             is_pure=False, pack=1)  # fmt: skip
    else:
        _wait(ctr_ptr, target)


@gluon.jit
def _stamp(ts_ptr, layer, pid, ev, NPROG: gl.constexpr, PROF: gl.constexpr):
    """Event ``ev`` of ``layer`` on this program: ``%globaltimer`` ns (only when ``PROF``)."""
    if PROF:
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(ts_ptr + (layer * NPROG + pid) * NEV + ev, t)


@gluon.jit
def _store_row(y, rstd, gbuf, act, h_in, s, rows, tile, GU: gl.constexpr, hl: gl.constexpr):
    """Batch 1: stage ``s``'s task result ``y`` (the tile's ROWS sums) into the activations: QKV
    times rstd; o_proj plus the residual; gate/up times rstd (``GU`` 1: the tile's 8 gate then 8
    up rows -> 8 SiLU(g)·u, through ``gbuf``); down plus the residual."""
    if s == 0:
        gl.store(act + rows, y * rstd)
    elif s == 1:
        gl.store(act + A_H1 + rows, y + gl.load(h_in + rows, cache_modifier=".cg"))
    elif s == 2:
        if GU == 1:
            gbuf.store(y * rstd)
            gl.thread_barrier()
            gv = gbuf.slice(0, ROWS // 2).load(hl)
            uv = gbuf.slice(ROWS // 2, ROWS // 2).load(hl)
            hh = gl.arange(0, ROWS // 2, layout=hl)
            gl.store(act + A_GU + tile * (ROWS // 2) + hh, gv / (1.0 + gl.exp(-gv)) * uv)
        else:
            gl.store(act + A_GU + rows, y * rstd)
    else:
        gl.store(act + A_H2 + rows, y + gl.load(act + A_H1 + rows, cache_modifier=".cg"))


@gluon.jit
def _store_rows(y, rstd, gbuf, act, h_in, hs, s, tile, tiles, NB: gl.constexpr, NW: gl.constexpr):
    """``_store_row`` for ``MMAV`` 1's [ROWS, NPAD] result: column b is row b's (rows ``LAYER_A``
    apart in ``act``, ``hs`` apart in ``h_in``; columns from ``NB`` on are padding). Gate/up's
    rows as ``GU`` 1 has them."""
    yl: gl.constexpr = y.type.layout
    yr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, yl))
    yb = gl.arange(0, NPAD, layout=gl.SliceLayout(0, yl))
    rows = tile * ROWS + yr[:, None]
    ok = (yb[None, :] < NB) & (tile < tiles) & (rows >= 0)
    a = act + yb[None, :] * LAYER_A
    rs = gl.convert_layout(rstd, gl.SliceLayout(0, yl))[None, :]
    if s == 0:
        gl.store(a + rows, y * rs, mask=ok)
    elif s == 1:
        gl.store(a + A_H1 + rows, y + gl.load(h_in + yb[None, :] * hs + rows, mask=ok, cache_modifier=".cg"), mask=ok)
    elif s == 2:  # the tile's 8 gate rows, then their 8 up rows -> 8 SiLU(g)·u a row
        gbuf.store(y * rs)
        gl.thread_barrier()
        hl: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [2, NW // 2], [1, 0])  # [ROWS // 2, NPAD]
        gv = gbuf.slice(0, ROWS // 2).load(hl)
        uv = gbuf.slice(ROWS // 2, ROWS // 2).load(hl)
        hh = gl.arange(0, ROWS // 2, layout=gl.SliceLayout(1, hl))[:, None]
        hb = gl.arange(0, NPAD, layout=gl.SliceLayout(0, hl))[None, :]
        gl.store(act + hb * LAYER_A + A_GU + tile * (ROWS // 2) + hh, gv / (1.0 + gl.exp(-gv)) * uv,
                 mask=(hb < NB) & (tile < tiles) & (hh >= 0))  # fmt: skip
    else:
        gl.store(a + A_H2 + rows, y + gl.load(a + A_H1 + rows, mask=ok, cache_modifier=".cg"), mask=ok)


@gluon.jit
def step_chain(w_ptr, wh_desc, wi_desc, gin_ptr, gpost_ptr, x_ptr, act_ptr, kc_ptr, vc_ptr, cs_ptr, part_ptr, ctr_ptr,
               hctr_ptr, epoch_ptr, ts_ptr, ctx, maxctx, L: gl.constexpr, NPROG: gl.constexpr, NBUF: gl.constexpr,
               T0: gl.constexpr, TO: gl.constexpr, T1: gl.constexpr, TD: gl.constexpr, NSPLIT: gl.constexpr, ATT: gl.constexpr, ROT: gl.constexpr,
               POLL: gl.constexpr, EARLY: gl.constexpr, GU: gl.constexpr, DEPTH: gl.constexpr,
               MERGE: gl.constexpr, PW: gl.constexpr, KVS: gl.constexpr, LAY: gl.constexpr, XBF: gl.constexpr,
               TMA: gl.constexpr, NB: gl.constexpr, MMAV: gl.constexpr, PF: gl.constexpr, PROF: gl.constexpr,
               NW: gl.constexpr = 8):  # fmt: skip
    """One decode step of ``NB`` rows through ``L`` layers of ``MODEL``, one program per SM; each weight stage
    ``T0`` (QKV), ``TO`` (o_proj), ``T1`` (gate/up) and ``TD`` (down) 16-row tiles a program. ``x_ptr``:
    the step's residual input (fp32 [NB, HIDDEN]); ``act_ptr``: fp32 [L, NB, LAYER_A];
    ``kc_ptr``/``vc_ptr``: bf16 [L, NB, KVH, maxctx, D], each row holding ``ctx`` positions (the
    step writes position ``ctx``); ``cs_ptr``: fp32 [2, D] cos, sin at ``ctx``; ``part_ptr``: fp32
    [NB, KVH, NSPLIT, G, D + 2]; counters int32 [L, NCTR] and [L, NB, KVH]; ``epoch_ptr``: the launch
    counter (targets never reset). The attention tasks: one per row, KV head and split.
    ``ATT``: 0 ``_attend``, 1 ``_attend_grouped``, 2 ``_attend_warps``, 3 ``_attend_mma`` (``PW`` 16),
    4 the same through a shared-memory K/V ring; ``ROT``: see ``_chunk``;
    ``POLL``: see ``_wait_for``; ``EARLY``: a chunk's refill issued before its arithmetic (one CTA
    barrier a chunk, one more chunk in flight during it) instead of after; ``GU``: 1 when gate/up's
    rows come in tiles of 8 gate rows then their 8 up rows (``interleave_gate_up``), so each task
    stores SiLU(g)·u and down stages half the bytes without the SiLU; ``DEPTH``: K/V tiles in flight
    in ``_attend_warps``; ``MERGE``: 0 the last split of a head merges it, 1 o_proj's programs merge
    every head as they stage their input (``_stage_merged``); ``PW``: positions a warp scores per
    step of ``_attend_warps``; ``KVS``: ``_attend_mma``'s K/V ring slots (``ATT`` 4); ``LAY``: the
    GEMV arithmetic's layout (1: a thread holds all 16 rows of 4 columns); ``XBF``: the staged input
    in bf16; ``TMA``: the weight ring filled by TMA from ``wh_desc``/``wi_desc`` (``weight_descriptors``)
    instead of cp.async from ``w_ptr``; ``MMAV``: the GEMV on tensor cores (each warp's 128 columns of
    a chunk as ``mma.sync`` W[16, 128] @ X[128, NPAD], the warps' products summed at the task's end;
    ``NB`` above 1 needs it); ``PF``: the chunks after the ring's window asked of L2 (``_prefetch_l2``)
    as a program enters the QKV wait and the attention, so the weight stream runs on through them
    (per refill instead, run 102 measured it 4-6 µs a layer slower); ``PROF``: stamp ``EVENTS`` into ``ts_ptr`` (int64 [L, NPROG, NEV]).
    The last layer's output residuals are ``act[L - 1, :, A_H2:]``."""
    cp_lay: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NW, 1], [1, 0])  # the copies: 16 bytes a thread
    if LAY == 1:  # the arithmetic: every row of 4 columns a thread (each staged input read once a chunk)
        lay: gl.constexpr = gl.BlockedLayout([ROWS, 4], [1, 32], [1, NW], [1, 0])
    else:  # two rows a warp, each warp reading the whole staged chunk
        lay: gl.constexpr = cp_lay
    col: gl.constexpr = gl.SliceLayout(0, lay)
    row: gl.constexpr = gl.SliceLayout(1, lay)
    KW: gl.constexpr = BK // NW  # ``MMAV``: a warp's column block of a chunk
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)  # k_width: bf16 elements per 32 bits
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    mma_sw: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [2, 1, 0])  # 16-byte columns XOR row: ldmatrix's rows
    pid = gl.program_id(0)
    target = _epoch_target(epoch_ptr, NPROG)
    epoch = target // NPROG
    C0: gl.constexpr = T0 * (HIDDEN // BK)
    C1: gl.constexpr = TO * (HIDDEN // BK)
    C2: gl.constexpr = T1 * (HIDDEN // BK)
    C: gl.constexpr = C0 + C1 + C2 + TD * (INTER // BK)
    total = L * C
    ring_lay: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 1, [1, 0])
    if TMA:  # the slots as TMA writes them ([16, 4, 256] boxes), read as the same bytes' [16, 1024] rows
        boxes = gl.allocate_shared_memory(gl.bfloat16, [NBUF, ROWS, BK // TB, TB], wh_desc.layout)
        ring = boxes._reinterpret(gl.bfloat16, [NBUF, ROWS, BK], ring_lay)
        bars = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(NBUF):
            mbarrier.init(bars.index(b), count=1)
        fence_async_shared()
    elif MMAV:  # a slot as [NW column blocks, ROWS, KW]: warp w's A operand is block w
        ring = gl.allocate_shared_memory(gl.bfloat16, [NBUF, NW, ROWS, KW], mma_sw)
        boxes = ring
        bars = ring
    else:
        ring = gl.allocate_shared_memory(gl.bfloat16, [NBUF, ROWS, BK], ring_lay)
        boxes = ring
        bars = ring
    if MMAV:  # the staged input as the X operand, [chunks, NW column blocks, NPAD rows, KW] (bf16)
        xbuf = gl.allocate_shared_memory(gl.bfloat16, [XMAX, NW, NPAD, KW], mma_sw)
        # a task's products summed over the warps through the first chunk: stages of K = HIDDEN
        # stage into the last chunks, and down (all chunks) has one task a program
        red = xbuf._reinterpret(gl.float32, [NW, ROWS, NPAD], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        gbuf = gl.allocate_shared_memory(gl.float32, [ROWS, NPAD], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    elif XBF:  # the staged stage input in bf16 (as the kernels' mailbox holds it): half its loads
        # with ATT 4 as long as the K/V ring too, which it holds from QKV's end to o_proj's staging
        # (8B's 128-wide heads: 128 KiB of ring beside 28 KiB of input would not fit)
        XR: gl.constexpr = XMAX if ATT != 4 else max(XMAX, 2 * KVS * NW * 16 * D // BK)
        xbuf = gl.allocate_shared_memory(gl.bfloat16, [XR, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        xbuf = gl.allocate_shared_memory(gl.float32, [XMAX, BK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if not MMAV:
        gbuf = gl.allocate_shared_memory(gl.float32, [ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # GU's row pairs
        red = gbuf
    if ATT == 4:  # the attention task's K/V ring: KVS slots of a [NW, 16, D] K tile and its V tile
        if MMAV or XBF:  # in the staged input's first chunks (dead from QKV's end to o_proj's staging)
            kvs = xbuf._reinterpret(gl.bfloat16, [2 * KVS, NW, 16, D], mma_sw)
        else:
            kvs = gl.allocate_shared_memory(gl.bfloat16, [2 * KVS, NW, 16, D], mma_sw)
    else:
        kvs = ring
    hl: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    if MMAV:  # each element's row and column in a chunk, as [NW column blocks, ROWS, KW]
        cp3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [NW, 1, 1], [2, 1, 0])
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
        _refill(ring, boxes, bars, w_ptr, wh_desc, wi_desc, i, total, pid, rr, cc, C, C0, C1, C2, NPROG, NBUF, ROT, TMA)
    if MMAV:
        acc = gl.zeros([NW, ROWS, NPAD], gl.float32, mma)
        rstd = gl.full([NPAD], 1.0, gl.float32, _stage_rstd_layout(NW))
    else:
        acc = gl.zeros([ROWS, BK], gl.float32, lay)
        rstd = 1.0
    # the attention task of this program (rows past NB * KVH * NSPLIT have none): its row, its
    # cache's (layer, row) index less the layer's, its task within the row
    arow = pid // (KVH * NSPLIT)
    task = pid % (KVH * NSPLIT)
    kt, vt = _kv_tiles(kc_ptr, vc_ptr, pid * 0, pid * 0, pid, 0, maxctx, NW, PW, False)  # no bytes: all masked
    for i in range(total):
        layer, s, j, kq, k, nk, tiles, kdim, base = _chunk(i, pid, C, C0, C1, C2, ROT)
        tile = pid + j * NPROG
        act = act_ptr + layer * (NB * LAYER_A)  # the layer's first row
        h_in = act_ptr + (layer - 1) * (NB * LAYER_A) + A_H2  # the layer's input rows, hs apart
        hs = gl.where(layer == 0, HIDDEN, LAYER_A)
        if layer == 0:
            h_in = x_ptr
        cl = layer * NB + arow  # the attention task's cache: [L, NB] flattened
        if kq == 0:  # a task starts (the old sums are dead here, so not live across a stage's waits)
            if j == 0:  # a stage starts: wait for its input, stage it
                if s == 0:
                    _stamp(ts_ptr, layer, pid, 0, NPROG, PROF)
                    if layer > 0:
                        _wait_for(ctr_ptr + (layer - 1) * NCTR + 4, target, POLL)
                    _stamp(ts_ptr, layer, pid, 1, NPROG, PROF)
                    if ATT == 2:  # the attention task's first K/V tile: in flight through the QKV stage
                        if pid < NB * KVH * NSPLIT:
                            kvh, sp, start, end = _kv_span(task, ctx, NSPLIT)
                            kt, vt = _kv_tiles(kc_ptr, vc_ptr, cl, kvh, start, end, maxctx, NW, PW, False)
                    gl.thread_barrier()
                    if MMAV:
                        rstd = _stage_rows(xbuf, h_in, hs, gin_ptr + layer * HIDDEN, HIDDEN // BK, NB, True, NW)
                    else:
                        rstd = _normed_input(xbuf, h_in, gin_ptr + layer * HIDDEN, cf)
                elif s == 1:
                    # HBM would idle from here to o_proj (the ring is full, the K/V bytes few): the
                    # chunks after the ring's window go to L2 meanwhile, and their refills read L2
                    for q in gl.static_range(PF):
                        _prefetch_l2(w_ptr, i + NBUF - 1 + q, total, pid, C, C0, C1, C2, NPROG, ROT, NW)
                    _wait_for(ctr_ptr + layer * NCTR, target, POLL)
                    _stamp(ts_ptr, layer, pid, 3, NPROG, PROF)
                    if pid < NB * KVH * NSPLIT:
                        ab = act + arow * LAYER_A  # the task's row
                        pb = part_ptr + arow * (KVH * NSPLIT * G * (D + 2))
                        if ATT == 4:
                            _attend_mma(ab, kc_ptr, vc_ptr, cs_ptr, pb, cl, task, ctx, maxctx, kt, vt, kvs, NSPLIT, NW,
                                        KVS)  # fmt: skip
                        elif ATT == 3:  # its first tile issued here (held through QKV, the tiles would spill)
                            kvh, sp, start, end = _kv_span(task, ctx, NSPLIT)
                            k0, v0 = _kv_tiles(kc_ptr, vc_ptr, cl, kvh, start, end, maxctx, NW, PW, True)
                            _attend_mma(ab, kc_ptr, vc_ptr, cs_ptr, pb, cl, task, ctx, maxctx, k0, v0, ring, NSPLIT,
                                        NW, 0)  # fmt: skip
                        elif ATT == 2:
                            _attend_warps(ab, kc_ptr, vc_ptr, cs_ptr, pb, cl, task, ctx, maxctx, kt, vt, NSPLIT, NW, PW,
                                          DEPTH)  # fmt: skip
                        elif ATT == 1:
                            _attend_grouped(ab, kc_ptr, vc_ptr, cs_ptr, pb, cl, task, ctx, maxctx, NSPLIT, NW)
                        else:  # (batch 1)
                            _attend(act, kc_ptr, vc_ptr, cs_ptr, part_ptr, hctr_ptr, ctr_ptr, layer, epoch, pid, ctx, maxctx,
                                    NSPLIT, NW)  # fmt: skip
                        _stamp(ts_ptr, layer, pid, 12, NPROG, PROF)
                        if ATT > 0:  # (``_attend`` merges inside)
                            if MERGE == 1:  # the partials are o_proj's input: count them
                                gl.thread_barrier()
                                gl.atomic_add(ctr_ptr + layer * NCTR + 1, 1, sem="release", scope="gpu")
                            else:
                                _merge_splits(ab, pb, hctr_ptr + cl * KVH + task // NSPLIT, ctr_ptr + layer * NCTR + 1,
                                              epoch, task // NSPLIT, NSPLIT, NW)  # fmt: skip
                    _stamp(ts_ptr, layer, pid, 4, NPROG, PROF)
                    if MERGE == 1:
                        _wait_for(ctr_ptr + layer * NCTR + 1, epoch * KVH * NSPLIT, POLL)
                    else:
                        _wait_for(ctr_ptr + layer * NCTR + 1, epoch * (KVH * NB), POLL)
                    _stamp(ts_ptr, layer, pid, 5, NPROG, PROF)
                    gl.thread_barrier()
                    if MMAV:
                        _stage_rows(xbuf, act + A_ATT, LAYER_A, gin_ptr, HIDDEN // BK, NB, False, NW)
                    elif MERGE == 1:
                        _stage_merged(xbuf, part_ptr, NSPLIT, NW)
                    else:
                        for c in gl.static_range(HIDDEN // BK):
                            xbuf.index(c).store(gl.load(act + A_ATT + c * BK + cf, cache_modifier=".cg").to(xbuf.dtype))
                elif s == 2:
                    _wait_for(ctr_ptr + layer * NCTR + 2, target, POLL)
                    _stamp(ts_ptr, layer, pid, 7, NPROG, PROF)
                    gl.thread_barrier()
                    if MMAV:
                        rstd = _stage_rows(xbuf, act + A_H1, LAYER_A, gpost_ptr + layer * HIDDEN, HIDDEN // BK, NB, True,
                                           NW)  # fmt: skip
                    else:
                        rstd = _normed_input(xbuf, act + A_H1, gpost_ptr + layer * HIDDEN, cf)
                else:
                    _wait_for(ctr_ptr + layer * NCTR + 3, target, POLL)
                    _stamp(ts_ptr, layer, pid, 9, NPROG, PROF)
                    gl.thread_barrier()
                    if MMAV:  # (gate/up's tasks stored SiLU(g)·u: ``GU`` 1)
                        _stage_rows(xbuf, act + A_GU, LAYER_A, gin_ptr, INTER // BK, NB, False, NW)
                    for c in gl.static_range(INTER // BK * (1 - MMAV)):
                        if GU == 1:  # the gate/up tasks stored SiLU(g)·u
                            xbuf.index(c).store(gl.load(act + A_GU + c * BK + cf, cache_modifier=".cg").to(xbuf.dtype))
                        else:
                            g = gl.load(act + A_GU + c * BK + cf, cache_modifier=".cg")
                            u = gl.load(act + A_GU + INTER + c * BK + cf, cache_modifier=".cg")
                            xbuf.index(c).store((g / (1.0 + gl.exp(-g)) * u).to(xbuf.dtype))
                gl.thread_barrier()
                _stamp(ts_ptr, layer, pid, gl.where(s == 0, 11, 12 + s), NPROG, PROF)
            if MMAV:
                acc = gl.zeros([NW, ROWS, NPAD], gl.float32, mma)
            else:
                acc = gl.zeros([ROWS, BK], gl.float32, lay)
        if TMA:  # chunk i is its slot's (i // NBUF)-th phase
            mbarrier.wait(bars.index(i % NBUF), (i // NBUF) & 1)
        else:
            async_copy.wait_group(NBUF - 2)  # chunk i has landed once at most NBUF - 2 younger groups pend
        gl.thread_barrier()
        if EARLY:  # refill the slot chunk i - 1 left (every thread is past it: the barrier above)
            _refill(ring, boxes, bars, w_ptr, wh_desc, wi_desc, i + NBUF - 1, total, pid, rr, cc, C, C0, C1, C2, NPROG, NBUF,
                    ROT, TMA)  # fmt: skip
        if MMAV:  # W[16, KW] @ X[KW, NPAD] for the warp's column block
            xk = xbuf.index(k + XMAX - nk).permute([0, 2, 1]).load(b_l)
            acc = mma_v2(ring.index(i % NBUF).load(a_l), xk, acc)
        else:
            acc += ring.index(i % NBUF).load(lay).to(gl.float32) * xbuf.index(k).load(col).to(gl.float32)[None, :]
        if not EARLY:
            gl.thread_barrier()  # every thread is done with the slot the next issue refills
            _refill(ring, boxes, bars, w_ptr, wh_desc, wi_desc, i + NBUF - 1, total, pid, rr, cc, C, C0, C1, C2, NPROG, NBUF,
                    ROT, TMA)  # fmt: skip
        if kq == nk - 1:  # the task's rows are done
            if MMAV:
                _store_rows(_warps_summed(acc, red, NW), rstd, gbuf, act, h_in, hs, s, tile, tiles, NB, NW)
            else:
                if tile < tiles:
                    _store_row(gl.sum(acc, axis=1), rstd, gbuf, act, h_in, s, tile * ROWS + ry, tile, GU, hl)
            if j == gl.where(s == 0, T0 - 1, gl.where(s == 1, TO - 1, gl.where(s == 2, T1 - 1, TD - 1))):  # part stored
                gl.thread_barrier()
                gl.atomic_add(ctr_ptr + layer * NCTR + gl.where(s == 0, 0, s + 1), 1, sem="release", scope="gpu")
                _stamp(ts_ptr, layer, pid, 2 + 2 * s + (s > 0).to(gl.int32) * 2, NPROG, PROF)
    async_copy.wait_group(0)
    if TMA:  # every chunk's phase was waited for in the loop: none is in flight
        for b in gl.static_range(NBUF):
            mbarrier.invalidate(bars.index(b))
    gl.atomic_add(epoch_ptr, 1, sem="relaxed", scope="gpu")


def _rope_ref(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cs[0] + rot * cs[1]


def layer_weights(w: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
    """Views of ``layer``'s weights in ``w`` (as loaded: gate rows, then up rows): QKV [QKV, H], o_proj
    [H, H], gate/up [2I, H], down [H, I]."""
    p = w[layer * LAYER_W_ : (layer + 1) * LAYER_W_]
    return (
        p[:OFF_O_].view(QKV_, H_),
        p[OFF_O_:OFF_GU_].view(H_, H_),
        p[OFF_GU_ : OFF_GU_ + 2 * I_ * H_].view(2 * I_, H_),
        p[OFF_D_ : OFF_D_ + H_ * I_].view(H_, I_),
    )


def reference(w, gin, gpost, x, kc, vc, cs, ctx: int, layers: int):
    """The same layers in fp32 with torch: (the last layer's residual, each layer's new K and V)."""
    h = x.float()
    news = []
    for layer in range(layers):
        wqkv, wo, wgu, wd = (t.float() for t in layer_weights(w, layer))
        xn = h * torch.rsqrt(h.pow(2).mean() + EPS_) * gin[layer].float()
        qkv = wqkv @ xn
        q = _rope_ref(qkv[: QH_ * D_].view(QH_, D_), cs)
        k_new = _rope_ref(qkv[QH_ * D_ : (QH_ + KVH_) * D_].view(KVH_, D_), cs)
        v_new = qkv[(QH_ + KVH_) * D_ :].view(KVH_, D_)
        news.append((k_new, v_new))
        k = torch.cat([kc[layer, :, :ctx].float(), k_new.to(torch.bfloat16).float()[:, None]], dim=1)
        v = torch.cat([vc[layer, :, :ctx].float(), v_new.to(torch.bfloat16).float()[:, None]], dim=1)
        k = k.repeat_interleave(QH_ // KVH_, dim=0)
        v = v.repeat_interleave(QH_ // KVH_, dim=0)
        att = torch.softmax((k @ q[:, :, None])[..., 0] / math.sqrt(D_), dim=-1)
        o = (att[:, None, :] @ v)[:, 0].reshape(-1)
        h = h + wo @ o
        xn = h * torch.rsqrt(h.pow(2).mean() + EPS_) * gpost[layer].float()
        gu = wgu @ xn
        h = h + wd @ (torch.nn.functional.silu(gu[:I_]) * gu[I_:])
    return h, news


def _cos_sin(pos: int, device) -> torch.Tensor:
    inv = 500000.0 ** (-torch.arange(0, D_, 2, dtype=torch.float64) / D_)
    ang = torch.cat([pos * inv, pos * inv])
    return torch.stack([ang.cos(), ang.sin()]).float().to(device)


def interleave_gate_up(w: torch.Tensor, layers: int) -> torch.Tensor:
    """A copy of the weights whose gate/up rows come in tiles of 8 gate rows then the same 8 up rows
    (the layout ``GU`` reads); the other stages unchanged."""
    out = w.clone()
    half = ROWS_ // 2
    for layer in range(layers):
        gu = layer_weights(out, layer)[2]
        g, u = gu[:I_].view(I_ // half, half, H_), gu[I_:].view(I_ // half, half, H_)
        gu.copy_(torch.stack([g, u], dim=1).reshape(2 * I_, H_))
    return out


def _timeline(ts: torch.Tensor, nattend: int) -> dict:
    """Mean µs of each stage's busy and wait spans over the programs and layers 1.. (layer 0 is the
    launch's ramp), from the ``EVENTS`` stamps [L, NPROG, NEV]; attention over its ``nattend``
    programs; ``layer`` is the mean time between the layers' last down parts."""
    t = (ts - ts[:, :, 0].min()).double() / 1e3
    ev = {n: t[1:, :, i] for i, n in enumerate(EVENTS)}
    spans = {"wait_in": ("enter", "in_ready"), "qkv": ("in_ready", "qkv_done"), "wait_qkv": ("qkv_done", "qkv_ready"),
             "attn": ("qkv_ready", "attn_done"), "wait_heads": ("attn_done", "heads_ready"),
             "o_proj": ("heads_ready", "o_done"), "wait_o": ("o_done", "o_ready"), "gate_up": ("o_ready", "gu_done"),
             "wait_gu": ("gu_done", "gu_ready"), "down": ("gu_ready", "down_done"),
             # parts of the above: each stage's input staging, the attention task before its merge
             "qkv_staging": ("in_ready", "qkv_staged"), "o_staging": ("heads_ready", "o_staged"),
             "gu_staging": ("o_ready", "gu_staged"), "down_staging": ("gu_ready", "down_staged"),
             "attn_partials": ("qkv_ready", "attn_partial")}  # fmt: skip
    out = {}
    for name, (a, b) in spans.items():
        d = ev[b] - ev[a]
        out[name] = round(float((d[:, :nattend] if name.startswith("attn") else d).mean()), 2)
    out["attn_slowest"] = round(float((ev["attn_done"] - ev["qkv_ready"])[:, :nattend].max(dim=1).values.mean()), 2)
    out["merge_slowest"] = round(float((ev["attn_done"] - ev["attn_partial"])[:, :nattend].max(dim=1).values.mean()), 2)
    ends = t[:, :, EVENTS.index("down_done")].max(dim=1).values
    out["layer"] = round(float((ends[1:] - ends[:-1]).mean()), 2)
    return out


def tiles_for(nprog: int) -> dict:
    """Each weight stage's 16-row output tiles a program of ``nprog`` (``step_chain``'s ``T0``, ``TO``,
    ``T1``, ``TD``), the last round part-filled."""
    return {name: -(-(rows // ROWS_) // nprog) for name, rows in (("T0", QKV_), ("TO", H_), ("T1", 2 * I_), ("TD", H_))}


def splits_for(v: dict, nprog: int, ctx: int) -> int:
    """The attention splits per KV head and row: ``v["splits"]``, or (0) the most, a power of two at
    most 16, that gives every row's every split a program and every split at least one pass of
    the 8 warps' ``pw``-position tiles (run 103 at batch 1, pw 16: 1k 47.7 µs a layer with 8 splits, 48.7
    with 16; 8k 53.2 and 52.7; 32k 71.2 and 64.0)."""
    if v["splits"]:
        return v["splits"]
    n = 16
    while n > 1 and (v["batch"] * KVH_ * n > nprog or n * v["pw"] * 8 > ctx):
        n //= 2
    return n


SMEM_ = 227 * 1024  # sm_90's shared memory for one program


def shared_bytes(v: dict) -> int:
    """The shared memory ``step_chain`` allocates itself for variant ``v``: the weight ring, the
    staged input (bf16, fp32, or the tensor-core path's 8 padded rows) and attention 4's K/V ring,
    which the bf16 and tensor-core staged inputs hold in their own bytes. A lower bound: the
    compiler adds barriers and its own scratch (attention 4: under 1.1 KiB; the others up to 8 KiB)."""
    ring = v["ring"] * ROWS_ * BK_ * 2
    staged = I_ * (2 if v["xbf"] or v["mmav"] else 4) * (NPAD_ if v["mmav"] else 1)
    kv = 2 * v["kvs"] * 8 * 16 * D_ * 2 if v["attention"] == 4 else 0
    return ring + (max(staged, kv) if v["mmav"] or v["xbf"] else staged + kv)


def _refusal(v: dict, nsplit: int, nprog: int, tiles: dict) -> str:
    """Why the kernel cannot run variant ``v`` ('' when it can)."""
    a = v["attention"]
    why = [
        (v["merge"] == 1 and a == 0, "merge 1 needs attention 1 to 4"),  # ``_attend`` merges inside
        (a >= 3 and v["pw"] != 16, "attention 3 and 4 need pw 16"),  # their tiles are 16 positions a warp
        (v["batch"] > 1 and not v["mmav"], "batch above 1 needs mmav 1"),
        (v["batch"] > 1 and (a == 0 or v["merge"] == 1), "batch above 1 needs attention 1 to 4 and merge 0"),
        (v["mmav"] == 1 and (v["tma"] == 1 or v["gu"] == 0), "mmav 1 needs tma 0 (a cp.async ring) and gu 1"),
        # the warps' sums go through the staged input's first chunk, which down's second tile still reads
        (v["mmav"] == 1 and tiles["TD"] > 1, f"mmav 1 needs one down tile a program ({MODEL}: {tiles['TD']})"),
        (v["batch"] * KVH_ * nsplit > nprog, f"batch x {KVH_} heads x {nsplit} splits exceeds {nprog} programs"),
        (a == 4 and v["kvs"] < 2, "attention 4 needs kvs 2 or more (its K/V ring)"),
        (
            shared_bytes(v) > SMEM_,
            f"at least {shared_bytes(v)} bytes of shared memory, over {SMEM_} ({MODEL}: ring, xbf, mmav, kvs)",
        ),
    ]
    return next((text for bad, text in why if bad), "")


def _cell(ws, gin, gpost, x, kc_all, vc_all, cs, want, news, ctx, layers, nprog, v: dict, tiles: dict, reps,
          timeline) -> dict:  # fmt: skip
    """One variant ``v`` (a value of each ``VARIANTS`` knob): checked against the reference, timed
    over graph replays, and (``timeline``) one stamped launch's per-stage spans. ``ws``: the
    weights by ``gu`` (0 as loaded, 1 ``interleave_gate_up``); ``x``, ``kc_all``, ``vc_all``,
    ``want``, ``news``: every row's, of which the variant decodes its batch's first; ``tiles``: each
    stage's output tiles a program (``T0``, ``TO``, ``T1``, ``TD``)."""
    w = ws[v["gu"]]
    dev = w.device
    nb = v["batch"]
    nsplit = splits_for(v, nprog, ctx)
    cell = {"context": ctx, **v, "splits": nsplit, "attention": ATTENTION[v["attention"]]}
    if why := _refusal(v, nsplit, nprog, tiles):
        return {**cell, "error": why}
    kc = kc_all[:, :nb].contiguous()  # [L, NB, KVH, maxctx, D]; the step writes position ctx
    vc = vc_all[:, :nb].contiguous()
    kc[:, :, :, ctx] = 0  # a variant must not pass on its predecessor's
    vc[:, :, :, ctx] = 0
    x = x[:nb].contiguous()
    want = want[:nb]
    act = torch.zeros(layers * nb * LAYER_A_, dtype=torch.float32, device=dev)
    part = torch.zeros(nb * KVH_ * nsplit * (QH_ // KVH_) * (D_ + 2), dtype=torch.float32, device=dev)
    ctr = torch.zeros(layers * NCTR_, dtype=torch.int32, device=dev)
    hctr = torch.zeros(layers * nb * KVH_, dtype=torch.int32, device=dev)
    epoch = torch.zeros(1, dtype=torch.int32, device=dev)
    ts = torch.zeros(layers * nprog * len(EVENTS), dtype=torch.int64, device=dev)
    args = (w, *weight_descriptors(w), gin, gpost, x, act, kc, vc, cs, part, ctr, hctr, epoch, ts, ctx, kc.shape[3])
    consts = dict(L=layers, NPROG=nprog, NBUF=v["ring"], **tiles, NSPLIT=nsplit, ATT=v["attention"], ROT=v["rot"],
                  POLL=v["poll"], EARLY=v["early"], GU=v["gu"], DEPTH=v["depth"],
                  MERGE=v["merge"], PW=v["pw"], KVS=v["kvs"], LAY=v["lay"], XBF=v["xbf"], TMA=v["tma"], NB=nb,
                  MMAV=v["mmav"], PF=v["pf"], PROF=False, NW=8)  # fmt: skip
    out_res = act.view(layers, nb, LAYER_A_)[-1, :, A_H2_ : A_H2_ + H_]
    try:
        step_chain[(nprog,)](*args, **consts, num_warps=8)
        torch.cuda.synchronize()
    except Exception as e:  # a ring that does not fit or compile: one line, go on
        return {**cell, "error": str(e).splitlines()[0][:200]}
    cell["rel_error"] = float((out_res - want).norm() / want.norm())
    cell["kv_rel_error"] = probe_stock.kv_rel_error(kc, ctx, news[:nb])

    def launch():
        step_chain[(nprog,)](*args, **consts, num_warps=8)

    us = probe_stock.twenty_steps_us(launch, reps)
    one = probe_stock.one_step_us(launch, reps)
    cell.update(us_per_step=round(us, 2), us_per_layer=round(us / layers, 2),
                us_per_layer_one_replay=round(one / layers, 2),
                rel_error_after_replays=float((out_res - want).norm() / want.norm()))  # fmt: skip
    if timeline:  # a separate build: the stamps cost time of their own
        consts["PROF"] = True
        try:
            step_chain[(nprog,)](*args, **consts, num_warps=8)  # compile and warm
            step_chain[(nprog,)](*args, **consts, num_warps=8)
            torch.cuda.synchronize()
        except Exception as e:  # the stamps' registers or shared memory may not fit: one line, go on
            return {**cell, "timeline_error": str(e).splitlines()[0][:200]}
        cell["timeline_us"] = _timeline(ts.view(layers, nprog, len(EVENTS)), nb * KVH_ * nsplit)
        cell["rel_error_timeline_build"] = float((out_res - want).norm() / want.norm())
    return cell


def _stock_cell(kind: str, w, gin, gpost, x, kc_all, vc_all, cs, want, news, ctx, layers, nb, reps, draws) -> dict:
    """The harness's stock step ``kind`` (``probe_stock.KINDS``) over the same weights, caches and
    rows as the probe's cells at batch ``nb``, checked against the same reference and timed the
    same way; a tuned kind ``draws`` times, the fastest kept."""
    cell = {"context": ctx, "batch": nb, "stock": kind}
    kc = [kc_all[n, :nb].clone() for n in range(layers)]  # one tensor a layer, as the harness's caches
    vc = [vc_all[n, :nb].clone() for n in range(layers)]
    for c in kc + vc:
        c[:, :, ctx] = 0
    lw = [layer_weights(w, n) for n in range(layers)]
    step, out = probe_stock.build_step(kind, lw, gin, gpost, x[:nb], kc, vc, cs, ctx, nq=QH_, eps=EPS_)
    try:
        timed, out = probe_stock.time_step(step, out, reps, draws if kind in probe_stock.TUNED_KINDS else 1)
    except Exception as e:  # a compile that fails: one line, go on
        return {**cell, "error": str(e).splitlines()[0][:200]}
    us, one = timed.pop("us_per_step"), timed.pop("us_per_step_one_replay")
    want = want[:nb]
    cell.update(us_per_step=round(us, 2), us_per_layer=round(us / layers, 2),
                us_per_layer_one_replay=round(one / layers, 2), **timed,
                rel_error=float((out.float() - want).norm() / want.norm()),
                kv_rel_error=probe_stock.kv_rel_error(kc, ctx, news[:nb]))  # fmt: skip
    return cell


def run(layers: int, contexts: list[int], variants: dict[str, list[int]], reps: int, timeline: bool,
        stock: list[str] = (), stock_draws: int = 1) -> dict:  # fmt: skip
    """Every combination of ``variants`` (``VARIANTS``' knobs) at every context; then each ``stock``
    step (``probe_stock.KINDS``) at every batch, and the two side by side."""
    from monodecode_ops.decode_bench.probes import read_probes

    dev = torch.device("cuda")
    nprog = torch.cuda.get_device_properties(dev).multi_processor_count
    tiles = tiles_for(nprog)
    torch.manual_seed(0)
    w = torch.empty(layers * LAYER_W_, dtype=torch.bfloat16, device=dev)
    for layer in range(layers):  # scaled so the residual stays near 1 through the layers
        p = w[layer * LAYER_W_ : (layer + 1) * LAYER_W_]
        p[:OFF_D_].normal_(0, H_**-0.5)
        p[OFF_O_:OFF_GU_].mul_(0.5)
        p[OFF_D_:].normal_(0, 0.5 * I_**-0.5)
    gin = (1 + 0.1 * torch.randn(layers, H_, device=dev)).to(torch.bfloat16)
    gpost = (1 + 0.1 * torch.randn(layers, H_, device=dev)).to(torch.bfloat16)
    rows = max(variants["batch"])
    x = torch.randn(rows, H_, device=dev)  # each row its own residual and context
    ws = {0: w, 1: interleave_gate_up(w, layers) if 1 in variants["gu"] else None}
    probes = read_probes(dev)
    best = max(probes.values())
    out = {"gpu": torch.cuda.get_device_name(), "layers": layers, "programs": nprog,
           "model": MODEL, "weight_bytes_per_layer": WEIGHTS_ * 2, "read_probes_bytes_per_s": probes, "cells": []}  # fmt: skip
    for ctx in contexts:
        maxctx = ctx + 1
        kc = torch.randn(layers, rows, KVH_, maxctx, D_, device=dev).to(torch.bfloat16)
        vc = torch.randn(layers, rows, KVH_, maxctx, D_, device=dev).to(torch.bfloat16)
        cs = _cos_sin(ctx, dev)
        refs = [reference(w, gin, gpost, x[b], kc[:, b], vc[:, b], cs, ctx, layers) for b in range(rows)]
        want = torch.stack([h for h, _ in refs])
        news = [n for _, n in refs]
        combos = [dict(zip(variants, combo)) for combo in itertools.product(*variants.values())]
        cells = (
            _cell(ws, gin, gpost, x, kc, vc, cs, want, news, ctx, layers, nprog, v, tiles, reps, timeline)
            for v in combos
        )
        stocks = (
            _stock_cell(kind, w, gin, gpost, x, kc, vc, cs, want, news, ctx, layers, nb, reps, stock_draws)
            for nb in sorted(set(variants["batch"]))
            for kind in stock
        )
        for cell in itertools.chain(cells, stocks):
            step_bytes = WEIGHTS_ * 2 + cell["batch"] * 2 * KVH_ * (ctx + 1) * D_ * 2
            cell["fraction_of_probe"] = (
                round(step_bytes / (cell["us_per_layer"] * 1e-6) / best, 3) if "us_per_layer" in cell else None
            )
            out["cells"].append(cell)
            print(json.dumps(cell), flush=True)
        del kc, vc  # before the next context's caches
    out["side_by_side"] = probe_stock.side_by_side(out["cells"])
    for row in out["side_by_side"]:
        print(json.dumps({"side_by_side": row}), flush=True)
    return out


def _ints(text: str) -> list[int]:
    """argparse type: comma-separated non-negative integers (anything else: argparse's one line)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if min(values) < 0:
        raise argparse.ArgumentTypeError(f"negative value in {text!r}")
    return values


def _positive(text: str) -> int:
    """argparse type: an integer of at least 1 (anything else: argparse's one line)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def _stock_kinds(text: str) -> list[str]:
    """argparse type: comma-separated ``probe_stock.KINDS`` names (others: argparse's one line)."""
    kinds = [k for k in text.split(",") if k]
    if bad := [k for k in kinds if k not in probe_stock.KINDS]:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(probe_stock.KINDS)}")
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default=MODEL, help="the profile whose decoder layer runs")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--contexts", type=_ints, default="1024,8192,32768")
    for knob, (default, what) in VARIANTS.items():
        ap.add_argument(f"--{knob}", type=_ints, default=default, help=f"{what} (comma-separated values to time)")
    ap.add_argument("--timeline", action="store_true", help="also one stamped launch per cell: per-stage µs")
    ap.add_argument(
        "--stock",
        type=_stock_kinds,
        default="",
        help=f"stock steps timed beside the probe: {', '.join(probe_stock.KINDS)}",
    )
    ap.add_argument(
        "--stock-draws",
        type=_positive,
        default=1,
        help=f"compiles of each tuned stock ({', '.join(probe_stock.TUNED_KINDS)}), tuned afresh after the first; "
        "the fastest counts (their tunings vary by 20 %%)",
    )
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="", help="folder for step_probe.json")
    a = ap.parse_args()
    if max(a.attention) >= len(ATTENTION):
        ap.error(f"argument --attention: {max(a.attention)} is not one of 0-{len(ATTENTION) - 1}")
    for knob in SWITCHES:
        if (top := max(getattr(a, knob))) > 1:
            ap.error(f"argument --{knob}: {top} is not 0 (off) or 1 (on)")
    if bad := [b for b in a.batch if not 1 <= b <= 8]:
        ap.error(f"argument --batch: {bad[0]} is not 1 to 8 (mma.sync's 8 columns)")
    if a.model != MODEL:  # the shapes are module constants: the same command in a process of that model
        script = str(Path(__file__).resolve())
        os.execve(sys.executable, [sys.executable, script, *sys.argv[1:]], {**os.environ, "STEP_PROBE_MODEL": a.model})
    variants = {knob: getattr(a, knob) for knob in VARIANTS}
    res = run(a.layers, a.contexts, variants, a.reps, a.timeline, a.stock, a.stock_draws)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "step_probe.json").write_text(json.dumps(res, indent=1))
        if any("stock_over_probe" in r for r in res["side_by_side"]):
            title = f"step_probe vs stock, {res['gpu']}, {a.layers} layers"
            probe_stock.plot(res["side_by_side"], title, Path(a.out) / "step_probe_vs_stock.png")


if __name__ == "__main__":
    main()
