"""The kernel plan shared by every decode-kernel backend (Triton, FlyDSL): pure Python.

For a model's dims, a tensor-parallel size, a step width (rows per decode step) and a
workgroup count (one per CU/SM), the plan fixes:

* the **stages** of the two launches per layer, in order, what each reads and writes:

  - K1: ``qkv`` (pre-norm + fused QKV GEMV) -> ``attn`` (q/k-norm, RoPE, KV insert,
    split-context paged GQA attention; one task per row x KV head x context split) ->
    ``combine`` (merge the splits of one query head; writes K1's output ``attn_out``).
  - K2: ``o_proj`` (GEMV; with TP the partial goes to every peer) -> ``post`` (one task per
    row: TP sum, Gemma post-attention norm, residual add, pre-MLP norm) -> ``gate_up`` (fused
    gate/up GEMV + activation) -> ``down`` (GEMV; adds the residual when nothing follows) ->
    ``final`` (only with Gemma post-MLP norms, TP or a split ``down``: TP sum, norm, residual add).
  - Split-K (``wide_split_k``, widths > 1, one rank): ``o_proj`` / ``down`` tasks may each cover
    one K slice of a row tile (``split_k_slices``), writing fp32 partials (``o_part`` /
    ``d_part``) that ``post`` / ``final`` sum in slice order.
  - Early down (``early_down_waves``, width 1, one rank, unsplit ``down``, where gate/up spans at
    least that many waves of the grid and halves evenly): ``gate_up`` runs as two
    stages, ``gate_up_lo`` (the first half of its row tiles, counted on its own) then
    ``gate_up``; ``down`` as ``down_lo`` (the first half of K, an fp32 partial ``d_lo``) then
    ``down`` (the rest of K, plus ``d_lo``). A program that finishes its gate/up tasks streams
    its ``down_lo`` tiles instead of waiting for the last gate/up task of the grid; both halves
    of a row tile run on the same workgroup, which sums them in K order.
  - Even waves (``wide_even_waves`` at widths > 1, ``narrow_even_waves`` at width 1; one rank,
    unsplit GEMVs): where a stage's row tiles leave the last wave of the grid partly idle, each
    task covers fewer rows of its tile (``even_wave_rows``, ``Stage.tile_rows``) so the same
    number of waves is full. Where that cuts gate/up's tasks, down stays whole (no early halves).

* the **task tables**: task ``t`` of a stage runs on workgroup ``(t + stage.offset) % G``, so
  workgroup ``b`` runs tasks ``b', b'+G, ...`` (``b' = (b - offset) mod G``); the offsets rotate
  from stage to stage so the first workgroups are not always the busiest. A task waits only on
  tasks of earlier stages of the same launch, so there is no grid barrier and no deadlock while
  the grid is resident.

* the **scratch layout** per width: every hand-off between workgroups goes through a mailbox
  region. A producing stage counts finished tasks in a monotonic completion counter (release
  after its stores); a consumer polls that one word (acquire), then reads the region. Two
  mailbox formats (``MAILBOX_FORMATS``, chosen per build):

  - ``tagged``: 8-byte words (fp32 value in the low half, the launch's 31-bit epoch tag in the
    high half, written with one store); consumers also check every word's tag.
  - ``bf16``: activations (qkv, o, h, hn, act, d and their TP peer slots) as plain bf16 values,
    attention and split-K partials (attn_acc, attn_ml, o_part, d_part, d_lo) as plain fp32; the
    completion counters are the only synchronisation. Every consumer rounds its inputs to bf16
    anyway, so both formats give the same numbers; bf16 moves a quarter of the bytes.
 Each width owns a disjoint segment with its own epoch
  and completion counters, so layouts of different widths never alias. A one-word health header (sticky site code) leads
  the buffer. With TP, a second symmetric *peer* buffer (one per rank, IPC-mapped) has the same
  per-width rule.

* the **build-key inputs**: everything above that a compiled kernel depends on.

Nothing here imports torch, triton or flydsl.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

from monodecode.errors import ConfigError
from monodecode.kernels.health import health_code
from monodecode.model.dims import ModelDims
from monodecode.model.weights import WEIGHT_DTYPES

PLAN_VERSION = 1
WORD_BYTES = 8  # tagged mailbox word: low 32 bits fp32 value, high 32 bits epoch tag (one aligned store)
MAILBOX_FORMATS = ("tagged", "bf16")
# Element bytes of each mailbox region per format; regions not named are activations.
_PARTIAL_REGIONS = ("attn_acc", "attn_ml", "o_part", "d_part", "d_lo")


def mailbox_bytes(mailbox: str, region: str) -> int:
    """Bytes per element of a mailbox region in a mailbox format."""
    if mailbox == "tagged":
        return WORD_BYTES
    return 4 if region in _PARTIAL_REGIONS else 2


ALIGN = 256  # every region and width segment starts on a 256-byte boundary (cache-line multiple)
MAX_WIDTH = 256
MAX_ATTN_SPLITS = 16
KV_DTYPES = ("bf16",)

# Output rows per GEMV task. A batch-1 GEMV streams best with few rows per task (more bytes in
# flight across the grid); a wider step is computed with matrix instructions that want >= 16.
_GEMV_ROWS_W1 = (16, 8, 4)
_GEMV_ROWS_WIDE = (64, 32, 16)
TASK_BYTES = 4096  # default fixed cost of one GEMV task in the rows chooser (bytes of traffic)

K1, K2 = "k1", "k2"

# Stages whose completion is counted (index = position in the launch's done_* region).
DONE_STAGES = {K1: ("qkv", "attn"), K2: ("o_proj", "post", "gate_up", "down")}
# Counted after those in the plans that have them (``early_down_waves``); other plans keep their layout.
OPTIONAL_DONE_STAGES = {K1: (), K2: ("gate_up_lo",)}

# Launch inputs/outputs that are not mailbox regions (for dependency and coverage bookkeeping).
LAUNCH_INPUTS = {K1: ("x",), K2: ("x", "attn_out")}
LAUNCH_OUTPUTS = {K1: ("attn_out",), K2: ("x_out",)}


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """A contiguous array of words inside a scratch (or peer) buffer; offsets in bytes."""

    name: str
    offset: int
    shape: tuple[int, ...]
    word_bytes: int = WORD_BYTES

    @property
    def words(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.words * self.word_bytes

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def word_offset(self) -> int:
        """Offset in words (what a kernel adds to a word pointer to the buffer's start)."""
        return self.offset // self.word_bytes

    def to_dict(self) -> dict:
        return {"name": self.name, "offset": self.offset, "shape": list(self.shape), "word_bytes": self.word_bytes}


@dataclass(frozen=True)
class WidthLayout:
    """The segment of one width: ``regions`` carry absolute byte offsets into the buffer."""

    width: int
    offset: int
    nbytes: int
    regions: dict[str, Region]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_dict(self) -> dict:
        return {
            "width": self.width,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "regions": [r.to_dict() for r in self.regions.values()],
        }


@dataclass(frozen=True)
class ScratchLayout:
    """Whole scratch buffer: header (health word) then one segment per width."""

    nbytes: int
    header: dict[str, Region]
    widths: dict[int, WidthLayout]

    def regions(self) -> Iterator[Region]:
        yield from self.header.values()
        for seg in self.widths.values():
            yield from seg.regions.values()

    def to_dict(self) -> dict:
        return {
            "nbytes": self.nbytes,
            "header": [r.to_dict() for r in self.header.values()],
            "widths": [self.widths[w].to_dict() for w in sorted(self.widths)],
        }


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pack(specs: Iterable[tuple[str, tuple[int, ...], int]], start: int) -> tuple[dict[str, Region], int]:
    """Lay regions out one after another from ``start``, each aligned; return them and the end."""
    out: dict[str, Region] = {}
    cur = _align(start)
    for name, shape, word_bytes in specs:
        reg = Region(name, cur, tuple(shape), word_bytes)
        out[name] = reg
        cur = _align(reg.end)
    return out, cur


# --------------------------------------------------------------------------------------------
# Stages and tasks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """Words ``[start, stop)`` of a region (flat, row-major)."""

    region: str
    start: int
    stop: int


@dataclass(frozen=True)
class Task:
    stage: str
    index: int
    workgroup: int
    reads: tuple[Span, ...]
    writes: tuple[Span, ...]


@dataclass(frozen=True)
class Stage:
    """One stage of a launch. ``kind``: gemv | attention | combine | rownorm."""

    kernel: str
    name: str
    index: int  # position within its launch
    kind: str
    num_tasks: int
    offset: int  # task t runs on workgroup (t + offset) % num_workgroups
    reads: tuple[str, ...]  # regions or launch inputs
    writes: tuple[str, ...]  # regions or launch outputs
    rows_per_task: int = 0  # gemv: output rows (N) per task
    n: int = 0  # gemv: output rows in total
    k: int = 0  # gemv: reduction length
    # gemv: the reduction split into this many slices, one task each (task t: row tile
    # t % tiles, slice t // tiles); each writes an fp32 partial, summed in slice order by the
    # stage that reads them (``split_k_slices``)
    k_splits: int = 1
    # gemv: the row tile each task computes when it is wider than the task's rows (``even_wave_rows``:
    # rows cut so the tasks fill whole waves; the rows past ``rows_per_task`` are masked, never
    # read or written); 0: the tile is ``rows_per_task``
    tile_rows: int = 0
    # gemv: the first output row and the first reduction column of a stage that covers part of
    # its GEMV (``early_down_waves``' halves: rows ``[row0, row0 + n)``, columns ``[k0, k0 + k)``)
    row0: int = 0
    k0: int = 0

    @property
    def tile(self) -> int:
        """gemv: rows of the tile each task computes (a power of two, >= ``rows_per_task``)."""
        return self.tile_rows or self.rows_per_task

    @property
    def tiles(self) -> int:
        """gemv: row tiles (tasks per K slice)."""
        return self.num_tasks // self.k_splits

    @property
    def k_per_task(self) -> int:
        """gemv: reduction length of one task."""
        return self.k // self.k_splits

    def workgroup_of(self, task: int, num_workgroups: int) -> int:
        if not 0 <= task < self.num_tasks:
            raise IndexError(f"stage {self.kernel}.{self.name} has no task {task}")
        return (task + self.offset) % num_workgroups

    def tasks_of(self, workgroup: int, num_workgroups: int) -> range:
        """The tasks workgroup ``b`` runs in this stage, in order: b', b'+G, ..."""
        first = (workgroup - self.offset) % num_workgroups
        return range(first, self.num_tasks, num_workgroups)

    def to_dict(self) -> dict:
        return {
            "kernel": self.kernel,
            "name": self.name,
            "index": self.index,
            "kind": self.kind,
            "num_tasks": self.num_tasks,
            "offset": self.offset,
            "reads": list(self.reads),
            "writes": list(self.writes),
            "rows_per_task": self.rows_per_task,
            "n": self.n,
            "k": self.k,
            # only when split, so plans without split-K keep their digests (FlyDSL goldens)
            **({"k_splits": self.k_splits} if self.k_splits != 1 else {}),
            **({"tile_rows": self.tile_rows} if self.tile_rows else {}),
            **({"row0": self.row0} if self.row0 else {}),
            **({"k0": self.k0} if self.k0 else {}),
        }


def counted_stages(kernel: str, names: Iterable[str]) -> tuple[str, ...]:
    """Stages of ``kernel`` with a completion counter, in the order of its done_* region: the
    ones every plan counts, then the optional ones the plan has (``names``: its stage names)."""
    present = set(names)
    return DONE_STAGES[kernel] + tuple(n for n in OPTIONAL_DONE_STAGES[kernel] if n in present)


def wait_health_code(kernel: str, layer: int) -> int:
    """Health word a backend stores when a bounded wait of ``kernel`` in ``layer`` expires
    (the runtime's packing, ``monodecode.kernels.health.health_code``); kernels compute it on device as
    ``site | kernel_id << 8 | (layer + 1) << 10``."""
    return health_code("wait_timeout", layer, kernel)


@dataclass(frozen=True)
class LocalDims:
    """The per-rank shard of a layer under tensor parallelism (heads and intermediate split)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    group: int  # query heads per KV head

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qkv(self) -> int:
        return self.q + 2 * self.kv


def local_dims(dims: ModelDims, tp_size: int) -> LocalDims:
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"kernel plan: tp_size must be a positive integer, got {tp_size!r}")
    if dims.num_heads % tp_size:
        raise ConfigError(f"kernel plan: tp_size {tp_size} does not divide num_heads {dims.num_heads}")
    if dims.intermediate_size % tp_size:
        raise ConfigError(f"kernel plan: tp_size {tp_size} does not divide intermediate_size {dims.intermediate_size}")
    kvh = dims.num_kv_heads
    if kvh >= tp_size:
        if kvh % tp_size:
            raise ConfigError(f"kernel plan: tp_size {tp_size} does not divide num_kv_heads {kvh}")
        kv_local = kvh // tp_size
    else:  # fewer KV heads than ranks: each rank keeps (a replica of) one KV head
        if tp_size % kvh:
            raise ConfigError(f"kernel plan: num_kv_heads {kvh} does not divide tp_size {tp_size}")
        kv_local = 1
    heads = dims.num_heads // tp_size
    return LocalDims(
        hidden=dims.hidden_size,
        heads=heads,
        kv_heads=kv_local,
        head_dim=dims.head_dim,
        intermediate=dims.intermediate_size // tp_size,
        group=heads // kv_local,
    )


def gemv_rows_per_task(
    n: int,
    k: int,
    width: int,
    num_workgroups: int,
    *,
    matrices: int = 1,
    input_word_bytes: int = 2,
    task_bytes: int = TASK_BYTES,
    min_rows: int = 0,
    burst: float = 0.0,
) -> int:
    """Rows per GEMV task: the candidate with the least estimated time, counting whole waves of
    tasks over the grid, each task streaming its weight tile (bf16 estimate), re-reading the
    input vector (``input_word_bytes`` per element) and paying a fixed cost (``task_bytes`` of
    traffic: the pipeline's ramp and drain per task). Candidates below ``min_rows`` are skipped
    (e.g. matrix instructions that need 64-row tiles).

    ``burst`` > 0: the memory system, not each program, is the limit. A stage then costs the
    larger of its bytes spread over the whole grid and its busiest program's bytes at ``burst``
    times the average program's rate (a program streams faster while fewer others do), plus
    the fixed costs: a partial last wave of large tiles no longer counts as a whole wave."""
    best, best_cost = 0, None
    for rows in _GEMV_ROWS_W1 if width == 1 else _GEMV_ROWS_WIDE:
        if rows < min_rows:
            continue
        tasks = -(-n // rows)
        waves = -(-tasks // num_workgroups)
        per_task = rows * k * 2 * matrices + width * k * input_word_bytes
        if burst > 0:
            cost = max(waves * per_task / burst, tasks * per_task / num_workgroups) + waves * task_bytes
        else:
            cost = waves * (per_task + task_bytes)
        if best_cost is None or cost < best_cost:
            best, best_cost = rows, cost
    return best


SPLIT_K_GRAIN = 64  # every K slice of a split GEMV is a multiple of this (the narrowest K chunk)


def split_k_slices(tiles: int, k: int, num_workgroups: int, most: int) -> int:
    """K slices (at most ``most``) for a GEMV stage of ``tiles`` row tiles: the count with the
    least time, waves of tasks times each task's share of K (fewer on a tie). A stage whose tiles
    leave programs idle (27B's 84 tiles on 132 programs, FP8 8B's 64) then spreads its bytes
    over the whole grid; one that fills its waves stays whole."""
    best, best_cost = 1, -(-tiles // num_workgroups)
    for s in range(2, most + 1):
        if k % (s * SPLIT_K_GRAIN):
            continue
        cost = -(-tiles * s // num_workgroups) / s
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def even_wave_rows(n: int, tile: int, num_workgroups: int) -> int:
    """Rows per task for a GEMV of ``n`` rows in ``tile``-row tiles that leave the last wave of
    the grid partly idle: the same number of waves, each full, every task a little narrower
    (27B gate/up at widths > 1: 336 64-row tasks are 2.5 waves of 132; 391 55-row ones are 3
    full waves). ``tile`` when the tasks already fill their waves."""
    tiles = -(-n // tile)
    waves = -(-tiles // num_workgroups)
    return min(tile, -(-n // (waves * num_workgroups)))


def attention_splits(width: int, kv_heads: int, num_workgroups: int) -> int:
    """Context splits per (row, KV head): enough tasks to cover the grid once, a power of two."""
    per = max(1, num_workgroups // (width * kv_heads))
    s = 1
    while s * 2 <= min(per, MAX_ATTN_SPLITS):
        s *= 2
    return s


# --------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerPlan:
    """Stages, task tables and the width's mailbox regions (offsets relative to the width's
    segment start until placed by ``plan_model``)."""

    dims_digest: str
    tp_size: int
    width: int
    num_workgroups: int
    local: LocalDims
    attn_splits: int
    post_norms: bool
    k1: tuple[Stage, ...]
    k2: tuple[Stage, ...]
    layout: WidthLayout
    peer_layout: WidthLayout | None = None  # TP only: this width's segment of the peer buffer
    mailbox: str = "tagged"  # one of MAILBOX_FORMATS
    k1_workgroups: int = 0  # K1's grid where it differs from K2's (``num_workgroups``); 0: the same

    def workgroups(self, kernel: str) -> int:
        """The grid of ``kernel``'s launch: its tasks run on workgroups ``0 .. workgroups - 1``."""
        return self.k1_workgroups if kernel == K1 and self.k1_workgroups else self.num_workgroups

    def stages(self, kernel: str | None = None) -> tuple[Stage, ...]:
        if kernel == K1:
            return self.k1
        if kernel == K2:
            return self.k2
        return self.k1 + self.k2

    def stage(self, kernel: str, name: str) -> Stage:
        for s in self.stages(kernel):
            if s.name == name:
                return s
        raise KeyError(f"{kernel}.{name}")

    def counted_stages(self, kernel: str) -> tuple[str, ...]:
        """Stages of ``kernel`` with a completion counter, in the order of its done_* region."""
        return counted_stages(kernel, {st.name for st in self.stages(kernel)})

    @property
    def _row_stages_only_add(self) -> bool:
        """Whether K2's ``post`` / ``final`` stages only sum partials, add the residual and
        normalise: no Gemma post norms, one rank with the bf16 mailbox (no partials crossing GPUs)."""
        return not self.post_norms and self.tp_size == 1 and self.mailbox == "bf16"

    @property
    def fused_post_eligible(self) -> bool:
        """Whether K2's ``post`` stage only adds the residual and normalises, so a backend may
        drop it (o_proj's tasks add the residual, gate/up normalises its input): no Gemma post
        norms, one rank with the bf16 mailbox (no partials crossing GPUs to sum) and o_proj not
        split along K (each o_proj task owns whole rows of o). The one rule every backend's
        fused-post switch applies (Triton ``Target.fused_post``, FlyDSL ``Geometry.fused_post``)."""
        return self._row_stages_only_add and self.stage(K2, "o_proj").k_splits == 1

    @property
    def split_k_merge_eligible(self) -> tuple[bool, bool]:
        """(o_proj, down): whether a backend may sum that stage's split tiles in each tile's last K
        slice (adding the residual there) instead of in the ``post`` / ``final`` stage: the stage
        is split along K and those stages would do nothing else (``_row_stages_only_add``). The one
        rule every backend's merge switch applies (Triton ``Target.split_k_merge``, FlyDSL
        ``config.SPLIT_K_MERGE``); a merged o_proj also needs the fused post's gate/up."""
        ok = self._row_stages_only_add
        return ok and self.stage(K2, "o_proj").k_splits > 1, ok and self.stage(K2, "down").k_splits > 1

    def _row_length(self, name: str, default: int) -> int:
        """Elements per row of a mailbox region (``default`` for a launch input or output)."""
        return self.region(name).shape[-1] if name in self.layout.regions else default

    def region(self, name: str) -> Region:
        if name in self.layout.regions:
            return self.layout.regions[name]
        if self.peer_layout is not None and name in self.peer_layout.regions:
            return self.peer_layout.regions[name]
        raise KeyError(name)

    # -- task tables ------------------------------------------------------------------------

    def task(self, kernel: str, name: str, t: int) -> Task:
        st = self.stage(kernel, name)
        return Task(name, t, st.workgroup_of(t, self.workgroups(kernel)), *self._spans(st, t))

    def tasks(self, kernel: str, name: str) -> list[Task]:
        st = self.stage(kernel, name)
        return [self.task(kernel, name, t) for t in range(st.num_tasks)]

    def task_table(self, kernel: str) -> list[list[int]]:
        """``table[stage_index][task] = workgroup`` for one launch."""
        g = self.workgroups(kernel)
        return [[s.workgroup_of(t, g) for t in range(s.num_tasks)] for s in self.stages(kernel)]

    def _spans(self, st: Stage, t: int) -> tuple[tuple[Span, ...], tuple[Span, ...]]:
        """Words each task reads from / writes to (mailbox regions and launch inputs/outputs).

        Peer regions are given for this rank's slot (slot 0); rank ``r`` writes slot ``r``.
        """
        L, W, S = self.local, self.width, self.attn_splits
        H, D = L.hidden, L.head_dim
        hid = H
        reads: list[Span] = []
        writes: list[Span] = []
        if st.kind == "gemv":
            tile, part = t % st.tiles, t // st.tiles
            n0, n1 = tile * st.rows_per_task, min(st.n, (tile + 1) * st.rows_per_task)
            src, kt = st.reads[0], st.k_per_task
            k_row = self._row_length(src, st.k)
            for r in range(W):
                k_lo = r * k_row + st.k0 + part * kt
                reads.append(Span(src, k_lo, k_lo + kt))
                for dst in st.writes:  # a split stage writes slice ``part`` of its partials
                    base = (part * W + r) * self._row_length(dst, st.n) + st.row0
                    writes.append(Span(dst, base + n0, base + n1))
            for other in st.reads[1:]:  # down's residual h and its first half's partial d_lo
                for r in range(W):
                    reads.append(Span(other, r * hid + n0, r * hid + n1))
        elif st.kind == "attention":
            r, rest = divmod(t, L.kv_heads * S)
            g, s = divmod(rest, S)
            base = r * L.qkv
            reads.append(Span("qkv", base + g * L.group * D, base + (g + 1) * L.group * D))
            reads.append(Span("qkv", base + L.q + g * D, base + L.q + (g + 1) * D))
            reads.append(Span("qkv", base + L.q + L.kv + g * D, base + L.q + L.kv + (g + 1) * D))
            for j in range(L.group):
                h = g * L.group + j
                writes.append(Span("attn_acc", ((r * L.heads + h) * S + s) * D, ((r * L.heads + h) * S + s + 1) * D))
                writes.append(Span("attn_ml", ((r * L.heads + h) * S + s) * 2, ((r * L.heads + h) * S + s + 1) * 2))
        elif st.kind == "combine":
            r, h = divmod(t, L.heads)
            reads.append(Span("attn_acc", (r * L.heads + h) * S * D, (r * L.heads + h + 1) * S * D))
            reads.append(Span("attn_ml", (r * L.heads + h) * S * 2, (r * L.heads + h + 1) * S * 2))
            writes.append(Span("attn_out", r * L.q + h * D, r * L.q + (h + 1) * D))
        elif st.kind == "rownorm":
            r = t
            src = st.reads[0]
            shape = self.region(src).shape
            slots = shape[0] if len(shape) == 3 else 1  # [slot, row, hidden]: source ranks or K slices
            if slots > 1:
                for q in range(slots):
                    reads.append(Span(src, (q * W + r) * H, (q * W + r + 1) * H))
            else:
                reads.append(Span(src, r * H, (r + 1) * H))
            for other in st.reads[1:]:
                reads.append(Span(other, r * H, (r + 1) * H))
            for dst in st.writes:
                writes.append(Span(dst, r * H, (r + 1) * H))
        return tuple(reads), tuple(writes)

    # -- dependencies -----------------------------------------------------------------------

    def dependency_graph(self, kernel: str) -> dict[tuple[str, int], set[tuple[str, int]]]:
        """For every task of one launch, the (stage, task) pairs whose mailbox writes it reads.

        Launch inputs (``x``, ``attn_out`` in K2) come from the previous launch and carry no
        in-launch dependency."""
        producers: dict[str, list[tuple[int, int, str, int]]] = {}
        tasks = [tk for st in self.stages(kernel) for tk in self.tasks(kernel, st.name)]
        for tk in tasks:
            for sp in tk.writes:
                producers.setdefault(sp.region, []).append((sp.start, sp.stop, tk.stage, tk.index))
        for lst in producers.values():
            lst.sort()
        graph: dict[tuple[str, int], set[tuple[str, int]]] = {}
        for tk in tasks:
            deps: set[tuple[str, int]] = set()
            for sp in tk.reads:
                lst = producers.get(sp.region, [])
                i = bisect.bisect_left(lst, (sp.start,)) - 1
                i = max(i, 0)
                while i < len(lst) and lst[i][0] < sp.stop:
                    if lst[i][1] > sp.start:
                        deps.add((lst[i][2], lst[i][3]))
                    i += 1
            graph[(tk.stage, tk.index)] = deps
        return graph

    def to_dict(self) -> dict:
        return {
            "plan_version": PLAN_VERSION,
            "dims_digest": self.dims_digest,
            "tp_size": self.tp_size,
            "width": self.width,
            "num_workgroups": self.num_workgroups,
            # only when K1 has a grid of its own, so other plans keep their digests (FlyDSL goldens)
            **({"k1_workgroups": self.k1_workgroups} if self.k1_workgroups else {}),
            "attn_splits": self.attn_splits,
            "mailbox": self.mailbox,
            "k1": [s.to_dict() for s in self.k1],
            "k2": [s.to_dict() for s in self.k2],
            "layout": self.layout.to_dict(),
            "peer_layout": self.peer_layout.to_dict() if self.peer_layout else None,
        }


def _check_width(width: object) -> int:
    if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= MAX_WIDTH:
        raise ConfigError(f"kernel plan: width must be an integer in 1..{MAX_WIDTH}, got {width!r}")
    return width


def _check_workgroups(num_workgroups: object) -> int:
    if not isinstance(num_workgroups, int) or isinstance(num_workgroups, bool) or num_workgroups < 1:
        raise ConfigError(f"kernel plan: num_workgroups must be a positive integer, got {num_workgroups!r}")
    return num_workgroups


def _check_mailbox(mailbox: object) -> str:
    if mailbox not in MAILBOX_FORMATS:
        raise ConfigError(f"kernel plan: mailbox must be one of {', '.join(MAILBOX_FORMATS)}, got {mailbox!r}")
    return mailbox


def _width_regions(
    L: LocalDims,
    W: int,
    S: int,
    tp: int,
    final: bool,
    mailbox: str = "tagged",
    o_ks: int = 1,
    d_ks: int = 1,
    names: frozenset[str] = frozenset(),
) -> list[tuple[str, tuple[int, ...], int]]:
    """The width's regions; ``names`` (the plan's stage names) adds the optional counters and
    ``d_lo`` of the stages it holds."""
    mb = mailbox_bytes
    specs = [
        ("epoch_k1", (1,), 8),  # int64 launch counters: epoch = counter // G + 1 (advanced on device)
        ("epoch_k2", (1,), 8),
        # int64 completion counters, one per producing stage (never reset): every launch adds
        # exactly the stage's task count, so "done in launch e" is counter >= e * tasks. Consumers
        # wait on them (one word to poll), then read the tagged words and check the tags.
        ("done_k1", (len(counted_stages(K1, names)),), 8),
        ("done_k2", (len(counted_stages(K2, names)),), 8),
        ("qkv", (W, L.qkv), mb(mailbox, "qkv")),
        ("attn_acc", (W, L.heads, S, L.head_dim), mb(mailbox, "attn_acc")),
        ("attn_ml", (W, L.heads, S, 2), mb(mailbox, "attn_ml")),
        ("h", (W, L.hidden), mb(mailbox, "h")),
        ("hn", (W, L.hidden), mb(mailbox, "hn")),
        ("act", (W, L.intermediate), mb(mailbox, "act")),
    ]
    if tp == 1:
        if o_ks > 1:
            specs.append(("o_part", (o_ks, W, L.hidden), mb(mailbox, "o_part")))
        else:
            specs.append(("o", (W, L.hidden), mb(mailbox, "o")))
        if d_ks > 1:
            specs.append(("d_part", (d_ks, W, L.hidden), mb(mailbox, "d_part")))
        elif final:
            specs.append(("d", (W, L.hidden), mb(mailbox, "d")))
        if "down_lo" in names:
            specs.append(("d_lo", (W, L.hidden), mb(mailbox, "d_lo")))
    return specs


def _peer_regions(L: LocalDims, W: int, tp: int, mailbox: str = "tagged") -> list[tuple[str, tuple[int, ...], int]]:
    b = mailbox_bytes(mailbox, "o_peer")
    return [("o_peer", (tp, W, L.hidden), b), ("d_peer", (tp, W, L.hidden), b)]


def _stages(
    dims: ModelDims,
    L: LocalDims,
    W: int,
    G: int,
    S: int,
    tp: int,
    mailbox: str = "tagged",
    task_bytes: int = TASK_BYTES,
    min_rows: int = 0,
    burst: float = 0.0,
    split_k: int = 0,
    even_waves: bool = False,
    early_down_waves: int = 0,
    G1: int = 0,
) -> tuple[tuple[Stage, ...], tuple[Stage, ...]]:
    """K1's stages on a grid of ``G1`` workgroups (0: ``G``), K2's on ``G``."""
    G1 = G1 or G
    final = dims.post_norms or tp > 1
    o_dst = "o_peer" if tp > 1 else "o"
    d_dst = ("d_peer" if tp > 1 else "d") if final else "x_out"

    def split(st: Stage, partials: str, reads: tuple[str, ...] | None = None) -> Stage:
        """``st`` split along K (``split_k_slices``; widths > 1, one rank) into fp32 partials."""
        ks = split_k_slices(st.num_tasks, st.k, G, split_k) if split_k and W > 1 and tp == 1 else 1
        if ks == 1:
            return st
        return replace(st, num_tasks=st.num_tasks * ks, k_splits=ks, writes=(partials,), reads=reads or st.reads)

    def grid(kernel: str) -> int:
        return G1 if kernel == K1 else G

    def even(st: Stage) -> Stage:
        """``st``'s tasks cut to fill whole waves (``even_wave_rows``; one rank, unsplit)."""
        if not even_waves or tp != 1 or st.k_splits != 1:
            return st
        rows = even_wave_rows(st.n, st.rows_per_task, grid(st.kernel))
        if rows == st.rows_per_task:
            return st
        return replace(st, num_tasks=-(-st.n // rows), rows_per_task=rows, tile_rows=st.rows_per_task)

    def gemv(kernel, name, index, n, k, reads, writes, offset):
        in_bytes = 2 if reads[0] in LAUNCH_INPUTS[kernel] else mailbox_bytes(mailbox, reads[0])
        rows = gemv_rows_per_task(
            n,
            k,
            W,
            grid(kernel),
            matrices=2 if name == "gate_up" else 1,
            input_word_bytes=in_bytes,
            task_bytes=task_bytes,
            min_rows=min_rows,
            burst=burst,
        )
        g = grid(kernel)
        return Stage(kernel, name, index, "gemv", -(-n // rows), offset % g, tuple(reads), tuple(writes), rows, n, k)

    k1: list[Stage] = []
    qkv = even(gemv(K1, "qkv", 0, L.qkv, L.hidden, ["x"], ["qkv"], 0))
    k1.append(qkv)
    attn_tasks = W * L.kv_heads * S
    attn = Stage(
        K1, "attn", 1, "attention", attn_tasks, (qkv.offset + qkv.num_tasks) % G1, ("qkv",), ("attn_acc", "attn_ml")
    )
    k1.append(attn)
    k1.append(
        Stage(
            K1,
            "combine",
            2,
            "combine",
            W * L.heads,
            (attn.offset + attn.num_tasks) % G1,
            ("attn_acc", "attn_ml"),
            ("attn_out",),
        )
    )

    k2: list[Stage] = []
    o = even(split(gemv(K2, "o_proj", 0, L.hidden, L.q, ["attn_out"], [o_dst], 0), "o_part"))
    k2.append(o)
    post = Stage(K2, "post", 1, "rownorm", W, (o.offset + o.num_tasks) % G, (o.writes[0], "x"), ("h", "hn"))
    k2.append(post)
    gu = even(gemv(K2, "gate_up", 2, L.intermediate, L.hidden, ["hn"], ["act"], post.offset + post.num_tasks))
    k2.append(gu)
    down_reads = ["act"] if final else ["act", "h"]
    down = gemv(K2, "down", 3, L.hidden, L.intermediate, down_reads, [d_dst], gu.offset + gu.num_tasks)
    down = even(split(down, "d_part", ("act",)))  # a split down's residual add moves to a final stage
    # two equal halves (one copy of each task loop in the kernels) of a gate/up long enough that
    # the wait they fill outweighs a second pipeline ramp per stage; down whole otherwise. Even
    # waves come first: where they cut gate/up's tasks, its last wave is full and ends at about
    # the same time on every workgroup, so less wait is left to fill than a second ramp costs
    # (27B width 1, H200: 14.16 ms, 14.23 with halves of the cut rows, 14.41 with halves of the
    # uncut ones; run 39).
    halves = gu.num_tasks % 2 == 0 and gu.n == gu.num_tasks * gu.rows_per_task
    long = early_down_waves and gu.num_tasks >= early_down_waves * G
    if long and W == 1 and tp == 1 and down.k_splits == 1 and halves:
        k2[-1:] = _early_halves(gu, down, G)
    else:
        k2.append(down)
    if final or down.k_splits > 1:
        k2.append(
            Stage(K2, "final", 0, "rownorm", W, (down.offset + down.num_tasks) % G, (down.writes[0], "h"), ("x_out",))
        )
    return tuple(k1), tuple(replace(st, index=i) for i, st in enumerate(k2))


def _early_halves(gu: Stage, down: Stage, G: int) -> list[Stage]:
    """``early_down_waves``: gate/up as its first half of row tiles then the rest, down as the first
    half of K (those rows' columns; an fp32 partial) then the rest plus that partial. Both down
    halves of a row tile run on the same workgroup (same offset), which adds its own partial."""
    half = gu.num_tasks // 2
    lo = half * gu.rows_per_task  # gate/up rows of the first half = down's first K columns
    return [
        replace(gu, name="gate_up_lo", num_tasks=half, n=lo),
        replace(gu, num_tasks=gu.num_tasks - half, offset=(gu.offset + half) % G, n=gu.n - lo, row0=lo),
        replace(down, name="down_lo", k=lo, reads=("act",), writes=("d_lo",)),
        replace(down, k=down.k - lo, k0=lo, reads=("act", "d_lo", *down.reads[1:])),
    ]


def plan_layer(
    dims: ModelDims,
    tp_size: int,
    width: int,
    num_workgroups: int,
    *,
    mailbox: str = "tagged",
    narrow_mailbox: str | None = None,
    wide_task_bytes: int = TASK_BYTES,
    narrow_task_bytes: int = TASK_BYTES,
    wide_min_rows: int = 0,
    wide_burst: float = 0.0,
    wide_split_k: int = 0,
    wide_even_waves: bool = False,
    early_down_waves: int = 0,
    narrow_even_waves: bool = False,
) -> LayerPlan:
    """The plan of one width (its layout starts at offset 0; ``plan_model`` places it)."""
    mb = _check_mailbox(narrow_mailbox if width == 1 and narrow_mailbox else mailbox)
    knobs = _tiling_knobs(
        width,
        wide_task_bytes,
        narrow_task_bytes,
        wide_min_rows,
        wide_burst,
        wide_split_k,
        wide_even_waves,
        early_down_waves,
        narrow_even_waves,
    )
    return _plan_width(dims, tp_size, width, num_workgroups, 0, 0, mb, *knobs)


def _tiling_knobs(
    width: int,
    wide_task_bytes: object,
    narrow_task_bytes: object,
    wide_min_rows: object,
    wide_burst: object,
    wide_split_k: object = 0,
    wide_even_waves: object = False,
    early_down_waves: object = 0,
    narrow_even_waves: object = False,
) -> tuple[int, int, float, int, bool, int]:
    """The GEMV tiling knobs at ``width``, checked: the rows chooser's (fixed cost per task,
    narrowest tile, burst), the most K slices (``split_k_slices``), both at widths > 1 only,
    whether tasks are cut to fill whole waves (``even_wave_rows``; ``wide_even_waves`` at widths
    > 1, ``narrow_even_waves`` at width 1), and the least gate/up waves for down in halves
    (``early_down_waves``, width 1 only)."""
    for name, flag in (("wide_even_waves", wide_even_waves), ("narrow_even_waves", narrow_even_waves)):
        if not isinstance(flag, bool):
            raise ConfigError(f"kernel plan: {name} must be true or false, got {flag!r}")
    early = _check_count(early_down_waves, "early_down_waves")
    if width == 1:
        _check_count(wide_split_k, "wide_split_k")
        return _check_count(narrow_task_bytes, "narrow_task_bytes"), 0, 0.0, 0, narrow_even_waves, early
    return (
        _check_count(wide_task_bytes, "wide_task_bytes"),
        _check_count(wide_min_rows, "wide_min_rows"),
        _check_burst(wide_burst),
        _check_count(wide_split_k, "wide_split_k"),
        wide_even_waves,
        0,
    )


def _check_burst(burst: object) -> float:
    if not isinstance(burst, (int, float)) or isinstance(burst, bool) or not 0 <= burst <= 64:
        raise ConfigError(f"kernel plan: wide_burst must be a number in [0, 64], got {burst!r}")
    return float(burst)


def _check_count(value: object, name: str) -> int:
    """A non-negative integer plan knob (bytes per task, rows)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"kernel plan: {name} must be a non-negative integer, got {value!r}")
    return value


def _plan_width(
    dims: ModelDims,
    tp: int,
    W: int,
    G: int,
    offset: int,
    peer_offset: int,
    mailbox: str = "tagged",
    task_bytes: int = TASK_BYTES,
    min_rows: int = 0,
    burst: float = 0.0,
    split_k: int = 0,
    even_waves: bool = False,
    early_down_waves: int = 0,
    k1_workgroups: int = 0,
) -> LayerPlan:
    """``k1_workgroups``: K1's grid where it differs from ``G`` (K2's; 0: the same)."""
    if not isinstance(dims, ModelDims):
        raise ConfigError(f"kernel plan: dims must be a ModelDims, got {type(dims).__name__}")
    W = _check_width(W)
    G = _check_workgroups(G)
    G1 = _check_workgroups(k1_workgroups) if k1_workgroups else G
    L = local_dims(dims, tp)
    S = attention_splits(W, L.kv_heads, G1)  # K1's attention tasks run on K1's grid
    knobs = (mailbox, task_bytes, min_rows, burst, split_k, even_waves, early_down_waves)
    k1, k2 = _stages(dims, L, W, G, S, tp, *knobs, G1=G1)
    final = k2[-1].name == "final"
    o_ks, d_ks = (st.k_splits for st in k2 if st.name in ("o_proj", "down"))
    names = frozenset(st.name for st in k1 + k2)
    regions, end = _pack(_width_regions(L, W, S, tp, final, mailbox, o_ks, d_ks, names), offset)
    layout = WidthLayout(W, _align(offset), end - _align(offset), regions)
    peer = None
    if tp > 1:
        pregions, pend = _pack(_peer_regions(L, W, tp, mailbox), peer_offset)
        peer = WidthLayout(W, _align(peer_offset), pend - _align(peer_offset), pregions)
    k1_grid = G1 if G1 != G else 0
    return LayerPlan(dims.digest(), tp, W, G, L, S, dims.post_norms, k1, k2, layout, peer, mailbox, k1_grid)


@dataclass(frozen=True)
class ModelPlan:
    """Plans of every built width and the one scratch (and peer) buffer that holds them all."""

    dims_digest: str
    tp_size: int
    num_workgroups: int
    widths: tuple[int, ...]
    layers: dict[int, LayerPlan]
    scratch: ScratchLayout
    peer: ScratchLayout | None = None
    extra: dict = field(default_factory=dict)

    def for_rows(self, rows: int) -> LayerPlan:
        """The plan of the smallest built width that fits ``rows``."""
        for w in self.widths:
            if rows <= w:
                return self.layers[w]
        raise ConfigError(f"kernel plan: {rows} rows exceed the largest built width {self.widths[-1]}")

    def to_dict(self) -> dict:
        return {
            "plan_version": PLAN_VERSION,
            "dims_digest": self.dims_digest,
            "tp_size": self.tp_size,
            "num_workgroups": self.num_workgroups,
            "widths": list(self.widths),
            "layers": [self.layers[w].to_dict() for w in self.widths],
            "scratch": self.scratch.to_dict(),
            "peer": self.peer.to_dict() if self.peer else None,
        }

    def digest(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def _check_widths(widths: object) -> tuple[int, ...]:
    if not isinstance(widths, (list, tuple)) or not widths:
        raise ConfigError(f"kernel plan: widths must be a non-empty list of integers, got {widths!r}")
    out = tuple(_check_width(w) for w in widths)
    if len(set(out)) != len(out):
        raise ConfigError(f"kernel plan: widths must not repeat, got {list(out)}")
    return tuple(sorted(out))


def plan_model(
    dims: ModelDims,
    tp_size: int,
    widths: Iterable[int],
    num_workgroups: int,
    *,
    mailbox: str = "tagged",
    narrow_mailbox: str | None = None,
    wide_task_bytes: int = TASK_BYTES,
    narrow_task_bytes: int = TASK_BYTES,
    wide_min_rows: int = 0,
    wide_burst: float = 0.0,
    wide_split_k: int = 0,
    wide_even_waves: bool = False,
    early_down_waves: int = 0,
    narrow_even_waves: bool = False,
    wide_workgroups: int = 0,
    wide_k1_workgroups: int = 0,
) -> ModelPlan:
    """Plans for every width, placed in one scratch buffer: header, then width segments.

    ``mailbox``: the mailbox format (``MAILBOX_FORMATS``); ``narrow_mailbox``: the format at
    width 1 if different; ``wide_task_bytes`` / ``narrow_task_bytes``: the GEMV rows chooser's
    fixed cost per task at widths > 1 (matrix-instruction tiles ramp up slower than the width-1
    ones) and at width 1 (a larger one keeps wide row tiles: more bytes in flight per task);
    ``wide_min_rows``: the narrowest GEMV row tile at widths > 1; ``wide_burst``: the rows
    chooser's bandwidth model at widths > 1 (``gemv_rows_per_task``'s ``burst``);
    ``wide_split_k``: the most K slices of o_proj and down at widths > 1 (0: never split);
    ``wide_even_waves`` / ``narrow_even_waves``: GEMV tasks at widths > 1 / at width 1 cut to fill
    whole waves (``even_wave_rows``; where that cuts gate/up's tasks at width 1, down stays whole);
    ``early_down_waves``: width 1's down in two K halves, the first started early, where gate/up
    spans at least this many waves of the grid (module docstring; 0: never); ``wide_workgroups``:
    the grid at widths > 1 when it differs from width 1's (several smaller workgroups per compute
    unit; 0: ``num_workgroups``); ``wide_k1_workgroups``: K1's grid at widths > 1 when it differs
    from K2's (0: the same)."""
    ws = _check_widths(list(widths) if not isinstance(widths, (list, tuple)) else widths)
    mailbox = _check_mailbox(mailbox)
    narrow = _check_mailbox(narrow_mailbox) if narrow_mailbox else mailbox
    tiling = (
        wide_task_bytes,
        narrow_task_bytes,
        wide_min_rows,
        wide_burst,
        wide_split_k,
        wide_even_waves,
        early_down_waves,
        narrow_even_waves,
    )
    for w in (1, 2):  # every knob is checked, whichever widths are planned
        _tiling_knobs(w, *tiling)
    header, cur = _pack([("health", (1,), 4)], 0)
    peer_cur = 0
    layers: dict[int, LayerPlan] = {}
    segs: dict[int, WidthLayout] = {}
    psegs: dict[int, WidthLayout] = {}
    for w in ws:
        knobs = _tiling_knobs(w, *tiling)
        grid = wide_workgroups if w > 1 and wide_workgroups else num_workgroups
        k1_grid = wide_k1_workgroups if w > 1 else 0
        lp = _plan_width(dims, tp_size, w, grid, cur, peer_cur, narrow if w == 1 else mailbox, *knobs, k1_grid)
        layers[w] = lp
        segs[w] = lp.layout
        cur = lp.layout.end
        if lp.peer_layout is not None:
            psegs[w] = lp.peer_layout
            peer_cur = lp.peer_layout.end
    scratch = ScratchLayout(cur, header, segs)
    peer = ScratchLayout(peer_cur, {}, psegs) if tp_size > 1 else None
    return ModelPlan(dims.digest(), tp_size, num_workgroups, ws, layers, scratch, peer)


def key_inputs(
    dims: ModelDims,
    *,
    weight_dtype: str,
    kv_dtype: str,
    tp_size: int,
    widths: Iterable[int],
    block_size: int,
    num_workgroups: int,
    mailbox: str = "tagged",
    narrow_mailbox: str | None = None,
    wide_task_bytes: int = TASK_BYTES,
    narrow_task_bytes: int = TASK_BYTES,
    wide_min_rows: int = 0,
    wide_burst: float = 0.0,
    wide_split_k: int = 0,
    wide_even_waves: bool = False,
) -> dict:
    """Everything the plan contributes to a build key, as a canonical dict
    (``services.buildkey.build_key`` hashes it together with backend, arch, source and compiler).

    ``plan_digest`` covers the task tables and the scratch layout, so any change to the plan
    (or to the workgroup count, e.g. a partitioned GPU) yields a different key.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"kernel plan: weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kernel plan: kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"kernel plan: block_size must be a positive integer, got {block_size!r}")
    mp = plan_model(
        dims,
        tp_size,
        list(widths),
        num_workgroups,
        mailbox=mailbox,
        narrow_mailbox=narrow_mailbox,
        wide_task_bytes=wide_task_bytes,
        narrow_task_bytes=narrow_task_bytes,
        wide_min_rows=wide_min_rows,
        wide_burst=wide_burst,
        wide_split_k=wide_split_k,
        wide_even_waves=wide_even_waves,
    )
    return {
        "plan_version": PLAN_VERSION,
        "dims_digest": dims.digest(),
        "weight_dtype": weight_dtype,
        "kv_dtype": kv_dtype,
        "tp_size": tp_size,
        "widths": list(mp.widths),
        "block_size": block_size,
        "num_workgroups": num_workgroups,
        "mailbox": mailbox,
        "narrow_mailbox": narrow_mailbox or mailbox,
        "wide_task_bytes": wide_task_bytes,
        "narrow_task_bytes": narrow_task_bytes,
        "wide_min_rows": wide_min_rows,
        "wide_burst": wide_burst,
        **({"wide_split_k": wide_split_k} if wide_split_k else {}),  # keys without them unchanged
        **({"wide_even_waves": True} if wide_even_waves else {}),
        "plan_digest": mp.digest(),
    }
