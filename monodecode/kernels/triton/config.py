"""Launch configuration of the Triton K1/K2: tile sizes per target and the compile-time
constants of each width, derived from the shared plan. Pure Python (no torch, no triton), so
the CPU compile checks and the GPU launcher use exactly the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from monodecode.errors import ConfigError
from monodecode.kernels.plan import K1, K2, LayerPlan, ModelPlan, Stage, plan_model
from monodecode.model.dims import ModelDims

MAX_WIDTH = 16  # the widest step one dot tile covers (rows padded to 16)
# Hopper's SM (sm_90): 64K 32-bit registers, 228 KiB of shared memory, 2048 threads.
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
THREADS_PER_SM = 2048


@dataclass(frozen=True)
class Target:
    """What the kernels are compiled for: ``cuda`` (warp 32) or ``hip`` (wavefront 64)."""

    kind: str  # cuda | hip
    num_warps: int
    gemv_stages: int  # software-pipelining depth of the GEMV K loops
    attn_tile: int  # context positions per attention tile
    bk_narrow: int  # preferred K chunk at width 1 (FMA tile)
    bk_wide: int  # preferred K chunk at widths > 1 (dot tile)
    narrow_stages: int = 0  # pipelining depth at width 1 (smaller tiles, more of them in flight); 0 = gemv_stages
    # Flatten each GEMV stage's task loop with its K loop (``tl.range(flatten=True)``): one
    # software pipeline runs across task boundaries instead of draining at the end of every task.
    flatten: bool = False
    # FP8 at width 1: K chunks loaded per pipelined iteration (1-byte weights: the same bytes in
    # flight as bf16 without widening the accumulator) and the pipelining depth then (0 = as bf16).
    fp8_split: int = 1
    fp8_narrow_stages: int = 0
    # Mailbox format of the plan (``plan.MAILBOX_FORMATS``): bf16 activations + fp32 partials
    # synchronised by the completion counters alone, or the tagged 8-byte words.
    mailbox: str = "bf16"
    narrow_mailbox: str = ""  # the format at width 1 ("" = ``mailbox``)
    fp8_narrow_mailbox: str = ""  # the format at width 1 with FP8 weights ("" = ``narrow_mailbox``)
    # K1's QKV applies the pre-norm's rstd to its result, summing the squares as the input streams,
    # instead of a pass over the row before the weights start (``gemv`` SRC 4); at widths > 1 only
    # on QKV tiles of at least ``deferred_rstd_min_rows`` rows (``qkv_src``).
    deferred_rstd: bool = False
    deferred_rstd_min_rows: int = 0
    # No post stage where it only adds the residual and normalises (no post norms, o_proj not split
    # along K, bf16 mailbox): o_proj's tasks add the residual to their rows and gate/up applies the
    # norm on the way (``gemv`` SRC 5), so gate/up waits for o_proj instead of one program after it.
    fused_post: bool = False
    # Launch with the driver's co-residency check (cooperative launch; CUDA only).
    cooperative: bool = True
    # The GEMV rows chooser's fixed cost per task at widths > 1 (``plan.gemv_rows_per_task``).
    wide_task_bytes: int = 4096
    # The same at width 1 (``plan.gemv_rows_per_task``).
    narrow_task_bytes: int = 4096
    # Warps per program and pipelining depth at widths > 1 (dot tiles); 0 = as at width 1.
    wide_warps: int = 0
    wide_stages: int = 0
    # Software-pipelining depth of the attention context loop (1: a plain loop), and the same at
    # widths > 1 (0: ``attn_stages``). The K/V loads hang off the block-table loads, so the
    # compiler keeps K/V tiles (depth - 1) // 2 iterations ahead: 3 waits for every tile as it
    # is needed, 5 overlaps one tile's loads with the math of the one before.
    attn_stages: int = 1
    wide_attn_stages: int = 0
    # K1 loads each program's first attention task's first K/V tile before it waits for the qkv
    # stage (``attention.attn_first_tile``): older positions only, the newest from registers.
    # "qk_norm": only for layers with q/k-norm (their attention does more work after the wait
    # for the tile to hide behind), "all", or "" (never).
    attn_prefetch: str = ""
    # Context positions per attention tile where each task covers a row's whole context (widths
    # > 1 whose plan has one split per row; 0: ``attn_tile``): such a task streams every tile of
    # the row, so bytes in flight per program matter more than the masked tail of the last tile.
    whole_attn_tile: int = 0
    # Width 1: publish K1's QKV rows through a 1-D store. With the bf16 mailbox, the [rows, 1]
    # store's layout propagated back into the FMA tile (threads along rows: its shared-memory
    # reads conflict); the 1-D store keeps the tagged build's layout (timed: benchmarks/README.md,
    # runs 9-11).
    narrow_store_1d: bool = False
    # FP8 weights at widths > 1: ``widen`` them to bf16 in front of the bf16 matrix instructions,
    # or ``pair``: split each input chunk into two exact FP8 tiles and use FP8 matrix instructions
    # on the weights as loaded (``gemv.mma_fp8_pair``; e4m3fn, so CUDA only).
    fp8_wide: str = "widen"
    # The pipelining depth of FP8 GEMVs at widths > 1 (0: ``wide_stages``; 3 timed within 2 % of
    # the default 4, runs 60-61).
    fp8_wide_stages: int = 0
    # Widths > 1: the K chunk of each GEMV stage grows (powers of two, up to 512) until one
    # matrix's pipelined tiles hold this many bytes per program (0: always ``bk_wide``). Narrow
    # row tiles and 1-byte weights otherwise keep too few bytes in flight to stream at bandwidth.
    wide_inflight_bytes: int = 0
    qkv_inflight_bytes: int = 0  # the same for K1's QKV stage (0: ``wide_inflight_bytes``)
    # Widths > 1: split o_proj and down along K into at most this many slices where their row
    # tiles leave programs idle (``plan.split_k_slices``; 0: never). The fp32 partials are summed
    # in slice order by the stage that reads them (post, final), so results stay deterministic.
    wide_split_k: int = 0
    # Widths > 1: GEMV tasks whose tiles leave the grid's last wave partly idle are cut to fewer
    # rows, the same waves all full (``plan.even_wave_rows``; the tile keeps its size, the rows
    # past a task's share are masked). Never with the FP8 pair, whose tiles are bound by matrix
    # instructions, not bytes: a narrower task costs the same (run 20: FP8 b2-8 2 % slower).
    wide_even_waves: bool = False
    # Widths > 1: the last K slice of a split o_proj / down row tile to finish sums the tile's
    # partials in slice order and adds the residual (``k2._merge_tile``; an arrival
    # counter per tile), instead of a post / final stage of one task per row that every program
    # waits for: "all" (o_proj and down), "down", or "" (never). Only where those stages do
    # nothing else (``split_k_merges``).
    split_k_merge: str = ""
    # The narrowest GEMV row tile at widths > 1 (``plan.gemv_rows_per_task``), and the same for
    # the FP8 pair (``fp8_wide``): FP8 matrix instructions of the Hopper warp group take 64 rows;
    # narrower tiles fall back to widening in registers.
    wide_min_rows: int = 0
    # The rows chooser's bandwidth model at widths > 1 (``plan.gemv_rows_per_task``'s burst: how
    # much faster one program streams when fewer run; 0: whole waves at the average rate).
    wide_burst: float = 0.0
    fp8_pair_min_rows: int = 0
    # Width 1: keep ``bk_narrow`` when it does not divide K (the last chunk is masked) instead of
    # halving the chunk for every iteration (27B: K 5376 -> 256-wide chunks, whose bf16 input
    # rows are too narrow per thread for asynchronous copies, so they were never pipelined).
    narrow_tail: bool = False
    # Width 1 with BF16 weights: down in two K halves where gate/up spans at least this many waves
    # of the grid (``plan.early_down_waves``; 0: never): a program that finishes its gate/up tasks
    # streams the first half of its down tiles (gate/up's first half of rows is done by then)
    # instead of waiting for the grid's last gate/up task.
    early_down_waves: int = 0
    # Width 1: GEMV tasks cut to fill whole waves (``plan.even_wave_rows``: ``wide_even_waves``'
    # rule at width 1; where it cuts gate/up's tasks, down runs whole instead of in halves).
    narrow_even_waves: bool = False
    # K1's attention in a launch of its own (``ka.py``): a plain grid of ``attn_launch_warps``-warp
    # programs, several per SM, over ``attn_launch_splits`` context splits per (row, KV head)
    # (about ``attn_launch_tasks_per_sm`` tasks per SM, at most ``attn_launch_max_splits``).
    # Only with the bf16 mailbox. ``attn_launch_min_context`` 0: K1 keeps only its QKV stage;
    # N > 0: both are built and each layer of each step picks on device, the same in every program
    # of both launches: the attention launch when a row sees N positions or more in that layer (a
    # sliding layer at most its window), else K1's own stages (the attention launch's programs then
    # end at once). One graph serves every context.
    attn_launch: bool = False
    attn_launch_min_context: int = 0
    # A sliding layer whose window is shorter than ``attn_launch_min_context`` never attends in the
    # attention launch (its programs would end at once), so the host leaves the launch out there
    # (``attn_launch_on_layer``): Gemma-3's five of six layers. True issues it on every layer (the
    # build before session 32, for A/B runs).
    attn_launch_every_layer: bool = False
    attn_launch_warps: int = 4
    attn_launch_tile: int = 128
    attn_launch_stages: int = 3
    attn_launch_tasks_per_sm: int = 8
    attn_launch_max_splits: int = 32
    # Whole waves: ``(head_dim, programs)`` pairs, the attention launch's programs that reside on
    # an SM at once for heads of that many dimensions (what its registers and shared memory
    # allow: ``offline.cuda_resources``). For those heads the splits are not a power of two but
    # the most whose tasks fill that many programs on every SM once (at most
    # ``attn_launch_max_splits``): one wave of equal tasks, no part-full last wave while the
    # other programs idle. Other heads keep the power-of-two rule of ``attn_launch_tasks_per_sm``.
    attn_launch_slots_per_sm: tuple = ()
    # ``(head_dim, splits)`` pairs: the most splits for heads of that size where it is not
    # ``attn_launch_max_splits``.
    attn_launch_max_splits_per_head: tuple = ()
    # The last split of a (row, KV head) merges the group's query heads in one pass
    # (``attention.combine_group``: one load of every head's partials, in head_dim slices of at
    # most ``attn_launch_merge_elements`` fp32 values, (head_dim, values) pairs; 4096 for other
    # heads) instead of one head after another, each waiting for its own loads on the launch's
    # critical path. The sizes keep the launch's registers (sm_90 on the CPU: 8192 took 1B's
    # from 124 to 154, 3 programs per SM; 16384 8B's from 168 to 210). On for CUDA (run 78).
    attn_launch_group_merge: bool = False
    attn_launch_merge_elements: tuple = ((64, 4096), (128, 8192))
    # The tasks per SM above are for heads of this many dimensions; narrower heads get
    # proportionally fewer (longer) tasks, so a task's K/V bytes per position stay the same (0: not
    # scaled).
    attn_launch_head_dim: int = 0
    # Programmatic dependent launch (``overlap.py``; CUDA only): each launch lets the next one be
    # dispatched as it starts ("entry") or as its programs end ("exit"), whose programs wait on
    # the device for its end, instead of the stream starting the next launch after this one has
    # drained ("": off).
    pdl: str = ""
    # Registers per thread ptxas may use in the attention launch (CUDA; 0: its own choice): its
    # programs run in waves of as many as fit an SM, so registers set the waves' size.
    attn_launch_maxnreg: int = 0
    # Registers per thread ptxas may use in K1 and K2 (CUDA; 0: its own choice). Run 58 (one
    # 8-warp program per SM, before FP8 took two): ptxas held FP8 width-1 K1 to 128 registers and
    # spilled 72 bytes, but 255 (no spill) timed within 1 % everywhere. A cap must leave room for
    # ``programs_per_sm`` programs.
    maxnreg: int = 0
    # Programs per SM at widths > 1 (each of ``wide_warps`` warps; the persistent grid is this
    # many times the SMs). One 8-warp program per SM stalls on the CTA barrier in front of every
    # K chunk's matrix instructions (run 62: 2.3-2.6 of 6.4-7.3 cycles between issues); a second
    # program issues while the first waits. Its tiles must leave room for both (shared memory).
    wide_programs_per_sm: int = 1
    # The same three for FP8 weights at widths > 1 (0: as bf16): programs per SM, their warps, and
    # the bytes in flight per matrix and program that size every FP8 GEMV's K chunk (QKV's too).
    fp8_wide_programs_per_sm: int = 0
    fp8_wide_warps: int = 0
    fp8_wide_inflight_bytes: int = 0
    # K1's programs per SM with FP8 weights at widths > 1 where they differ from K2's (0: the
    # same). K1 on such a grid of its own compiles with the BF16 knobs at that width (warps,
    # stages, bytes in flight): those of the fewer, larger programs it then runs.
    fp8_wide_k1_programs_per_sm: int = 0
    # Programs per SM and their warps at width 1 (0: ``num_warps``), and the same with FP8 weights
    # (0: as bf16): FP8's width-1 loop waits on fixed-latency dependencies (run 62), which a
    # second program's warps cover.
    narrow_programs_per_sm: int = 1
    narrow_warps: int = 0
    fp8_narrow_programs_per_sm: int = 0
    fp8_narrow_warps: int = 0

    def _per_width(self, width: int, fp8: bool, what: str) -> int:
        """The ``narrow_<what>`` (width 1) or ``wide_<what>`` (widths > 1) knob, or its ``fp8_``
        twin where the weights are FP8 and it is set; 0 where neither is set."""
        kind = "wide" if width > 1 else "narrow"
        return (fp8 and getattr(self, f"fp8_{kind}_{what}")) or getattr(self, f"{kind}_{what}")

    def own_k1_grid(self, width: int, fp8: bool) -> bool:
        """Whether K1 runs on a grid of its own at ``width`` (``fp8_wide_k1_programs_per_sm``)."""
        return self.programs_per_sm(width, fp8, "k1") != self.programs_per_sm(width, fp8)

    def knob_fp8(self, width: int, kernel: str, fp8: bool) -> bool:
        """Whether ``kernel`` at ``width`` reads the ``fp8_`` knobs: FP8 weights, except K1 on a
        grid of its own (``fp8_wide_k1_programs_per_sm``), which reads the BF16 ones."""
        return fp8 and not (kernel == "k1" and self.own_k1_grid(width, fp8))

    def stages(self, width: int, fp8: bool = False) -> int:
        return self._per_width(width, fp8, "stages") or self.gemv_stages

    def attention_stages(self, width: int) -> int:
        return self.wide_attn_stages if width > 1 and self.wide_attn_stages else self.attn_stages

    def attention_tile(self, width: int, splits: int) -> int:
        """Context positions per attention tile for a plan with ``splits`` splits per row."""
        return self.whole_attn_tile if width > 1 and splits == 1 and self.whole_attn_tile else self.attn_tile

    def warps(self, width: int, kernel: str = "k1", fp8: bool = False) -> int:
        """Warps per program of ``kernel`` (k1, k2, or ka: the attention launch) at ``width``."""
        if kernel == "ka":
            return self.attn_launch_warps
        return self._per_width(width, self.knob_fp8(width, kernel, fp8), "warps") or self.num_warps

    def split(self, width: int, fp8: bool, k: int, bk: int) -> int:
        """K chunks per pipelined iteration of a GEMV over ``k`` with chunk ``bk``."""
        if width == 1 and fp8 and self.fp8_split > 1 and k % (bk * self.fp8_split) == 0:
            return self.fp8_split
        return 1

    def programs_per_sm(self, width: int, fp8: bool = False, kernel: str = "k2") -> int:
        """Programs of ``kernel``'s persistent grid (k1 or k2) per SM at ``width``."""
        names = [(f"{kind}_programs_per_sm", 1) for kind in ("wide", "narrow")]
        names += [(f"fp8_{kind}_programs_per_sm", 0) for kind in ("wide", "narrow", "wide_k1")]
        for name, lo in names:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= 4:
                raise ConfigError(f"triton kernels: {name} must be {lo}..4, got {v!r}")
        if kernel == "k1" and fp8 and width > 1 and self.fp8_wide_k1_programs_per_sm:
            return self.fp8_wide_k1_programs_per_sm
        return self._per_width(width, fp8, "programs_per_sm")

    def _per_head(self, name: str, what: str, head_dim: int) -> int:
        """The value knob ``name`` ((head_dim, value) pairs) gives heads of ``head_dim``
        dimensions (0: not given); a malformed table is refused in one line."""
        pairs = getattr(self, name)
        bad = not isinstance(pairs, (list, tuple)) or any(
            not isinstance(p, (list, tuple))
            or len(p) != 2
            or any(not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 65536 for v in p)
            for p in pairs
        )
        if bad:
            raise ConfigError(
                f"triton kernels: {name} must be (head_dim, {what}) pairs of positive integers, got {pairs!r}"
            )
        return dict((d, n) for d, n in pairs).get(head_dim, 0)

    def attn_launch_slots(self, head_dim: int) -> int:
        """The attention launch's resident programs per SM for heads of ``head_dim`` dimensions
        (``attn_launch_slots_per_sm``; 0: not given)."""
        return self._per_head("attn_launch_slots_per_sm", "programs", head_dim)

    def attn_launch_split_cap(self, head_dim: int) -> int:
        """The most context splits of the attention launch for heads of ``head_dim`` dimensions
        (``attn_launch_max_splits_per_head``, else ``attn_launch_max_splits``)."""
        return self._per_head("attn_launch_max_splits_per_head", "splits", head_dim) or self.attn_launch_max_splits

    def attn_launch_splits(self, width: int, kv_heads: int, num_programs: int, head_dim: int = 0) -> int:
        """Context splits per (row, KV head) in the attention launch: the largest power of two
        that keeps the tasks within ``attn_launch_tasks_per_sm`` per SM of ``num_programs`` SMs
        (scaled by ``head_dim`` over ``attn_launch_head_dim``), at most ``attn_launch_max_splits``
        (8B at 32k on the H200: 32 splits at batch 1, 16 at batch 8; 1B, 64-dimension heads: 8 at
        batch 8), or ``attn_launch_max_splits_per_head`` for ``head_dim``. With
        ``attn_launch_slots_per_sm`` for ``head_dim``: the most splits whose tasks fit its resident
        programs once, any count (8B, 3 per SM: 32 at batch 1, 6 at batch 8; 1B, 4 per SM and at
        most 64: 64 at batch 1, 8 at batch 8)."""
        slots = self.attn_launch_slots(head_dim)
        cap = self.attn_launch_split_cap(head_dim)
        if slots:
            return max(1, min(cap, slots * num_programs // (width * kv_heads)))
        per_sm = self.attn_launch_tasks_per_sm
        if self.attn_launch_head_dim and head_dim:
            per_sm = max(1, per_sm * head_dim // self.attn_launch_head_dim)
        per = max(1, per_sm * num_programs // (width * kv_heads))
        s = 1
        while s * 2 <= min(per, cap):
            s *= 2
        return s

    def to_dict(self) -> dict:
        return dict(self.__dict__)


CUDA = Target(
    "cuda",
    num_warps=8,
    gemv_stages=4,
    attn_tile=64,
    bk_narrow=512,
    bk_wide=128,
    # Runs 41-42 (batch 1): 1B 0.90 -> 0.87 ms both times, 8B 0.4-0.6 % faster, 27B within 0.5 %, than 6
    # stages; 4 was slower (8B 4.37 ms).
    narrow_stages=5,
    flatten=True,
    fp8_split=2,
    # Run 64 (8B, 8 layers, 1k b1): FP8 width 1 on two 4-warp programs per SM with 3 stages
    # 0.84 -> 0.72 ms (5 stages no longer fit two programs' shared memory); BF16 within 1 %.
    fp8_narrow_stages=3,
    fp8_narrow_programs_per_sm=2,
    fp8_narrow_warps=4,
    # Width 1 with the bf16 mailbox (benchmarks/README.md, runs 5-10): K1's QKV rows go out
    # through a 1-D store (a [rows, 1] store pulled a conflicting layout into the FMA tile), and
    # a larger fixed cost per task keeps 16-row tiles (27B gate/up otherwise drops to 8 rows).
    narrow_mailbox="bf16",
    narrow_store_1d=True,
    narrow_task_bytes=16384,
    narrow_tail=True,
    wide_task_bytes=65536,
    attn_stages=3,
    # 27B, 8 layers: run 151 b1 2.435 -> 2.430 ms at 1k, 2.453 -> 2.448 at 8k (the attention's
    # share of a layer's chain 11.6 -> 10.2 µs); run 152 b1 2.416 -> 2.394 and 2.441 -> 2.422 (b8,
    # where it is off, drew 2.648 and 2.642: one build twice). Llama-style layers lost with it:
    # 8B 1k b1 1.326 -> 1.331, b8 1.463 -> 1.511 (run 154), FP8 b2 0.969 -> 1.012, b8 1.068 ->
    # 1.125 (run 153).
    attn_prefetch="qk_norm",
    wide_attn_stages=5,  # batch 8: 27B 17.92 -> 17.43 ms, 8B 5.43 -> 5.34, 1B 1.40 -> 1.33 (run 16)
    fp8_wide="pair",
    fp8_pair_min_rows=64,
    # 27B batch 2/4: down's 336 16-row tasks -> 84 64-row ones, 21.1 -> 17.4 ms (runs 12-13);
    # 1B and 8B keep their tiles (forcing 32 or 64 rows made them 4-15 % slower); 1.5 changes
    # nothing else measured (qwen3-8b gate/up 32 -> 64 rows, like 8B's).
    wide_burst=1.5,
    wide_inflight_bytes=65536,  # what the 64-row bf16 gate/up tiles held when they streamed at bandwidth
    wide_split_k=4,  # 27B o_proj/down at widths > 1 (84 tiles on 132 SMs), FP8 8B's (64 tiles)
    # Run 19, batches 2-8: QKV 256-wide chunks (27B 16.93 -> 16.81 ms at b8, 8B 4.85 -> 4.78 at
    # b2) and 128-position tiles where one task covers a row's whole context (27B b8 -> 16.83);
    # both together 27B b8 16.67 ms. 8B QKV had lost 4 % with 256-wide chunks in run 14, before
    # the fused norm's weight was pipelined at that width.
    qkv_inflight_bytes=131072,
    whole_attn_tile=128,
    # Run 20: 27B b2-8 15.38-16.78 -> 14.74-16.08 ms (gate/up 336 -> 391 tasks, 3 full waves),
    # 8B b2-8 1-2 % faster. Not under the FP8 pair (``plan_for``).
    wide_even_waves=True,
    # Run 29: 8B b1 4.27 -> 4.23 ms, 27B b2 14.81 -> 14.52, FP8 b2 4.51 -> 4.39, but 1B b2-8 7-8 %
    # slower: its 32-row QKV tiles run on mma.sync, where the squares' accumulator made the input
    # reach the instruction through a register layout conversion instead of a shared-memory copy
    # (TTGIR on CPU). 64 rows: one Hopper warp-group instruction.
    deferred_rstd=True,
    deferred_rstd_min_rows=64,
    # Run 30: 1B b1-8 1.5-2.6 % faster, 8B b2-8 0.4-1.6 % (b1 4.14 -> 4.16 ms, within noise).
    fused_post=True,
    # Runs 32-33: 8B b1 4.22 -> 4.13 and 4.18 -> 4.11 ms, 27B 14.52 -> 14.41 and 14.30 -> 14.23
    # (gate/up 6.8 and 10.2 waves); 1B (3.9 waves) 0.90 -> 0.92-0.94, so not below 6 waves.
    early_down_waves=6,
    # Run 37: 27B b1 14.35 -> 14.13 ms (o_proj / down 336 -> 384 14-row tasks, gate/up 1344 ->
    # 1434 15-row ones: 3 and 11 full waves; down then whole). 1B and 8B tiles already fill theirs.
    narrow_even_waves=True,
    # Run 46 (8 layers timed): at 32k x 8 8B 4.38 -> 3.24 ms, 1B 2.69 -> 1.63; at 8k x 8 8B 1.95 ->
    # 1.76; at 1k 4-7 % slower (one more launch), so only where a layer sees 4096 positions or more.
    attn_launch=True,
    attn_launch_min_context=4096,
    # Run 52, batch 8: half the splits (4 tasks per SM) 1B 0.80 -> 0.75 ms at 8k, 1.55 -> 1.52 at
    # 32k; 8B 1.69 -> 1.73 and 3.17 -> 3.51. 1B's heads are 64-dimensional, 8B's 128.
    attn_launch_head_dim=128,
    # Run 69 (8 layers, batch 8): 128-dimensional heads in one wave of 3 programs per SM (6 splits
    # at batch 8, not 16 in 2.6 waves) 8B 8k 1.67 -> 1.60 ms, 32k 3.14 -> 3.03, FP8 1.50 -> 1.43,
    # 2.98 -> 2.87; batch 1 unchanged (32 splits either way). 1B's 64-dimensional heads fit 4 (the
    # rule above already gives them one wave; 3 was 7-10 % slower).
    attn_launch_slots_per_sm=((64, 4), (128, 3)),
    # Run 77 (8 layers): 64-dimensional heads split up to 64 ways, so batch 1's tasks fill the
    # one wave of 4 programs per SM (512 of 528; 32 splits left half the SMs' room idle): 1B
    # 32k b1 0.66 -> 0.61 ms, 8k b1 0.51 both, b8 unchanged (8 splits). 128-wide heads keep 32:
    # 8B at 49 (one wave of 3) was 3 % slower at 8k b1 and the same at 32k (run 71).
    attn_launch_max_splits_per_head=((64, 64),),
    # Runs 78-81 (8 layers): the group's heads merged in one pass, 1-3 % faster wherever the
    # attention launch runs (8B 8k b1 1.15 -> 1.13 ms, b4 1.37 -> 1.34; FP8 8k b1 0.80 -> 0.77,
    # 32k b4 1.93 -> 1.89; 1B and 27B within 1 %), the same at 1k. Storing the newest position
    # without a barrier and attending to it after the tiles (run 78) was not faster: dropped.
    attn_launch_group_merge=True,
    # Run 50, widths 2-8 at 1k (8 layers): 64-row tiles with o_proj / down split along K and merged by
    # their last slice: 1B b2 0.57 -> 0.46 ms, b8 0.63 -> 0.53; 8B b2 1.15 -> 1.07, b8 1.25 -> 1.16;
    # FP8 b8 1.25 -> 1.18 (``benchmarks/gemv_probe.py``, run 48: 32-row tiles stream at 2.5-3.1 TB/s,
    # 64-row ones split in two or four at 3.1-3.8, as width 1 and cuBLAS do).
    wide_min_rows=64,
    split_k_merge="all",
    # Runs 55-56 (8 layers, same run): 1B 1k b1/b2/b8 0.46/0.47/0.55 -> 0.45/0.46/0.54 ms, 8B 1k
    # 1.08-1.09 -> 1.07-1.08 at b1, FP8 b1 0.84 -> 0.83; 8k within 1 %. "entry" was 5-17 % slower
    # (runs 54-55), and L2 prefetches of each stage's first weights before its wait 2-10 % (run 54).
    pdl="exit",
    # Run 63 (8 layers, 1k b2 / b8, 8k b8): FP8 on two 4-warp programs per SM 1.10 -> 0.97,
    # 1.18 -> 1.04, 1.70 -> 1.55 ms; the same tiles on one 4-warp program 1.17 / 1.28 / 1.75, so
    # the second program's issue slots pay, not the tiles. BF16 lost with it (8B b8 1.16 -> 1.31).
    fp8_wide_programs_per_sm=2,
    fp8_wide_warps=4,
    fp8_wide_inflight_bytes=32768,
    # Run 67 (8 layers): FP8 K1 at widths > 1 back on one 8-warp program per SM (its 96 64-row QKV
    # tasks had half the warps on two), K2 on two: 1k b2 / b4 / b8 0.96 / 1.00 / 1.05 -> 0.90 /
    # 0.94 / 0.98 ms, 8k b8 1.56 -> 1.51, 32k b8 3.07 -> 3.02.
    fp8_wide_k1_programs_per_sm=1,
)
# CDNA: 64 KiB of LDS on gfx942, so no multi-stage LDS ring; loads go straight to registers.
HIP = Target("hip", num_warps=4, gemv_stages=1, attn_tile=32, bk_narrow=256, bk_wide=64)


def compile_options(target: Target, width: int = 1, kernel: str = "k1", fp8: bool = False) -> dict:
    """Triton's compile options for ``kernel`` (k1, k2, ka) at ``width`` (``fp8``: FP8 weights):
    what the launcher, the cache warmer and the offline compile checks all pass."""
    for name in ("maxnreg", "attn_launch_maxnreg"):
        v = getattr(target, name)
        if v and not 24 <= v <= 255:
            raise ConfigError(f"triton kernels: {name} must be 0 or 24..255, got {v}")
    opts = {"num_warps": target.warps(width, kernel, fp8)}
    if target.kind == "cuda" and target.pdl:  # "entry" | "exit"
        opts["launch_pdl"] = True  # programmatic dependent launch (``overlap.py``)
    maxnreg = target.attn_launch_maxnreg if kernel == "ka" else target.maxnreg
    if target.kind == "cuda" and maxnreg:
        opts["maxnreg"] = maxnreg
    # the persistent launches need every program resident; the attention launch (ka) is a plain grid
    if target.kind == "cuda" and target.cooperative and kernel != "ka":
        opts["launch_cooperative_grid"] = True  # the driver refuses a grid that cannot be co-resident
    return opts


def cuda_programs_per_sm(
    regs: int, num_warps: int, shared: int, regs_per_sm: int = REGS_PER_SM, smem_per_sm: int = SMEM_PER_SM
) -> int:
    """Programs of a compiled CUDA kernel one SM holds at once: registers go to warps in blocks of
    256 (8 per thread), each program's shared memory has 1 KiB reserved beside it, and an SM runs
    at most ``THREADS_PER_SM`` threads."""
    threads = 32 * num_warps
    by_regs = regs_per_sm // (-(-max(regs, 1) // 8) * 8 * threads)
    by_smem = smem_per_sm // (shared + 1024)
    return min(by_regs, by_smem, THREADS_PER_SM // threads)


def assumed_programs_per_sm(target: Target, plan: LayerPlan, fp8: bool) -> dict[str, int]:
    """Programs per SM the launches of one width are planned for: K1's and K2's persistent grids
    (``programs_per_sm``), and the attention launch's whole waves where its head size has a count
    (``attn_launch_slots_per_sm``; its power-of-two rule assumes none)."""
    w = plan.width
    want = {"k1": target.programs_per_sm(w, fp8, K1), "k2": target.programs_per_sm(w, fp8)}
    if attn_launch(target, plan) and target.attn_launch_slots(plan.local.head_dim):
        want["ka"] = target.attn_launch_slots(plan.local.head_dim)
    return want


def residency_misfits(target: Target, plan: LayerPlan, fp8: bool, resident: dict[str, int]) -> list[str]:
    """The launches of one width that hold fewer programs per SM (``resident``: kernel -> programs,
    from the compiled code) than they are planned for. K1 / K2: the cooperative launch refuses
    the grid (the step falls back). The attention launch: its splits run in more waves than
    planned, exact but slower, so a timing of that build measures a plan that does not fit."""
    return [
        f"width {plan.width} {kernel}: {resident[kernel]} programs per SM, planned for {n}"
        for kernel, n in assumed_programs_per_sm(target, plan, fp8).items()
        if kernel in resident and resident[kernel] < n
    ]


def plan_for(
    dims: ModelDims, widths, num_programs: int, target: Target, tp_size: int = 1, fp8: bool = False
) -> ModelPlan:
    """The shared plan of these kernels for ``target`` (its mailbox formats and tile costs) on
    ``num_programs`` SMs (``Target.programs_per_sm`` programs on each)."""
    narrow = (target.fp8_narrow_mailbox if fp8 else "") or target.narrow_mailbox
    return plan_model(
        dims,
        tp_size,
        list(widths),
        num_programs * target.programs_per_sm(1, fp8),
        mailbox=target.mailbox,
        narrow_mailbox=narrow or None,
        wide_task_bytes=target.wide_task_bytes,
        narrow_task_bytes=target.narrow_task_bytes,
        wide_burst=target.wide_burst,
        wide_split_k=target.wide_split_k,
        wide_even_waves=target.wide_even_waves and not _fp8_pair(target, fp8),
        # FP8 weights keep down whole: their GEMVs are bound by instructions, not bytes, so the
        # wait is short and the second pipeline ramp per stage costs more (run 33: 9 % slower)
        early_down_waves=0 if fp8 else target.early_down_waves,
        narrow_even_waves=target.narrow_even_waves,
        wide_workgroups=num_programs * target.programs_per_sm(2, fp8),
        wide_k1_workgroups=num_programs * target.programs_per_sm(2, fp8, K1),
        wide_min_rows=max(target.wide_min_rows, target.fp8_pair_min_rows if _fp8_pair(target, fp8) else 0),
    )


def target_for(kind: str) -> Target:
    if kind in ("cuda",):
        return CUDA
    if kind in ("hip", "rocm"):
        return HIP
    raise ConfigError(f"triton kernels: no target for platform kind {kind!r}")


def gemv_chunk(target: Target, width: int, stage: Stage, fp8: bool) -> int:
    """The K chunk of one GEMV stage: ``bk_narrow`` at width 1; at widths > 1 ``bk_wide``, grown
    until rows x chunk x weight bytes x pipeline depth reaches ``wide_inflight_bytes``."""
    k = stage.k_per_task
    if width == 1:
        if target.narrow_tail and k >= target.bk_narrow and k % 16 == 0:
            return target.bk_narrow
        return k_chunk(k, target.bk_narrow)
    preferred = target.bk_wide
    knob_fp8 = target.knob_fp8(width, stage.kernel, fp8)
    per_chunk = stage.tile * (1 if fp8 else 2) * target.stages(width, knob_fp8)
    inflight = target.wide_inflight_bytes
    if stage.name == "qkv" and target.qkv_inflight_bytes:
        inflight = target.qkv_inflight_bytes
    if knob_fp8 and target.fp8_wide_inflight_bytes:
        inflight = target.fp8_wide_inflight_bytes
    # The FP8 pair holds the input chunk as fp32 twice over: past 256 columns K2 spills
    # (ptxas, llama3-8b width 8: 255 registers and 288 bytes of spills at 512).
    most = 256 if _fp8_pair(target, fp8) else 512
    while preferred < most and per_chunk * preferred < inflight:
        preferred *= 2
    return k_chunk(k, preferred)


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def k_chunk(k: int, preferred: int) -> int:
    """The K chunk of a GEMV: ``preferred``, or the largest smaller power of two dividing ``k``."""
    bk = preferred
    while bk >= 16:
        if k % bk == 0:
            return bk
        bk //= 2
    raise ConfigError(f"triton kernels: no K chunk (power of two >= 16) divides {k}")


def check_dims(dims: ModelDims, widths: tuple[int, ...]) -> None:
    """Shape limits of these kernels; each violation is one line."""
    d = dims.head_dim
    if d < 32 or d & (d - 1):
        raise ConfigError(f"triton kernels: head_dim must be a power of two >= 32, got {d}")
    if dims.gqa_group > 16:
        raise ConfigError(f"triton kernels: at most 16 query heads per KV head, got {dims.gqa_group}")
    bad = [w for w in widths if not 1 <= w <= MAX_WIDTH]
    if bad:
        raise ConfigError(f"triton kernels: widths must be in 1..{MAX_WIDTH}, got {bad}")


def qkv_src(target: Target, width: int, tile: int) -> int:
    """K1's QKV input (``gemv.gemv_task`` SRC): 4 with ``Target.deferred_rstd`` at width 1 and on
    tiles of at least ``deferred_rstd_min_rows``, else 0 (rstd from a pass over the row first)."""
    if target.deferred_rstd and (width == 1 or tile >= target.deferred_rstd_min_rows):
        return 4
    return 0


def _fp8_pair(target: Target, fp8: bool) -> bool:
    """Whether FP8 weights take the FP8 pair at widths > 1 (``Target.fp8_wide``)."""
    if target.fp8_wide not in ("widen", "pair"):
        raise ConfigError(f"triton kernels: fp8_wide must be 'widen' or 'pair', got {target.fp8_wide!r}")
    return fp8 and target.fp8_wide == "pair"


def pdl_mode(target: Target) -> int:
    """``overlap.py``'s ``PDL`` constant: 0 off, 1 "entry", 2 "exit" (CUDA only; the interpreter
    ignores it)."""
    if target.pdl not in ("", "entry", "exit"):
        raise ConfigError(f"triton kernels: pdl must be '', 'entry' or 'exit', got {target.pdl!r}")
    return {"": 0, "entry": 1, "exit": 2}[target.pdl] if target.kind == "cuda" else 0


def _stage(plan: LayerPlan, kernel: str, name: str):
    return plan.stage(kernel, name)


def _word(plan: LayerPlan, region: str) -> int:
    return plan.region(region).word_offset


def _attention_shape(L) -> dict:
    """The head geometry K1's and the attention launch's attention tasks are compiled for."""
    return dict(
        NQKV=L.qkv, Q=L.q, KV=L.kv, D=L.head_dim, G=L.group, GP=max(16, _pow2(L.group)), KVH=L.kv_heads, H=L.heads
    )


# The most bytes of K/V a thread of K1 holds across its wait for the qkv stage (``attn_prefetch``):
# FP8 width 1's 4-warp programs at 256 (a 64-position tile of 128-wide heads) spilled 264 bytes.
ATTN_PREFETCH_BYTES_PER_THREAD = 128


def attn_prefetch(target: Target, dims: ModelDims, plan: LayerPlan, fp8: bool) -> bool:
    """Whether K1 loads its first attention tile before the wait for the qkv stage
    (``Target.attn_prefetch``): only for the layers its mode names, and where the tile's K and
    V (bf16) fit a thread's share."""
    mode = target.attn_prefetch
    if mode not in ("", "qk_norm", "all"):
        raise ConfigError(f"triton kernels: attn_prefetch must be '', 'qk_norm' or 'all', got {mode!r}")
    if not mode or (mode == "qk_norm" and not dims.qk_norm):
        return False
    W = plan.width
    tile_bytes = target.attention_tile(W, plan.attn_splits) * plan.local.head_dim * 2 * 2
    threads = target.warps(W, K1, fp8) * 32
    return tile_bytes <= ATTN_PREFETCH_BYTES_PER_THREAD * threads


def k1_constexprs(
    dims: ModelDims,
    plan: LayerPlan,
    target: Target,
    block_size: int,
    vp: int = 1,
    fp8: bool = False,
    prof: bool = False,
) -> dict:
    L = plan.local
    W = plan.width
    qkv = _stage(plan, K1, "qkv")
    attn = _stage(plan, K1, "attn")
    comb = _stage(plan, K1, "combine")
    wide = W > 1
    bk = gemv_chunk(target, W, qkv, fp8)
    ka = attn_launch(target, plan)  # the attention launch runs the attn and combine stages (K1 skips them)
    ka_min = target.attn_launch_min_context if ka else 0  # ... from this context on (0: always)
    return dict(
        HIDDEN=L.hidden,
        **_attention_shape(L),
        S=plan.attn_splits,
        BS=block_size,
        BT=target.attention_tile(W, plan.attn_splits),
        W=W,
        WP=max(16, _pow2(W)) if wide else 1,
        BN=qkv.tile,
        QKV_ROWS=qkv.rows_per_task,
        BK=bk,
        NUM_STAGES=target.stages(W, target.knob_fp8(W, K1, fp8)),
        SPLIT=target.split(W, fp8, L.hidden, bk),
        QKV_TASKS=qkv.num_tasks,
        QKV_OFF=qkv.offset,
        ATTN_TASKS=attn.num_tasks,
        ATTN_OFF=attn.offset,
        COMB_TASKS=comb.num_tasks,
        COMB_OFF=comb.offset,
        EPOCH_W=_word(plan, "epoch_k1"),
        DONE_W=_word(plan, "done_k1"),
        QKV_W=_word(plan, "qkv"),
        ACC_W=_word(plan, "attn_acc"),
        ML_W=_word(plan, "attn_ml"),
        NPROG=plan.workgroups(K1),
        PROF_GRID=prof_grid(plan),
        VP=vp,
        QK_NORM=dims.qk_norm,
        ONE_PLUS=dims.norm_one_plus,
        FP8=fp8,
        FLAT=target.flatten,
        BF16MB=plan.mailbox == "bf16",
        PROF=prof,
        ATTN_STAGES=target.attention_stages(W),
        STORE_1D=target.narrow_store_1d,
        QKV_SRC=qkv_src(target, W, qkv.tile),
        FP8_PAIR=wide and _fp8_pair(target, fp8),
        ATTN_LAUNCH=ka,
        KA_MIN_CTX=ka_min,
        PDL=pdl_mode(target),
        ATTN_PREFETCH=attn_prefetch(target, dims, plan, fp8),
    )


def prof_grid(plan: LayerPlan) -> int:
    """Program slots per kernel in the stage timestamps of a width (``timeline.py``): the
    larger of K1's and K2's grids."""
    return max(plan.workgroups(K1), plan.workgroups(K2))


def split_k_merges(target: Target, plan: LayerPlan) -> tuple[bool, bool]:
    """Whether K2's split o_proj / down tiles are summed by their last slice
    (``Target.split_k_merge``, with the fused post's gate/up): where the plan allows it
    (``LayerPlan.split_k_merge_eligible``)."""
    if target.split_k_merge not in ("", "down", "all"):
        raise ConfigError(f"triton kernels: split_k_merge must be '', 'down' or 'all', got {target.split_k_merge!r}")
    ok = bool(target.split_k_merge) and target.fused_post
    o, d = plan.split_k_merge_eligible
    return ok and target.split_k_merge == "all" and o, ok and d


def k2_arrive_counters(plan: LayerPlan, target: Target) -> int:
    """Arrival counters K2 needs for ``split_k_merge``: one per merged o_proj / down row tile."""
    merged = split_k_merges(target, plan)
    stages = [_stage(plan, K2, name) for name, m in zip(("o_proj", "down"), merged, strict=True) if m]
    return sum(s.num_tasks // s.k_splits for s in stages)


def attn_launch(target: Target, plan: LayerPlan) -> bool:
    """Whether this width has the attention launch (``ka.py``): it reads plain bf16 values, so a
    width with the tagged mailbox keeps its attention in K1."""
    return target.attn_launch and plan.mailbox == "bf16"


def attn_launch_on_layer(target: Target, window: int) -> bool:
    """Whether a layer of a width that has the attention launch issues it: not on a sliding layer
    (``window`` > 0) that sees fewer positions than ``attn_launch_min_context`` at any context,
    where ``ka.long_context`` is false in every step (``Target.attn_launch_every_layer``)."""
    short = 0 < window < target.attn_launch_min_context
    return target.attn_launch_every_layer or not short


def ka_constexprs(dims: ModelDims, plan: LayerPlan, target: Target, block_size: int, fp8: bool = False) -> dict:
    """Constants of the attention launch (``ka.py``) of one width."""
    L = plan.local
    sms = plan.num_workgroups // target.programs_per_sm(plan.width, fp8)
    splits = target.attn_launch_splits(plan.width, L.kv_heads, sms, L.head_dim)
    return dict(
        **_attention_shape(L),
        S=splits,
        SP=_pow2(splits),
        BS=block_size,
        BT=target.attn_launch_tile,
        W=plan.width,
        QKV_TASKS=_stage(plan, K1, "qkv").num_tasks,
        EPOCH_W=_word(plan, "epoch_k1"),
        DONE_W=_word(plan, "done_k1"),
        QKV_W=_word(plan, "qkv"),
        NPROG=plan.workgroups(K1),  # K1's launch counter: the epoch
        QK_NORM=dims.qk_norm,
        ONE_PLUS=dims.norm_one_plus,
        ATTN_STAGES=target.attn_launch_stages,
        KA_MIN_CTX=target.attn_launch_min_context,
        PDL=pdl_mode(target),
        **_group_merge(target, L, _pow2(splits)),
    )


def _group_merge(target: Target, L, sp: int) -> dict:
    """The attention launch's group merge (``Target.attn_launch_group_merge``): the group's
    heads rounded up to a power of two (``GQ``) and the head_dim slice merged at once (``DC``,
    a power of two: GQ x ``sp`` (the splits' SP) x DC fp32 values within the head size's
    ``attn_launch_merge_elements``); 0 when off."""
    if not target.attn_launch_group_merge:
        return dict(GQ=0, DC=0)
    n = target._per_head("attn_launch_merge_elements", "values", L.head_dim) or 4096
    gq = _pow2(L.group)
    dc = L.head_dim
    while dc > 1 and gq * sp * dc > n:
        dc //= 2
    return dict(GQ=gq, DC=dc)


def k2_constexprs(
    dims: ModelDims, plan: LayerPlan, target: Target, vp: int = 1, fp8: bool = False, prof: bool = False
) -> dict:
    L = plan.local
    W = plan.width
    wide = W > 1
    o = _stage(plan, K2, "o_proj")
    post = _stage(plan, K2, "post")
    gu = _stage(plan, K2, "gate_up")
    dn = _stage(plan, K2, "down")
    final = [s for s in plan.k2 if s.name == "final"]
    gu_lo = [s for s in plan.k2 if s.name == "gate_up_lo"]
    if plan.tp_size != 1:
        raise ConfigError("triton kernels: only tp_size 1 is implemented")
    o_part, d_part = o.k_splits > 1, dn.k_splits > 1
    o_merge, d_merge = split_k_merges(target, plan)
    no_post = target.fused_post and (plan.fused_post_eligible or o_merge)
    run_final = bool(final) and not d_merge  # a merged down leaves the final stage nothing
    o_word = _word(plan, "o_part" if o_part else "o")
    o_bk = gemv_chunk(target, W, o, fp8)
    gu_bk = gemv_chunk(target, W, gu, fp8)
    d_bk = gemv_chunk(target, W, dn, fp8)
    return dict(
        HIDDEN=L.hidden,
        HP=_pow2(L.hidden),
        Q=L.q,
        I=L.intermediate,
        W=W,
        WP=max(16, _pow2(W)) if wide else 1,
        O_BN=o.tile,
        O_ROWS=o.rows_per_task,
        O_BK=o_bk,
        GU_BN=gu.tile,
        GU_ROWS=gu.rows_per_task,
        GU_BK=gu_bk,
        D_BN=dn.tile,
        D_ROWS=dn.rows_per_task,
        D_BK=d_bk,
        NUM_STAGES=target.stages(W, fp8),
        O_SPLIT=target.split(W, fp8, L.q, o_bk),
        GU_SPLIT=target.split(W, fp8, L.hidden, gu_bk),
        D_SPLIT=target.split(W, fp8, dn.k_per_task, d_bk),  # down's halves are equal: one split for both
        O_TASKS=o.num_tasks,
        O_KS=o.k_splits,
        O_OFF=o.offset,
        POST_OFF=post.offset,
        GU_TASKS=gu.num_tasks,
        GU_OFF=gu.offset,
        D_TASKS=dn.num_tasks,
        D_KS=dn.k_splits,
        D_OFF=dn.offset,
        FIN_OFF=final[0].offset if final else 0,
        EPOCH_W=_word(plan, "epoch_k2"),
        DONE_W=_word(plan, "done_k2"),
        O_W=o_word,
        H_W=_word(plan, "h"),
        HN_W=_word(plan, "hn"),
        ACT_W=_word(plan, "act"),
        D_W=_word(plan, "d_part" if d_part else "d") if final else o_word,  # unused without final or a split
        NPROG=plan.workgroups(K2),
        PROF_GRID=prof_grid(plan),
        VP=vp,
        POST_NORMS=dims.post_norms,
        FINAL=run_final,
        ONE_PLUS=dims.norm_one_plus,
        FP8=fp8,
        GELU=dims.activation == "gelu_tanh",
        FLAT=target.flatten,
        BF16MB=plan.mailbox == "bf16",
        PROF=prof,
        FP8_PAIR=wide and _fp8_pair(target, fp8),
        NO_POST=no_post,
        O_MERGE=o_merge,
        D_MERGE=d_merge,
        GU_LO_TASKS=gu_lo[0].num_tasks if gu_lo else 0,
        GU_LO_OFF=gu_lo[0].offset if gu_lo else 0,
        GU_ROW0=gu.row0,
        D_K0=dn.k0,
        D_LO_W=_word(plan, "d_lo") if gu_lo else 0,
        PDL=pdl_mode(target),
    )


def constexprs(
    dims: ModelDims,
    mplan: ModelPlan,
    width: int,
    target: Target,
    block_size: int,
    fp8: bool,
    interpret: bool = False,
    prof: bool = False,
) -> tuple[dict, ...]:
    """``interpret``: for the interpreter, where one program plays every program of its
    launch's grid (``VP``); ``prof``: compile in the stage timestamps (``timeline.py``; CUDA
    only). K1's and K2's constants, then the attention launch's where it has one (``attn_launch``)."""
    plan = mplan.layers[width]
    ka = (ka_constexprs(dims, plan, target, block_size, bool(fp8)),) if attn_launch(target, plan) else ()
    vp1, vp2 = (plan.workgroups(K1), plan.workgroups(K2)) if interpret else (1, 1)
    return (
        k1_constexprs(dims, plan, target, block_size, vp1, bool(fp8), prof),
        k2_constexprs(dims, plan, target, vp2, bool(fp8), prof),
        *ka,
    )
