"""The shared kernel plan (``monodecode/kernels/plan.py``) as the FlyDSL kernels consume it.

Everything the plan decides is taken from it, never recomputed here: the grid (one workgroup
per CU), every stage of K1/K2 with its task count, rotation offset and GEMV rows per task, the
attention context splits, and the mailbox regions of a width's scratch segment with the
per-width epoch and stage completion counters. The mailbox format (``plan.MAILBOX_FORMATS``) is
``mailbox_format``'s: bf16 activations and fp32 attention partials synchronised by the stages'
completion counters on one GPU; tagged 8-byte words (fp32 value + epoch tag, written and polled
at system scope) across the ranks of a TP group, whose peer buffers carry no counters. ``launch_description`` states
what the backend launches (grid, stage tables, absolute region offsets in the one scratch
buffer, health word) so a test can hold it against ``plan_model`` and fail on any divergence.

What the plan leaves to a backend lives here too, and only that (FlyDSL/CDNA specific):

* GEMV tiles: the task's input rows are staged in LDS as bf16 in chunks of ``chunk`` elements
  (zero padded to a whole step; rows 16 bytes apart more than their length, against bank
  conflicts). Narrow steps (width < MFMA_MIN_WIDTH) use FMA: the task's rows are split over the
  workgroup's 4 waves (``rows_per_wave``), each wave walks them in register groups
  (``row_group``) over K in 16-byte-per-lane steps, with per-row partial sums in LDS when there
  is more than one chunk. Wider steps use MFMA 16x16 tiles (16 weight rows x 16 token columns,
  tokens padded): the waves split the task's tiles and, when there are fewer than 4, K
  (``k_split``); the tiles' sums meet in LDS for the epilogue;
* the one LDS arena per kernel and how stages carve it (stages run one after another, so the
  GEMV staging area and the attention buffers alias);
* ``fused_post`` (``FUSED_POST``, on wherever the plan's ``LayerPlan.fused_post_eligible`` holds):
  K2 runs no post stage; o_proj publishes h, gate/up computes h's rstd itself (``Geometry.fused_post``);
* the split-K merge (``SPLIT_K_MERGE``, ``Geometry.o_merge`` / ``d_merge``): where the plan splits
  o_proj and/or down along K and the post / final stage would only add the residual (no post
  norms, one rank, bf16 mailbox, fused post), the last K slice of each row tile to arrive sums
  the tile's fp32 partials in slice order and adds the residual itself (h for o_proj, x_out for
  down), so K2 runs neither stage. The arrival counters (one int64 per merged row tile, monotonic:
  every launch adds exactly ``k_splits`` to each) are a K2 argument the launcher allocates zeroed
  (``arrive_counters``), like the Triton kernels';
* shape limits of these kernels (each one clear error line).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from monodecode.errors import ConfigError
from monodecode.kernels.flydsl.arch import WAVE_SIZE, WAVES_PER_WORKGROUP, ArchSpec, arch_spec
from monodecode.kernels.plan import DONE_STAGES, K1, K2, LayerPlan, LocalDims, ModelPlan, Stage, plan_layer, plan_model
from monodecode.model.dims import ModelDims
from monodecode.model.weights import WEIGHT_DTYPES

MAX_WIDTH = 16  # rows per step: accumulators of a GEMV row group and LDS staging scale with it
MAX_TP = 8
MFMA_MIN_WIDTH = 2  # FMA would unpack every token's activations per weight (VALU-bound); idle MFMA columns cost less
MFMA_ROWS = 16  # rows (and token columns) of one 16x16 MFMA tile
HEALTH = "health"  # the plan's header region: the sticky health word (int32)
ATTN_CHUNK = WAVE_SIZE  # context positions one wave scores at a time (one per lane)
NEG_BIG = -1.0e30  # an empty split's running max, as the Triton kernels publish it

_MAX_I32_BYTES = 2**31 - 1  # buffer-load byte offsets are i32
# The plan's tiling knobs these kernels take at widths > 1: a GEMV stage whose row tiles leave
# CUs idle is split along K into fp32 partials (``plan.split_k_slices``, at most 4 slices,
# summed in slice order by the stage that reads them), and tasks are cut to fewer rows of the
# same tile so that the same number of waves is full (``plan.even_wave_rows``). The rule is wave
# arithmetic on the grid, not a measurement on these GPUs; the Triton kernels timed it on the
# H200 (benchmarks/README.md, runs 15 and 20).
PLAN_KNOBS = {"wide_split_k": 4, "wide_even_waves": True}
# K2 without its post stage where the plan allows it (``LayerPlan.fused_post_eligible``: no post
# norms, one rank, o_proj unsplit): o_proj's tasks publish h = x + o, gate/up waits for o_proj
# and normalises h on the way in. A post stage of one workgroup per row leaves every other CU
# waiting on it; the Triton kernels dropped it (``Target.fused_post``, H200 run 30).
FUSED_POST = True
# K2 without the post / final stage that only sums a split o_proj / down's K slices and adds the
# residual: the last slice of each row tile to finish does it (``Geometry.o_merge`` / ``d_merge``,
# ``split_k_merges``; the Triton kernels' ``split_k_merge="all"``, H200 run 50: llama3-1b batch 2
# 0.57 -> 0.46 ms over 8 layers). Needs ``FUSED_POST`` for o_proj (gate/up then normalises h).
SPLIT_K_MERGE = True


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def first_task(workgroup, offset: int, grid: int):
    """The first task of a stage that ``workgroup`` runs; it then runs every ``grid``-th task.

    Works on Python ints (tests) and on traced i32 values (the kernels): the same expression
    the plan's ``Stage.tasks_of`` evaluates, ``(b - offset) mod G``, kept non-negative.
    """
    return (workgroup + (grid - offset)) % grid


def task_count(first, tasks: int, grid: int):
    """How many tasks of a stage a workgroup runs from its ``first`` one (``first < tasks``): what
    it adds to the stage's completion counter. Python ints (tests) or traced i32 (the kernels)."""
    return (tasks - 1 + grid - first) // grid


def mailbox_format(tp_size: int) -> str:
    """The plan's mailbox format the FlyDSL kernels use: ``bf16`` on one GPU; ``tagged`` with TP,
    where the partials cross GPUs through peer buffers that have no completion counters (each
    word's epoch tag is the cross-rank synchronisation)."""
    return "bf16" if tp_size == 1 else "tagged"  # every width; the plan's default GEMV task cost


def health_word(site: int, kernel: int, layer):
    """The health word a kernel stores: ``site | kernel << 8 | (layer + 1) << 10`` (the runtime's packing,
    ``monodecode.kernels.base.health_code``; the plan's ``wait_health_code`` for site 1). Works
    on Python ints (tests) and on the traced i32 layer argument (the kernels)."""
    return (site | (kernel << 8)) | ((layer + 1) << 10)


# ---- MFMA tile bookkeeping, shared by the kernels (traced i32) and the layout test (ints) ----
# v_mfma_f32_16x16x{16,32}_bf16: lane l feeds A row l % 16 and B column l % 16 with its K group
# l // 16; it gets back D rows 4 * (l // 16) + e (e = 0..3) of column l % 16.


def mfma_lane(lane):
    """(row of A / column of B, K group) of a lane."""
    return lane % MFMA_ROWS, lane // MFMA_ROWS


def mfma_k_elem(block, k_group, vec: int):
    """First K element (inside the staged chunk) a lane's 16-byte load covers in K block ``block``:
    the 4 K groups of a block are consecutive ``vec``-element runs."""
    return block * (4 * vec) + k_group * vec


def mfma_weight_row(task_row0, tile, lane_row, pair: int, n: int):
    """Row of the stacked weight (gate rows, then up rows) a lane loads for ``tile`` of a task."""
    return task_row0 + (tile // pair) * MFMA_ROWS + lane_row + (tile % pair) * n


def mfma_part(k_split, tile, row16, token, tiles: int, width: int):
    """LDS word (after the partial-sum base) of one tile output: [k_split][tile][row][token]."""
    return ((k_split * tiles + tile) * MFMA_ROWS + row16) * width + token


@dataclass(frozen=True)
class StageConsts:
    """The plan's numbers for one stage, baked into a kernel."""

    kernel: str
    name: str
    kind: str
    tasks: int
    offset: int
    rows: int  # gemv: output rows each task owns
    n: int  # gemv: output rows in total
    k: int  # gemv: reduction length (a weight row)
    tile: int = 0  # gemv: rows each task computes (``Stage.tile``: more than ``rows`` when cut to even waves)
    k_splits: int = 1  # gemv: K slices (``Stage.k_splits``), each task one slice of one row tile

    @classmethod
    def of(cls, st: Stage) -> StageConsts:
        return cls(
            st.kernel, st.name, st.kind, st.num_tasks, st.offset, st.rows_per_task, st.n, st.k, st.tile, st.k_splits
        )

    @property
    def row_tiles(self) -> int:
        """gemv: tasks per K slice."""
        return self.tasks // self.k_splits

    @property
    def k_task(self) -> int:
        """gemv: the reduction length of one task (its K slice)."""
        return self.k // self.k_splits


def task_origin(t, st: StageConsts):
    """(first output row, first K column, K slice) of GEMV task ``t``: row tile ``t % row_tiles``
    of K slice ``t // row_tiles`` (``plan.Stage``'s rule), ``rows`` output rows apart. Python ints
    (tests) or traced i32 (the kernels; an unsplit stage's K origin and slice are the int 0)."""
    if st.k_splits == 1:
        return t * st.rows, 0, 0
    s = t // st.row_tiles
    return (t - s * st.row_tiles) * st.rows, s * st.k_task, s


def merge_output(i, tile, rows: int):
    """(token, output row) of the ``i``-th output (``i < width * rows``) that a split-K merge
    finishes in row tile ``tile`` of a stage with ``rows`` output rows per task, tokens outer.
    Python ints (tests) or traced i32 (the kernels)."""
    tok = i // rows
    return tok, tile * rows + (i - tok * rows)


@dataclass(frozen=True)
class GemvTile:
    """How one GEMV stage's task is computed by a 4-wave workgroup."""

    stage: StageConsts
    width: int
    vec: int  # weight elements per lane per 16-byte load (8 bf16 / 16 fp8)
    pair: int  # 2 for gate|up (two weight rows share the input), else 1
    rows_per_wave: int
    row_group: int  # rows a wave computes together (accumulators: row_group * pair * width)
    k_pad: int  # K rounded up to whole steps (the LDS tail is zero)
    chunk: int  # staged input elements per row per chunk
    chunks: int
    mfma: bool = False
    k_split: int = 1  # MFMA: waves that share a tile, each taking every k_split-th K block

    @property
    def step(self) -> int:
        return WAVE_SIZE * self.vec

    @property
    def chunk_words(self) -> int:
        return self.chunk // 2  # bf16 pairs per staged row

    @property
    def x_stride(self) -> int:
        """Words between staged rows: 16 bytes more than a row, so the 16 token rows an MFMA
        operand load touches start on different LDS banks."""
        return self.chunk_words + 4

    @property
    def tiles(self) -> int:
        """MFMA tiles of a task (gate and up rows are separate tiles)."""
        return self.stage.tile // MFMA_ROWS * self.pair

    @property
    def kblock(self) -> int:
        """MFMA: K elements one wave instruction covers per row (4 lanes x 16 bytes)."""
        return 4 * self.vec

    @property
    def part_words(self) -> int:
        """LDS for partial sums: FMA per-row partials across chunks (none with one chunk); MFMA
        the tiles' token columns per K split, read by the epilogue."""
        if self.mfma:
            return self.k_split * self.tiles * MFMA_ROWS * self.width
        return 0 if self.chunks == 1 else WAVES_PER_WORKGROUP * self.rows_per_wave * self.pair * self.width


@dataclass(frozen=True)
class Geometry:
    """One specialisation (arch, dims, width, weight dtype, TP size) as the kernels bake it."""

    arch: str
    width: int
    grid: int
    tp_size: int
    fp8: bool
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    group: int
    intermediate: int
    attn_splits: int
    post_norms: bool
    k1: tuple[StageConsts, ...]
    k2: tuple[StageConsts, ...]
    mailbox: str  # plan.MAILBOX_FORMATS: "bf16" or "tagged"
    regions: dict[str, int]  # offsets in the region's own elements relative to the width's scratch segment
    peer_regions: dict[str, int]  # TP: word offsets in the width's peer-buffer segment
    tiles: dict[str, GemvTile]
    lds1: dict[str, int]  # K1 LDS arena: word offsets, "words" = size
    lds2: dict[str, int]
    layer_plan: LayerPlan = field(repr=False, compare=False)
    fused_post: bool = False  # K2 runs no post stage (``FUSED_POST`` and the plan allows it, or o_merge)
    o_merge: bool = False  # o_proj's split tiles summed (h published) by their last K slice
    d_merge: bool = False  # down's split tiles summed (x_out written) by their last K slice: no final stage

    # shard sizes: LocalDims's own properties (the same field names feed them)
    q = LocalDims.q
    kv = LocalDims.kv
    qkv = LocalDims.qkv

    @property
    def final(self) -> bool:
        """K2 runs a final stage: the plan has one and down's merge does not replace it."""
        return any(s.name == "final" for s in self.k2) and not self.d_merge

    def runs(self, kernel: str, name: str) -> bool:
        """Whether the kernel runs stage ``name``'s tasks (a plan stage replaced by the fused post
        or the split-K merge has none; its completion counter is only settled at the launch's exit)."""
        replaced = (name == "post" and self.fused_post) or (name == "final" and self.d_merge)
        return not (kernel == K2 and replaced)

    def arrive(self, name: str) -> int:
        """Index of the first arrival counter of merged stage ``name`` (o_proj's tiles, then down's)."""
        if name == "o_proj":
            return 0
        return self.stage(K2, "o_proj").row_tiles if self.o_merge else 0

    @property
    def arrive_counters(self) -> int:
        """int64 arrival counters K2 takes: one per merged row tile (``arrive_counters``)."""
        merged = [n for n, m in (("o_proj", self.o_merge), ("down", self.d_merge)) if m]
        return sum(self.stage(K2, n).row_tiles for n in merged)

    def stage(self, kernel: str, name: str) -> StageConsts:
        for s in self.k1 if kernel == K1 else self.k2:
            if s.name == name:
                return s
        raise KeyError(f"{kernel}.{name}")

    @property
    def bf16_mailbox(self) -> bool:
        return self.mailbox == "bf16"

    def done(self, kernel: str, name: str) -> int:
        """Offset (8-byte counters) of stage ``name``'s completion counter in the width's segment."""
        return self.regions[f"done_{kernel}"] + DONE_STAGES[kernel].index(name)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("layer_plan", None)
        return out


def _gemv_tile(st: StageConsts, width: int, spec: ArchSpec, fp8: bool) -> GemvTile:
    vec = 16 if fp8 else 8
    step = WAVE_SIZE * vec
    pair = 2 if st.name == "gate_up" else 1
    if st.tile % WAVES_PER_WORKGROUP:
        raise ConfigError(
            f"flydsl: stage {st.name} has {st.tile} rows per task, not a multiple of {WAVES_PER_WORKGROUP} waves"
        )
    if st.k_task % vec:
        raise ConfigError(
            f"flydsl: stage {st.name} reduces over {st.k_task}, not a multiple of {vec} "
            f"({'fp8' if fp8 else 'bf16'} 16-byte loads)"
        )
    if st.n * pair * st.k * (1 if fp8 else 2) > _MAX_I32_BYTES:
        raise ConfigError(f"flydsl: stage {st.name} weight is over 2 GiB (i32 buffer offsets)")
    rpw = st.tile // WAVES_PER_WORKGROUP
    group = max(1, 4 // (width * pair))
    while rpw % group:
        group //= 2
    k_pad = _ceil(st.k_task, step) * step
    per_row = max(step, (spec.x_stage_bytes // (2 * width)) // step * step)
    chunk = min(k_pad, per_row)
    mfma = width >= MFMA_MIN_WIDTH and st.tile % MFMA_ROWS == 0
    if not mfma and (st.tile != st.rows or st.k_splits != 1):  # the plan cuts and splits wide stages only
        raise ConfigError(f"flydsl: stage {st.name} is cut to even waves or split along K at width {width} (MFMA only)")
    tiles = st.tile // MFMA_ROWS * pair
    k_split = max(1, WAVES_PER_WORKGROUP // tiles) if mfma else 1
    if mfma and (tiles * k_split) % WAVES_PER_WORKGROUP:
        raise ConfigError(f"flydsl: stage {st.name}: {tiles} MFMA tiles do not spread over {WAVES_PER_WORKGROUP} waves")
    return GemvTile(st, width, vec, pair, rpw, group, k_pad, chunk, _ceil(k_pad, chunk), mfma, k_split)


def _carve(parts: list[tuple[str, int]], start: int = 0) -> tuple[dict[str, int], int]:
    """Word offsets of consecutive LDS buffers, each 4-word (16-byte) aligned."""
    out, cur = {}, start
    for name, words in parts:
        out[name] = cur
        cur += _ceil(max(words, 1), 4) * 4
    return out, cur


def _lds_layout(
    width: int, group: int, head_dim: int, tiles: dict[str, GemvTile], fused_post: bool = False
) -> tuple[dict, dict]:
    nw = WAVES_PER_WORKGROUP

    def gemv_parts(names):
        xw = max(width * tiles[n].x_stride for n in names)
        pw = max(tiles[n].part_words for n in names)
        return [("x", xw), ("part", pw)]

    # K1: row rstd, then either the QKV staging area or the attention buffers (never live together)
    head, base = _carve([("rstd", width), ("red", 2 * nw)])
    gemv, gend = _carve(gemv_parts(["qkv"]), base)
    attn, aend = _carve(
        [
            ("qkv_vec", (group + 2) * head_dim),  # q heads of the group, k, v (fp32, normed + roped)
            ("p", nw * group * ATTN_CHUNK),  # softmax weights of each wave's current chunk
            ("slot", 2 * nw * ATTN_CHUNK),  # 64-bit V word offset of each position of the chunk
            ("ml", nw * group * 2),  # each wave's running max and sum per head
            ("acc", nw * group * head_dim),  # each wave's unnormalised output per head
        ],
        base,
    )
    lds1 = {**head, **gemv, **attn, "words": max(gend, aend)}
    # K2: block-sum scratch; with a fused post, gate/up's rstd of every row of h (read while it
    # stages its chunks, so never aliased by the staging area)
    head2, base2 = _carve([("red", 2 * nw), *([("rstd", width)] if fused_post else [])])
    gemv2, end2 = _carve(gemv_parts(["o_proj", "gate_up", "down"]), base2)
    lds2 = {**head2, **gemv2, "words": end2}
    return lds1, lds2


def _check(dims: ModelDims, width: int, weight_dtype: str, tp_size: int) -> None:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"flydsl: weight dtype {weight_dtype!r} not supported; supported: {', '.join(WEIGHT_DTYPES)}")
    if not isinstance(width, int) or not 1 <= width <= MAX_WIDTH:
        raise ConfigError(f"flydsl: width {width!r} out of range 1..{MAX_WIDTH}")
    if not isinstance(tp_size, int) or not 1 <= tp_size <= MAX_TP:
        raise ConfigError(f"flydsl: tensor parallel size {tp_size!r} out of range 1..{MAX_TP}")
    d = dims.head_dim
    if d % WAVE_SIZE or d > 4 * WAVE_SIZE:
        raise ConfigError(f"flydsl: head_dim {d} unsupported (a multiple of {WAVE_SIZE}, at most {4 * WAVE_SIZE})")
    if dims.hidden_size % 2:
        raise ConfigError(f"flydsl: hidden_size {dims.hidden_size} must be even (bf16 pairs)")


def split_k_merges(lp: LayerPlan, fused_post: bool = FUSED_POST, merge: bool = SPLIT_K_MERGE) -> tuple[bool, bool]:
    """(o_proj, down): whether K2's split tiles of that stage are summed by their last K slice
    (``SPLIT_K_MERGE``, with ``fused_post``): where the plan allows it
    (``LayerPlan.split_k_merge_eligible``, the rule the Triton kernels apply too)."""
    o, d = lp.split_k_merge_eligible
    return merge and fused_post and o, merge and fused_post and d


def plan_geometry(
    dims: ModelDims,
    width: int,
    spec: ArchSpec,
    weight_dtype: str,
    tp_size: int = 1,
    fused_post: bool = FUSED_POST,
    split_k_merge: bool = SPLIT_K_MERGE,
) -> Geometry:
    """The plan of ``width`` on ``spec``'s grid, with the FlyDSL tiling added. ``fused_post``: drop
    K2's post stage where the plan allows it (``FUSED_POST``); ``split_k_merge``: sum split
    o_proj / down tiles in their last K slice where allowed (``SPLIT_K_MERGE``)."""
    _check(dims, width, weight_dtype, tp_size)
    for name, flag in (("fused_post", fused_post), ("split_k_merge", split_k_merge)):
        if not isinstance(flag, bool):
            raise ConfigError(f"flydsl: {name} must be True or False, got {flag!r}")
    lp = plan_layer(dims, tp_size, width, spec.compute_units, mailbox=mailbox_format(tp_size), **PLAN_KNOBS)
    L = lp.local
    if L.group > 16:
        raise ConfigError(f"flydsl: at most 16 query heads per KV head, got {L.group}")
    fp8 = weight_dtype != "bf16"
    k1 = tuple(StageConsts.of(s) for s in lp.k1)
    k2 = tuple(StageConsts.of(s) for s in lp.k2)
    tiles = {s.name: _gemv_tile(s, width, spec, fp8) for s in k1 + k2 if s.kind == "gemv"}
    seg = lp.layout.offset
    regions = {n: (r.offset - seg) // r.word_bytes for n, r in lp.layout.regions.items()}
    peer = {}
    if lp.peer_layout is not None:
        peer = {n: (r.offset - lp.peer_layout.offset) // r.word_bytes for n, r in lp.peer_layout.regions.items()}
    o_merge, d_merge = split_k_merges(lp, fused_post, split_k_merge)
    fused = fused_post and (lp.fused_post_eligible or o_merge)  # a merged o_proj publishes h itself
    lds1, lds2 = _lds_layout(width, L.group, L.head_dim, tiles, fused)
    for name, lds in (("k1", lds1), ("k2", lds2)):
        if lds["words"] * 4 > spec.lds_bytes:
            raise ConfigError(
                f"flydsl: {name} needs {lds['words'] * 4} B of LDS at width {width}, {spec.arch} has {spec.lds_bytes} B"
            )
    return Geometry(
        arch=spec.arch,
        width=width,
        grid=lp.num_workgroups,
        tp_size=tp_size,
        fp8=fp8,
        hidden=L.hidden,
        heads=L.heads,
        kv_heads=L.kv_heads,
        head_dim=L.head_dim,
        group=L.group,
        intermediate=L.intermediate,
        attn_splits=lp.attn_splits,
        post_norms=dims.post_norms,
        k1=k1,
        k2=k2,
        mailbox=lp.mailbox,
        regions=regions,
        peer_regions=peer,
        tiles=tiles,
        lds1=lds1,
        lds2=lds2,
        layer_plan=lp,
        fused_post=fused,
        o_merge=o_merge,
        d_merge=d_merge,
    )


def model_plan(dims: ModelDims, arch: str, widths, tp_size: int = 1) -> ModelPlan:
    """The plan the backend places its scratch (and peer) buffer by: every width, one buffer."""
    return plan_model(
        dims, tp_size, sorted(set(widths)), arch_spec(arch).compute_units, mailbox=mailbox_format(tp_size), **PLAN_KNOBS
    )


def launch_description(dims: ModelDims, arch: str, widths, weight_dtype: str = "bf16", tp_size: int = 1) -> dict:
    """What the FlyDSL backend launches for ``widths``: grid, per width and kernel the stage tables
    the kernels bake (and the workgroup -> tasks rule they run), and the absolute byte offset of
    every region in the scratch buffer (segment offset from the placement + the baked relative
    offset). Compared with ``plan_model`` by the tests. ``fused_post``: K2 runs no post stage (its
    table lists no tasks on any workgroup; its counter is only settled at the launch's exit).
    ``split_k_merge``: the stages whose split tiles their last K slice sums (a merged down: no final
    tasks either), and where their arrival counters start in K2's ``arrive`` argument."""
    spec = arch_spec(arch)
    placed = model_plan(dims, arch, widths, tp_size)
    out = {
        "grid": spec.compute_units,
        "scratch_bytes": placed.scratch.nbytes,
        "health_offset": placed.scratch.header[HEALTH].offset,
        "peer_bytes": placed.peer.nbytes if placed.peer else 0,
        "widths": {},
    }
    for w in placed.widths:
        g = plan_geometry(dims, w, spec, weight_dtype, tp_size)
        seg = placed.scratch.widths[w].offset
        entry = {
            "grid": g.grid,
            "attn_splits": g.attn_splits,
            "mailbox": g.mailbox,
            "fused_post": g.fused_post,
            "split_k_merge": {f"{K2}.{n}": g.arrive(n) for n, m in (("o_proj", g.o_merge), ("down", g.d_merge)) if m},
            "arrive_counters": g.arrive_counters,
            # the stage completion counters the kernels signal and wait on (bf16 format)
            "counters": {
                f"{st.kernel}.{st.name}": seg + g.done(st.kernel, st.name) * 8
                for st in g.k1 + g.k2
                if st.name in DONE_STAGES[st.kernel]
            },
            "regions": {n: seg + off * g.layer_plan.region(n).word_bytes for n, off in g.regions.items()},
            "stages": {},
        }
        if g.peer_regions:
            pseg = placed.peer.widths[w].offset
            entry["peer_regions"] = {
                n: pseg + off * g.layer_plan.region(n).word_bytes for n, off in g.peer_regions.items()
            }
        for st in g.k1 + g.k2:
            runs = g.runs(st.kernel, st.name)
            entry["stages"][f"{st.kernel}.{st.name}"] = {
                "kind": st.kind,
                "tasks": st.tasks,
                "offset": st.offset,
                "rows": st.rows,
                "tile": st.tile,
                "k_splits": st.k_splits,
                "n": st.n,
                "k": st.k,
                "workgroup_tasks": [
                    list(range(first_task(b, st.offset, g.grid), st.tasks if runs else 0, g.grid))
                    for b in range(g.grid)
                ],
            }
        out["widths"][w] = entry
    return out
