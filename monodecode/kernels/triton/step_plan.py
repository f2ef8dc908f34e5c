"""The step launch's geometry: what ``step_kernel.py`` is compiled for, in plain Python.

The step launch runs decoder layers ``first .. first + count - 1`` of a decode step in ONE
persistent launch of one program per SM (issue 26's item 7, measured as ``benchmarks/step_probe.py``
before it was ported here). Each program walks one fixed sequence of weight chunks (16 rows x 1024
columns, 32 KiB: its row tiles of QKV, o_proj, gate/up and down of every layer) through a ring of
shared-memory slots that is always ``ring - 1`` chunks ahead of the arithmetic, across every wait
and the attention task, so HBM keeps streaming weights while a program waits for activations.

Llama-style layers run at widths 1-8 (BF16 or FP8 weights); Gemma-3's at width 1 (``StepGeometry.gemma``),
where its two-launch kernels were level with the strongest stock (runs 155-163).

This module holds everything about that plan that needs no GPU: the packed weight layout, the
tiles a program owns in each stage, the activation and counter layouts, the attention's context
splits, the shared-memory budget and the refusals. The kernel reads it as constexprs
(``StepGeometry.constexprs``); the CPU tests check it against the compiled kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from monodecode.model.dims import ModelDims

ROWS = 16  # a weight chunk's rows (one output tile)
BK = 1024  # a weight chunk's columns
TB = 256  # TMA's widest box side: a chunk is one [16, 4, 256] box
NPAD = 8  # widths 2-8: the rows padded to mma.sync's 8 columns (W[16, K] @ X[K, 8])
NUM_WARPS = 8
MAX_WIDTH = 8
NCTR = 6  # a layer's completion counters: qkv, heads merged, o_proj, gate/up, down, gate/up's rounds but its last
SMEM_PER_PROGRAM = 227 * 1024  # sm_90's most shared memory for one program
KV_TILE = NUM_WARPS * 16  # positions one attention step reads: 16 a warp (``kv_step`` 1)
WEIGHT_RING = 3  # the weight ring's slots at width 1 (runs 101-104: 3 measured best at batch 1)
WIDE_RING = 4  # ... at widths 2-8, where they fit (run 109: 1B 2-5 % faster than 3)
# FP8 (e4m3fn) weights: a weight chunk is two [16, 1024] parts by default, 32 KiB as bf16's one
# (``StepGeometry.chunk_span``); with the ``span`` knob at 1 it is one part (16 KiB) and the ring
# then holds as many bytes in flight as bf16's by default (``ring_slots``: 2 n - 1 slots for n)
WEIGHT_DTYPES = {"bf16": 2, "fp8": 1}  # the weights the step launch streams -> bytes an element
# The plan's knobs a build may change (``StepKernels(plan=...)``, the benchmark's step variants):
# name -> (default, least, most). ``ring``: the weight ring's slots at every width (default: by
# width, ``StepGeometry.ring_slots``); ``stream_down``: 0 stages down's whole input above 1 row
# where it fits (``StepGeometry.streams_down``); ``wide_tma``: 1 fills the ring by TMA above 1 row,
# 0 by ``cp.async`` (default: TMA where the ring is ``WIDE_RING`` deep, ``StepGeometry.tma``).
# Run 106 timed two more and dropped them (weight chunks asked of L2 at each wait, 4-8 % slower;
# the attention's first K/V copies before its QKV wait, 0.4-1.2 % slower), run 108 three
# (a 4-slot K/V ring, 2-8 % slower with spills at width 8; waits polling by loads and acquiring
# once, 2-7 % slower: one more round trip a wait; the first cache blocks read before the QKV wait,
# level). Run 109 made down's input streamed above 1 row and, where that leaves room, a 4-slot ring
# filled by TMA the defaults. Run 111 timed the K/V tiles by TMA (a box a warp's 16 positions of one
# cache block, 16 rows of 128-256 bytes): 4-15 % slower at 32k than ``cp.async``; dropped. Runs
# 115-116 held back the refills QKV asks for past its stage until the attention's first K/V copies
# were out, so they would not queue behind the whole GPU's prefetched weights: 1-5 % slower; dropped.
# ``kv_step`` 2 (the default from width 8 where it fits, ``StepGeometry.kv_groups``; run 119):
# each warp's attention step reads 32 positions (two mma groups) where the K/V ring of 2 such
# slots fits (head_dim 64), so a step's fixed cost is paid once per
# 64 KiB (run 117: 1B's task alone reads 2.50 TB/s at 32k x 8 with 32 KiB tiles, 8B's 2.88 with
# 64 KiB ones; the ring's depth did not matter).
# ``early_down`` (session 24, run 122): down waits for gate/up's rounds but its last, then for the
# rest only where its first task reaches their chunks (``StepGeometry.down_early_chunks``): 0.5-2 %
# faster at 1B, 0.2-1 % at 8B. Run 122 also timed the same for gate/up's input from o_proj and
# width 1's QKV input from the previous down (8B: 2 of 4 chunks each; ``early_hidden``): 0.4-1.9 %
# slower (the first task's chunks staged in two passes, the row read again for its rstd); dropped.
# Run 124 timed three at width 1 and dropped them: a deeper weight ring (6 slots at 8B) for the
# programs whose attention task reads no cached position, in the K/V ring's shared memory (15 %
# slower at 8B 1k: a stage's bandwidth splits in proportion to each program's chunks in flight, so
# the shallow programs ended it late; 2-3 % at 8k-32k from the depth chosen at run time); the
# attention tasks on the last programs (1-3 % slower); the norm weights asked of L2 before the
# waits (level). Run 127 timed ``early_residual`` (width 1's o_proj and down tasks asking for the
# residual rows their sums join at the task's first chunk, not after its last): level at 8B and
# 1B (-0.3 to +0.3 %, the same PTX elsewhere); dropped.
# Runs 119-120 timed ``tagged`` 1-3 and dropped it (width 1's hand-offs as 64-bit words carrying
# the launch's epoch, polled by the consumer instead of a counter and then the input; 2: the
# attention's split partials too, merged with no counter; 3: each input staged chunk by chunk as
# its words arrived): bit for bit the default, and 1-2 % (1), 5-8 % (2), 6-12 % (3) slower at
# batch 1 on the H100 (benchmarks/README.md, runs 118-120).
# ``mma1`` (session 28): width 1's products on mma.sync as widths 2-8's are (its row padded to 8
# columns), not on FMA over [16, 1024] chunks in registers (``StepGeometry.mma``); ``span``: the
# staged 1024-column chunks a weight chunk spans (``StepGeometry.chunk_span``; default 2 for FP8).
# ``one_box`` (session 29): width 1's TMA asks for a weight chunk's parts in one box (``box_parts``);
# 0 a box a part, as before. Runs 143-144 also timed the refill unpredicated, an empty chunk's box
# read from outside the view (zeros, its bytes counted) and the expect after the copy, so that
# Triton's barrier analysis leaves 2 ``bar.sync``s a chunk where it puts 4 (bf16, FP8 one box) or 5
# (FP8 a box a part): level at 8B bf16, 0.2 % faster at FP8, 0.6-0.9 % slower at 1B (its empty
# chunks, 2-8 of a program's ~28 a layer, then wait for TMA's round trip); dropped.
# Run 166 (H100, 27B batch 1 at 1k, 8k and 32k, both timings) timed two session-35 knobs and
# dropped both as knobs: ``early_norms`` (the post norms' staging passes asking for their two
# weight rows, fp32 (1 + w), 21 KiB each at 27B, before their waits, not after: run 164's QKV and
# gate/up hand-offs were 4.1 and 3.2 µs a layer at 27B against 8B's 1.0 and 1.2) was 0.34-0.50 %
# faster and is now the only way (``step_kernel._norm_rows``); ``down_rot`` (down's tiles rotated
# so that its last, partial round fell on the programs without a tile in gate/up's last one; the
# busiest program 189 -> 183 chunks a layer) was 0.14-0.33 % slower, 0.2-0.3 % with the other.
# Run 167 (H100, batch 1 at 1k and 8k, every profile) timed ``l2_ahead`` 4 and 8 and dropped it:
# once the attention's input was there (behind the task's first K/V copies), each program asked
# L2 for the chunks after its ring's window (``cp.async.bulk.prefetch.L2``), where the step's
# cached K/V bytes were fewer than those chunks' (HBM otherwise idles through the attention at
# 1k: 3 slots hold 2.7 µs of the probe's bytes, the attention takes 9.5 µs at 8B). Where it asked,
# it was 0.3-1.6 % slower at 1k and 2.0-6.0 % at 8k; where it did not, -0.4 to +0.5 % (27B's
# builds with it spilled 68-76 bytes).
# Runs 171-172 (H100, 8B FP8) timed ``fp8_pair`` (session 38) and dropped it: the stages of
# K = hidden staged each row as two e4m3 tiles (a power of two, then its top and next 4
# significant bits: exact for bf16, as the two-launch kernels' ``gemv.fp8_pair``) and ran their
# products on e4m3 ``mma.sync`` (m16n8k32) with the weights unwidened; down as before, width 1
# on mma (``mma1``). It passed the GPU suite's FP8 tests and fault drills, and was 24-27 % slower
# (1k: 1.009 against 0.811 ms at batch 1, 1.394 against 1.095 at 8; its timeline: gate/up 55.3
# against 45.4 µs a layer, each staged stage's hand-off 2.6 µs longer). sm_90 has no e4m3
# ``mma.sync``: ptxas lowers each to F2FP unpacks of both operands to f16 and two f16 HMMAs.
# Hopper's FP8 tensor cores are reached only through wgmma (the two-launch kernels' ``tl.dot``),
# whose 64-row tiles would need the batch as M (x^T W^T), not a 16-row weight chunk.
# Run 176 (H100, session 39) timed two merge knobs of session 38 at batch 1 and dropped both:
# ``kv_splits`` (fewer context splits a KV head) and ``merge_used`` (the merge reads only the
# splits that hold positions; the same bits). The merge and its counter went from 3.4 to 2.2 µs
# a layer (8B, 8 splits) and 2.6 (``merge_used``), but the step moved -1.8 to +0.2 % at 1k (8B
# 1.283-1.294 against 1.292 ms; 1B 0.442-0.447 against 0.450; FP8 0.810-0.813 against 0.824,
# whose default drew 0.811-0.821 in runs 165-172), ``merge_used`` was level at 8k and 32k (-0.2
# to +1.1 %), and 8 splits were 1-9 % slower there, 4 splits 6-43 % (longer tasks). At 1k a task
# reads the same 128 positions with 8 splits as with 16 (6.1 against 6.2 µs, its wait to its
# partial stored), and one of an empty split takes 4.4: the task's fixed path, not the merge,
# is most of the attention's time.
# ``att_pad`` (session 40, runs 178-180): the attention task's warp partials summed through
# shared-memory rows padded by 32 bytes, not plain ones, whose mma.sync stores took 4 times
# their wavefronts (``pads_att_sum``); the default at width 1.
# Runs 182-186 (H100, session 41, batch 1) timed ``att_slim`` and dropped it: the attention
# task's q staged once for all warps (each warp's mma operand a broadcast of that copy, not a
# copy a warp) and, at Llama's width 1, its warps' sum loading the group's G rows of 16 with the
# new position's weight and v beside them (bit for bit the default: the GPU suite's plan cases).
# A task took 0.3-0.6 µs less (medians at 1k: 8B 3.8 -> 3.3, FP8 3.8 -> 3.2, 1B 2.9 -> 2.6,
# 27B 7.4 -> 7.0) and the step did not move: 8B 0.0-0.8 % slower (1.297-1.302 against
# 1.303-1.308 ms at 1k), 1B 0.3-0.7 % faster, FP8 and 27B level, the layer's chain 161.8 against
# 161.7 µs at 8B; the weights' stream, not the attention's fixed path, paces the step there.
# Its sum's loads spilled 24-44 bytes at widths 2-4 and Gemma's width 1.
# ``one_sum`` (session 41; the default since session 42's runs 187-191): every norm the step
# stages (the input norms at every width; Gemma's post norms and the norms after them) adds its
# squares per thread over a row's chunks and reduces across the block once; 0 reduces each
# 1024-column chunk across the block (a block-wide sum is two ``bar.sync``s and a shared-memory
# round trip, in series on every stage's hand-off). At sm_90 it takes the kernel's ``bar.sync``s
# from 109 to 97 (8B width 1), 95 to 83 (8B widths 2-8) and 207 to 130 (27B), width 1's registers
# from 243 to 237 (8B) and 254 to 240 (27B), and the spills of the timeline builds of 27B (32
# bytes) and FP8 8B at widths 2 and 8 (16, 8) to 0. Timed beside 0 on one H100 (runs 187-191,
# every profile, batches 1-8, 1k-32k): 0.1-2.3 % faster in 31 of 35 cells (FP8 1k x 8 1.083
# against 1.106 ms, 8B 1k x 8 1.414 against 1.428, 27B 1k x 1 2.341-2.344 against
# 2.358-2.360), 0.2-0.9 % slower in 4 (8B 1k x 1 1.297 against 1.285 and 1.289 against 1.287;
# FP8 1k x 1 once of two draws, 1k x 2); the hand-offs of a layer's chain 7.5 -> 5.7 µs at 27B,
# 5.5 -> 4.3 at 8B x 8. A different order of the same fp32 sums, so a sum knob: 0 is
# held to the reference's tolerance (``test_step_gpu``'s chunk-by-chunk cases).
# ``grid`` (session 42, UNTIMED): the programs launched, where fewer than the SMs (default: one
# an SM). On 132 SMs no stage of 8B divides evenly (QKV's 384 tiles, o_proj's and down's 256,
# gate/up's 1792: 3.1 % more chunks on the busiest program than the mean, ``busiest_program_share``);
# on 128 every stage does, with the same chunks on the busiest program. Whether the step gains
# depends on whether 4 fewer SMs still draw HBM's rate: each program keeps only its ring's slots
# in flight, and a stage ends with its busiest programs' tails. It changes the attention's splits
# where they depend on the programs, so a sum knob.
PLAN_KNOBS = {
    "ring": (None, 2, 8),
    "stream_down": (1, 0, 1),
    "wide_tma": (None, 0, 1),
    "kv_step": (None, 1, 2),
    "early_down": (1, 0, 1),
    "mma1": (None, 0, 1),
    "span": (None, 1, 2),
    "one_box": (1, 0, 1),
    "att_pad": (None, 0, 1),
    "one_sum": (1, 0, 1),
    "grid": (None, 32, 1024),
}
# Knobs that change a sum, not only where bytes go: a variant with one is held to the reference's
# tolerance, not to the default plan's bits (``kv_step``: the attention's tile of a step; ``one_sum``:
# the order the norms add their squares in; ``grid``: the attention's splits, where they follow the programs)
SUM_KNOBS = frozenset({"kv_step", "one_sum", "grid"})
ATT_PAD_MAX_WIDTH = 1  # the widest build whose attention partials go through padded rows (``pads_att_sum``)
KV_STEP_2_FROM = 8  # the least width whose attention steps 32 positions a warp by default (``kv_groups``)
MIN_SPLIT = 128  # positions a context split holds at least: shorter splits cost more merging than they save


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def is_gemma3(dims: ModelDims) -> bool:
    """Gemma-3's decoder layers, everything the step launch's ``GEMMA`` build does beyond a Llama
    layer: q/k-norm, post norms, (1 + w) norms, GELU-tanh (sliding windows on some layers)."""
    return (
        dims.family == "gemma3"
        and dims.qk_norm
        and dims.post_norms
        and dims.norm_one_plus
        and dims.activation == "gelu_tanh"
    )


def step_refusals(
    dims: ModelDims, weight_dtype: str, tp_size: int, widths: tuple[int, ...], programs: int | None = None
) -> list[str]:
    """Every reason the step launch cannot serve this model and these widths ("code: sentence");
    [] when it can. The platform's part (sm_90 or newer) is the backend's; ``programs`` (the SMs,
    when known) adds the reasons that depend on them."""
    why = []
    gemma = is_gemma3(dims)
    if gemma:  # Gemma-3 at width 1 (``StepGeometry.gemma``); its wider steps are the two-launch kernels'
        if over := [w for w in widths if w > 1]:
            why.append(
                f"model_dims: the step launch runs Gemma-3 layers at width 1 only (its q/k-norm, post norms, "
                f"GELU and sliding windows are on the FMA path), asked for width {over[0]}"
            )
        if dims.hidden_size % TB or dims.q_size % BK:
            why.append(
                f"model_dims: Gemma-3 on the step launch needs hidden ({dims.hidden_size}) a multiple of {TB} "
                f"(TMA's box) and heads x head_dim ({dims.q_size}) of {BK}"
            )
        if weight_dtype != "bf16":
            why.append(
                f"weight_dtype: the step launch streams Gemma-3's weights as bf16 only, asked for {weight_dtype}"
            )
    else:
        if dims.family != "llama" or dims.qk_norm or dims.post_norms or dims.norm_one_plus:
            why.append(
                f"model_dims: the step launch runs Llama-style and Gemma-3 layers only (q/k-norm and post norms "
                f"with Gemma's (1 + w) norms, GELU-tanh and windows together); {dims.family} is neither"
            )
        if dims.activation != "silu":
            why.append(f"model_dims: the step launch's Llama-style MLP is SiLU-gated, the model uses {dims.activation}")
        if dims.sliding_window or any(dims.is_sliding(l) for l in range(dims.num_layers)):
            why.append("model_dims: the step launch has sliding-window attention for Gemma-3 only")
        if dims.q_size != dims.hidden_size:
            why.append(
                f"model_dims: the step launch needs heads x head_dim == hidden for Llama-style layers "
                f"({dims.q_size} != {dims.hidden_size})"
            )
    if (not gemma and dims.hidden_size % BK) or dims.intermediate_size % BK:
        why.append(
            f"model_dims: hidden ({dims.hidden_size}) and intermediate ({dims.intermediate_size}) sizes must be "
            f"multiples of {BK} (the weight chunk's columns)"
        )
    if dims.head_dim not in (64, 128):
        why.append(f"model_dims: the step launch's attention takes head_dim 64 or 128, not {dims.head_dim}")
    group = dims.num_heads // dims.num_kv_heads
    if dims.num_heads % dims.num_kv_heads or group > 16 or group & (group - 1):
        why.append(
            f"model_dims: {dims.num_heads} query heads over {dims.num_kv_heads} KV heads is not a group of "
            "1, 2, 4, 8 or 16 (the attention pads a group to mma's 16 rows)"
        )
    if (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim % ROWS:
        why.append(f"model_dims: the fused QKV rows are not a multiple of {ROWS}")
    if weight_dtype not in WEIGHT_DTYPES:
        why.append(
            f"weight_dtype: the step launch streams bf16 or fp8 (e4m3fn, per-row scales) weights, asked for {weight_dtype}"
        )
    if tp_size != 1:
        why.append(f"tp_size: the step launch runs TP 1 only, asked for {tp_size}")
    if over := [w for w in widths if w > MAX_WIDTH]:
        why.append(
            f"model_dims: the step launch decodes 1-{MAX_WIDTH} rows (mma.sync's 8 columns), asked for {over[0]}"
        )
    if programs is not None and not why:
        for w in widths:
            try:
                StepGeometry(dims, w, programs, weight_dtype=weight_dtype).check()
            except ValueError as e:
                code = "compute_units" if "programs cannot hold" in str(e) else "model_dims"
                why.append(f"{code}: {e}")
    return why


def checked_plan(plan: dict | None) -> dict[str, int]:
    """``plan`` (knob -> value, ``PLAN_KNOBS``) checked; ValueError in one line naming the knob."""
    out = {}
    for name, value in (plan or {}).items():
        if name not in PLAN_KNOBS:
            raise ValueError(f"step launch plan: unknown knob {name!r} (known: {', '.join(PLAN_KNOBS)})")
        _, lo, hi = PLAN_KNOBS[name]
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"step launch plan: {name} must be an integer {lo}-{hi}, got {value!r}")
        out[name] = value
    return out


@dataclass(frozen=True)
class StepGeometry:
    """The step launch of one model at one width on ``programs`` SMs, with the plan's knobs
    (``PLAN_KNOBS``) at their defaults unless given."""

    dims: ModelDims
    width: int
    programs: int
    ring: int | None = None  # None: by width (``ring_slots``)
    stream_down: int = 1
    wide_tma: int | None = None  # None: where the ring is WIDE_RING deep (``tma``)
    kv_step: int | None = None  # 16-position groups a warp's attention step reads; None: by width (``kv_groups``)
    early_down: int = 1  # down starts on gate/up's rounds but the last (``down_early_chunks``)
    mma1: int | None = None  # width 1's products on mma.sync; None: not (``mma``)
    span: int | None = None  # a weight chunk's 1024-column parts; None: by dtype (``chunk_span``)
    one_box: int = 1  # width 1's TMA asks for a chunk in one box, not a box a part (``box_parts``)
    att_pad: int | None = None  # warp partials summed through padded rows; None: by width (``pads_att_sum``)
    one_sum: int = 1  # the norms: their squares summed across the block once a row, not once a chunk
    grid: int | None = None  # programs launched where fewer than ``programs`` (the SMs); None: one an SM
    weight_dtype: str = "bf16"  # ``WEIGHT_DTYPES``: fp8 streams e4m3fn weights, each row's sum times its scale

    def __post_init__(self) -> None:
        # every count of the plan (tiles a program, splits, NPROG) is of the programs launched
        if self.grid is not None and self.grid < self.programs:
            object.__setattr__(self, "programs", self.grid)

    @property
    def weight_bytes(self) -> int:
        """Bytes of one weight element (``WEIGHT_DTYPES``)."""
        return WEIGHT_DTYPES[self.weight_dtype]

    @property
    def chunk_span(self) -> int:
        """The staged input's ``BK``-column chunks one weight chunk spans: the plan's ``span``, else 2
        for FP8 where the sizes are multiples of 2048 (its chunk then [16, 2048], 32 KiB as bf16's
        [16, 1024]), else 1. A chunk's fixed costs (its slot's wait and barriers, the refill's
        issue) are paid once a slot. Run 137 timed FP8's 16 KiB chunks at 1.12 µs each on gate/up
        at width 1 (1.87 TB/s), where the arithmetic alone takes 0.34 µs (run 139,
        ``benchmarks/chunk_probe.py``, H100); with two parts a chunk, 8B FP8 is 20 % faster at
        batch 1 (run 140) and 16-18 % at batches 2-8 (run 141)."""
        if self.span is not None:
            return self.span
        d = self.dims
        whole = not (d.hidden_size % (2 * BK) or d.intermediate_size % (2 * BK))
        return 2 if self.weight_dtype == "fp8" and whole else 1

    @property
    def box_parts(self) -> int:
        """A width-1 TMA box's 1024-column parts: a chunk's ``chunk_span`` with ``one_box`` (FP8's
        two parts in one [16, 8, 256] box), else 1 (a box a part). Triton 3.6's shared-memory
        barrier analysis puts a ``bar.sync`` between any two of a slot's mbarrier and TMA
        operations, whatever their predicates: FP8's refill takes 4 where it took 5, one TMA
        operation where it took two, and 8B FP8 is 1.2-1.3 % faster at batch 1 (run 144, H100)."""
        return self.chunk_span if self.one_box and not self.mma else 1

    @property
    def chunk_bytes(self) -> int:
        """A weight chunk's bytes (16 rows x ``chunk_span`` x 1024 columns): 32 KiB by default."""
        return ROWS * BK * self.chunk_span * self.weight_bytes

    # -- weights ------------------------------------------------------------------------------
    @property
    def gemma(self) -> bool:
        """Gemma-3's layers (``is_gemma3``; width 1 only, ``step_refusals``): q/k-norm in each
        attention task, the norms' weights passed as fp32 (1 + w), GELU-tanh, per-layer windows and
        RoPE tables, and the post norms in the staging passes: o_proj and down store their raw
        sums, and the program that stages the next input (gate/up's, the next layer's QKV, the
        launch's last stage) normalises them over the whole row, adds the residual and writes its
        own tiles' rows of the new residual."""
        return is_gemma3(self.dims)

    @property
    def k_chunks(self) -> int:
        """Chunks of a stage whose K is hidden: the last one zero-padded past hidden where 1024
        does not divide it (Gemma-3-27B's 5376: TMA zero-fills the box past the row, no bytes read)."""
        return _ceil(self.dims.hidden_size, BK * self.chunk_span)

    @property
    def qkv_rows(self) -> int:
        d = self.dims
        return (d.num_heads + 2 * d.num_kv_heads) * d.head_dim

    @property
    def row_lcm(self) -> int:
        """Elements in a whole row of each of TMA's views (hidden, intermediate, heads x head_dim)."""
        return math.lcm(self.dims.hidden_size, self.dims.intermediate_size, self.dims.q_size)

    @property
    def off_o(self) -> int:
        """o_proj starts at whole rows of hidden and of its own K (heads x head_dim: TMA's third view)."""
        whole = math.lcm(self.dims.hidden_size, self.dims.q_size)
        return _ceil(self.qkv_rows * self.dims.hidden_size, whole) * whole

    @property
    def off_gu(self) -> int:
        return self.off_o + self.dims.hidden_size * self.dims.q_size

    @property
    def off_down(self) -> int:
        """down starts at whole rows of both hidden and intermediate (TMA's two row views)."""
        end = self.off_gu + 2 * self.dims.intermediate_size * self.dims.hidden_size
        return _ceil(end, self.row_lcm) * self.row_lcm

    @property
    def layer_weights(self) -> int:
        """A layer's packed weights in elements, padding included (whole rows of both views)."""
        end = self.off_down + self.dims.hidden_size * self.dims.intermediate_size
        return _ceil(end, self.row_lcm) * self.row_lcm

    @property
    def scale_offsets(self) -> dict[str, int]:
        """FP8: a layer's per-row weight scales (fp32), in the packed rows' order: QKV's rows, then
        o_proj's, gate/up's (interleaved as packed), down's; "end" is a layer's count."""
        h, i, q = self.dims.hidden_size, self.dims.intermediate_size, self.qkv_rows
        return {"qkv": 0, "o": q, "gu": q + h, "down": q + h + 2 * i, "end": q + 2 * h + 2 * i}

    # -- tiles a program owns per stage -------------------------------------------------------
    def stage_tiles(self) -> tuple[int, int, int, int]:
        """16-row tiles of QKV, o_proj, gate/up and down."""
        h, i = self.dims.hidden_size, self.dims.intermediate_size
        return self.qkv_rows // ROWS, h // ROWS, 2 * i // ROWS, h // ROWS

    def tiles_per_program(self) -> tuple[int, int, int, int]:
        return tuple(_ceil(t, self.programs) for t in self.stage_tiles())  # type: ignore[return-value]

    def chunks_per_layer(self) -> int:
        """The chunks every program walks a layer (tiles past a stage's end copy nothing):
        program 0 owns a tile at each of them, so it streams this many."""
        return self._chunks(self.tiles_per_program())

    def _chunks(self, tiles: tuple[int, int, int, int]) -> int:
        cols = BK * self.chunk_span
        kq, ki = self.dims.q_size // cols, self.dims.intermediate_size // cols
        return (tiles[0] + tiles[2]) * self.k_chunks + tiles[1] * kq + tiles[3] * ki

    def busiest_program_share(self) -> float:
        """The busiest program's weight chunks a layer over the grid's mean (8B on 132 SMs: 104
        against 100.85, 1.031; 1B: 30 against 28.1): a layer's weights take at least this much
        longer than their bytes at the probe's rate, however fast each program streams."""
        return self.chunks_per_layer() * self.programs / self._chunks(self.stage_tiles())

    # -- activations and counters -------------------------------------------------------------
    @property
    def act_offsets(self) -> dict[str, int]:
        """A row's fp32 activations of a layer: qkv | attention out | h1 = x + o | SiLU(g)·u; for
        Gemma-3 (``gemma``) o_proj's and down's raw sums ("o", "dn"), which the post norms read
        whole; and where down's input streams (``streams_down``) SiLU(g)·u again as bf16 ("g16":
        I bf16 in I / 2 words), which down's X chunks are copied from as they are."""
        h, i = self.dims.hidden_size, self.dims.intermediate_size
        q, a = self.qkv_rows, self.dims.q_size
        out = {"qkv": 0, "att": q, "h1": q + a, "gu": q + a + h, "end": q + a + h + i}
        if self.gemma:
            out["o"], out["dn"], out["end"] = out["end"], out["end"] + h, out["end"] + 2 * h
        if self.streams_down:
            out["g16"], out["end"] = out["end"], out["end"] + i // 2
        return out

    @property
    def mma(self) -> bool:
        """The products run on mma.sync (the X operand staged as [NPAD, BK] chunks, the ring in
        its operand order): at widths 2-8, and at width 1 with ``mma1`` (run 138: 4 % slower for
        bf16 and 29 % for FP8 than FMA at 8B, batch 1)."""
        return self.width > 1 or bool(self.mma1)

    # -- the mma path: down's input ------------------------------------------------------------
    @property
    def streams_down(self) -> bool:
        """Widths 2-8 stream down's input: each X chunk is copied (``cp.async``; with the
        ``cp.async`` ring in the weight chunk's commit group) into a small ring of X slots as its
        first weight chunk is asked for, and down's weight chunks run k-outer over the program's
        tiles (two accumulators), so each X chunk is copied once. The activations' task sums then
        pass through the staged input's first chunk, which no X slot uses. That frees the shared
        memory of the whole input (1B: 128 KiB at width 8) for a deeper ring (run 109). With
        ``stream_down`` 0 the whole input (NB rows x I, bf16) is staged beside the ring where it
        fits and a program has one down tile (1B), judged at width 1's ring."""
        if not self.mma:
            return False
        d = self.dims
        return (
            bool(self.stream_down)
            or self.tiles_per_program()[3] > 1
            or d.intermediate_size <= d.hidden_size
            or self._shared_bytes(self._slots_for(WEIGHT_RING), d.intermediate_size // BK, tma=False) > SMEM_PER_PROGRAM
        )

    @property
    def x_slots(self) -> int:
        """Streamed down: the X ring's slots. X chunk k is copied while the weight chunk ``ring - 1``
        ahead of the arithmetic is down's k-th with tile 0, and its slot is free once every tile
        has read chunk k - slots: slots * tiles >= ring + tiles - 1."""
        return self._x_slots(self.ring_slots)

    def _x_slots(self, ring_slots: int) -> int:
        if not self.streams_down:
            return 1
        td = self.tiles_per_program()[3]
        return -(-(ring_slots + td - 1) // td)

    @property
    def ring_slots(self) -> int:
        """The weight ring's slots: the plan's ``ring``, or ``WEIGHT_RING`` at width 1 and
        ``WIDE_RING`` at widths 2-8 where it fits (1B; not 8B, whose K/V ring takes the room);
        FP8 keeps the same bytes in flight (``_slots_for``)."""
        if self.ring:
            return self.ring
        return self._slots_for(WIDE_RING) if self._deep_ring_fits else self._slots_for(WEIGHT_RING)

    def _slots_for(self, bf16_slots: int) -> int:
        """The slots that keep as many bytes in flight (``slots - 1`` chunks) as ``bf16_slots`` of bf16."""
        return (bf16_slots - 1) * (ROWS * BK * 2) // self.chunk_bytes + 1

    @property
    def _deep_ring_fits(self) -> bool:
        """The mma path: a ring of ``WIDE_RING`` slots filled by TMA fits beside the staged input."""
        if not self.mma:
            return False
        slots = self._slots_for(WIDE_RING)
        return self._shared_bytes(slots, self._x_chunks(slots), tma=True) <= SMEM_PER_PROGRAM

    @property
    def x_chunks(self) -> int:
        """The staged input's [NPAD, BK] chunks (width 1: [BK] ones): down's whole input, or,
        streamed, the stages of K = hidden staged into the last chunks, the X ring in chunks
        1 .. x_slots and the sums of a task's warps in chunk 0."""
        return self._x_chunks(self.ring_slots)

    def _x_chunks(self, ring_slots: int) -> int:
        h, i = self.dims.hidden_size, self.dims.intermediate_size
        if self.streams_down:  # (an X slot holds a weight chunk's span of staged chunks)
            return max(h // BK, self.chunk_span * self._x_slots(ring_slots)) + 1
        return i // BK

    @property
    def down_early_chunks(self) -> int:
        """Down's first input chunks that gate/up's rounds but its last produce (gate/up's tile t,
        of round t // programs, makes outputs 8 t .. 8 t + 7; 8B: 13 of 14, 1B: 7 of 8). With
        ``early_down`` each program counts those rounds apart (counter 5), so down starts on these
        chunks at once and waits for the whole of gate/up only where its first task reaches chunk
        ``down_early_chunks``, instead of every program waiting for the grid's last gate/up tile at
        down's start (run 119, 8B batch 1: that wait is 6.2 µs a layer; run 122: 2.7 µs with it,
        and the step 0.5-2 % faster at 1B, 0.2-1 % at 8B, the next QKV wait taking up part of
        what down's gave back). The sums are the same; only when the input is staged changes.
        0: off (one round, or streamed down's first X copies need more)."""
        t1 = self.tiles_per_program()[2]
        span = self.chunk_span
        n = (t1 - 1) * self.programs * (ROWS // 2) // BK // span * span  # whole weight chunks
        if not self.early_down or n < 1:
            return 0
        if self.streams_down and n // span < (self.ring_slots - 2) // self.tiles_per_program()[3] + 1:
            return 0  # the X chunks copied at down's start (``XPRE``) would include a late one
        return n

    # -- attention ----------------------------------------------------------------------------
    @property
    def splits(self) -> int:
        """Context splits of a (row, KV head): the most that keep one attention task a program,
        a power of two (each row's own context is then cut into at most this many spans of at
        least ``MIN_SPLIT`` positions; a short context leaves the later splits empty)."""
        tasks = self.width * self.dims.num_kv_heads
        s = 1
        while 2 * s * tasks <= self.programs and 2 * s <= 64:
            s *= 2
        return s

    @property
    def partial_places(self) -> int:
        """fp32 places of the attention's split partials, [width, KV heads, splits, G, D + 2]
        (each split's output rows, their max and sum)."""
        d = self.dims
        return self.width * d.num_heads * self.splits * (d.head_dim + 2)

    @property
    def _kv_bytes(self) -> int:
        """The attention's K/V ring, which lives in the staged input from QKV's end to o_proj's staging."""
        return 2 * self.kv_slots * self.kv_tile * self.dims.head_dim * 2

    @property
    def kv_tile(self) -> int:
        """Positions one attention step reads: 16 (``kv_step`` 2: 32) a warp."""
        return KV_TILE * self.kv_groups

    @property
    def kv_groups(self) -> int:
        """16-position groups a warp's attention step reads: the plan's ``kv_step``, else 2 from
        width ``KV_STEP_2_FROM`` on where the heads are 64 wide (two 64 KiB K/V slots: 1B), else 1.
        Runs 119-120 (H100, 1B width 8): 2 % faster at 8k, 4 % at 32k, 1 % slower at 1k (its
        weight ring then has 3 slots filled by ``cp.async``, not 4 by TMA). One graph serves
        every context at a width, so the long contexts, where the width loses to the stock
        otherwise (0.98x), decide. At widths 1-4 it spills (8-56 bytes at sm_90) and was 1-4 %
        slower at 1k, level at 32k."""
        if self.kv_step is not None:
            return self.kv_step
        # by model and width alone, never by the other knobs: a knob that moves bytes must not
        # change the attention's sums (``check`` refuses a plan that does not fit beside it)
        return 2 if self.width >= KV_STEP_2_FROM and self.dims.head_dim <= 64 else 1

    @property
    def pads_att_sum(self) -> bool:
        """The attention task sums its warps' [16, D] fp32 partials through shared-memory rows
        padded by 32 bytes (``step_kernel._att_sum_layout``): the plan's ``att_pad``, else at
        widths up to ``ATT_PAD_MAX_WIDTH``. Unpadded, mma.sync's accumulator stores with 4-way
        bank conflicts (a lane quad's rows D * 4 bytes apart): 4 times the 64 ideal wavefronts a
        warp at D 128. Runs 178-180 (H100, batch 1): an 8B task 4.6 -> 3.7 µs (median), the step
        0.2-1.3 % faster in 13 of 14 cells. At widths 2 and 4 (1k, runs 179 and 181 on two
        cards) -1.6 to +2.2 %, 8B at width 2 slower in both (-1.4, -0.5 %), so unpadded; at
        width 8 the padded addresses spill 8-32 bytes at sm_90 (8B; 1B with the timeline's stamps)."""
        if self.att_pad is not None:
            return bool(self.att_pad)
        return self.width <= ATT_PAD_MAX_WIDTH

    @property
    def kv_slots(self) -> int:
        """Slots of the attention's K/V ring (each a [8 warps, 16 kv_step, D] K tile and its V
        tile): 3 of 32 KiB at head_dim 64 and 2 of 64 KiB at 128 or with 32 positions a warp
        (what fits beside the weight ring at width 1)."""
        return 3 if self.dims.head_dim * self.kv_groups <= 64 else 2

    @property
    def tma(self) -> bool:
        """The weight ring is filled by TMA at width 1 (run 101: 1-2 % faster than ``cp.async``),
        and at widths 2-8 in mma.sync's operand order where the ring is ``WIDE_RING`` deep (1B;
        run 109 on the H100: with down's input streamed and 4 slots, 2-5 % faster than the
        3-slot ``cp.async`` ring, which run 108 measured at 2.9 TB/s on the H200; at 8B's 3 slots
        TMA was level on the H100 and spills at widths 2 and 4), or as ``wide_tma`` says (the mma
        path at width 1 as at widths 2-8)."""
        if not self.mma:
            return True
        return self._deep_ring_fits if self.wide_tma is None else bool(self.wide_tma)

    def shared_bytes(self) -> int:
        """The kernel's shared memory (a lower bound: the compiler adds its scratch)."""
        return self._shared_bytes(self.ring_slots, self.x_chunks, self.tma)

    def _shared_bytes(self, ring_slots: int, x_chunks: int, tma: bool) -> int:
        """``shared_bytes`` with a ring of ``ring_slots`` (its mbarriers with ``tma``) and a staged
        input of ``x_chunks`` chunks."""
        ring = ring_slots * self.chunk_bytes + (ring_slots * 8 if tma else 0)  # slots and their mbarriers
        # the attention row's cos and sin, once a launch: fp32, or for Gemma-3 the full and the
        # sliding layers' tables as bf16 (the values are bf16-rounded; the same bytes, which 27B needs)
        rope = 2 * self.dims.head_dim * 4
        if not self.mma:
            stage = max(x_chunks * BK * 2, self._kv_bytes)  # bf16 staged input, the K/V ring in it
            return ring + stage + ROWS * 4 + rope
        stage = max(x_chunks * BK * NPAD * 2, self._kv_bytes)
        return ring + stage + ROWS * NPAD * 4 + rope

    def check(self) -> None:
        """Raise ValueError when this geometry cannot run (a planning error, not a user's)."""
        if self.programs < self.width * self.dims.num_kv_heads:
            raise ValueError(
                f"step launch: {self.programs} programs cannot hold one attention task per row and KV head "
                f"({self.width} x {self.dims.num_kv_heads})"
            )
        if self.gemma and self.mma:
            raise ValueError("step launch: Gemma-3's post norms are staged on width 1's FMA path only, not with mma1")
        if self.mma and self.tiles_per_program()[3] > 2:
            raise ValueError(
                f"step launch: on mma.sync a program keeps two down accumulators, so it takes two down tiles at "
                f"most; {self.dims.hidden_size // ROWS} tiles on {self.programs} programs need "
                f"{self.tiles_per_program()[3]}"
            )
        d = self.dims
        cols = BK * self.chunk_span
        if (d.hidden_size % cols and not self.gemma) or d.intermediate_size % cols:
            raise ValueError(
                f"step launch: [16, {cols}] weight chunks (span {self.chunk_span}) need hidden ({d.hidden_size}) and "
                f"intermediate ({d.intermediate_size}) sizes that are multiples of {cols}"
            )
        if (b := self.shared_bytes()) > SMEM_PER_PROGRAM:
            raise ValueError(f"step launch: {b} bytes of shared memory at width {self.width} exceed {SMEM_PER_PROGRAM}")

    def constexprs(self, block_size: int) -> dict[str, int | float]:
        """The kernel's compile-time constants over a paged cache of ``block_size`` positions a
        block (the layers a launch runs are a runtime argument: one build serves both launch shapes)."""
        d = self.dims
        t0, to, t1, td = self.tiles_per_program()
        a = self.act_offsets
        return {
            "HIDDEN": d.hidden_size,
            "INTER": d.intermediate_size,
            "QS": d.q_size,
            "KH": self.k_chunks,
            "GEMMA": int(self.gemma),
            "A_O": a.get("o", 0),
            "A_DN": a.get("dn", 0),
            "QH": d.num_heads,
            "KVH": d.num_kv_heads,
            "D": d.head_dim,
            "OFF_O": self.off_o,
            "OFF_GU": self.off_gu,
            "OFF_D": self.off_down,
            "LAYER_W": self.layer_weights,
            "A_ATT": a["att"],
            "A_H1": a["h1"],
            "A_GU": a["gu"],
            "A_G16": a.get("g16", 0),
            "XMAX": self.x_chunks,
            "XS": self.x_slots,
            "DSTREAM": int(self.streams_down),
            "LAYER_A": a["end"],
            "NPROG": self.programs,
            "NBUF": self.ring_slots,
            "T0": t0,
            "TO": to,
            "T1": t1,
            "TD": td,
            "NSPLIT": self.splits,
            "PW": self.kv_tile // NUM_WARPS,
            "KVS": self.kv_slots,
            "DE": self.down_early_chunks // self.chunk_span,  # in weight chunks
            "WX": self.chunk_span,
            "ONEBOX": int(self.tma and self.box_parts > 1),
            "APAD": int(self.pads_att_sum),
            "ONESUM": self.one_sum,
            "NB": self.width,
            "MMAV": int(self.mma),
            "TMA": int(self.tma),
            "BS": block_size,
            "EPS": d.rms_norm_eps,
            "SCALE": d.attn_scale,
            "FP8": int(self.weight_dtype == "fp8"),
            "LAYER_S": self.scale_offsets["end"],
        }
