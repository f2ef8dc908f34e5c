"""The kernel plan (monodecode/kernels/plan.py): coverage, dependencies, layouts, bad inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from monodecode.errors import ConfigError
from monodecode.kernels import plan as P
from monodecode.model.profiles import profile_dims

# (profile, tp, widths, workgroups): small and real dims, odd widths/grids, TP with GQA.
CASES = [
    ("tiny", 1, (1, 2, 3, 8), 7),
    ("tiny", 2, (1, 5), 16),
    ("llama3-1b", 1, (1, 8), 132),
    ("llama3-8b", 1, (1, 4), 132),
    ("llama3-8b", 2, (2,), 304),
    ("qwen3-8b", 1, (1,), 256),
    ("gemma3-27b", 1, (1, 8), 132),
    ("gemma3-27b", 4, (3,), 304),
]


def _region_shapes(lp: P.LayerPlan) -> dict[str, tuple[int, ...]]:
    L = lp.local
    shapes = {name: r.shape for name, r in lp.layout.regions.items()}
    if lp.peer_layout is not None:
        for name, r in lp.peer_layout.regions.items():
            shapes[name] = r.shape[1:]  # this rank's slot
    shapes["attn_out"] = (lp.width, L.q)
    shapes["x_out"] = (lp.width, L.hidden)
    return shapes


@pytest.mark.parametrize("profile,tp,widths,G", CASES)
def test_every_output_element_written_exactly_once(profile, tp, widths, G):
    dims = profile_dims(profile)
    for w in widths:
        lp = P.plan_layer(dims, tp, w, G)
        shapes = _region_shapes(lp)
        for kernel in (P.K1, P.K2):
            counts: dict[str, np.ndarray] = {}
            for st in lp.stages(kernel):
                for name in st.writes:
                    counts.setdefault(name, np.zeros(int(np.prod(shapes[name])), dtype=np.int32))
                for tk in lp.tasks(kernel, st.name):
                    for sp in tk.writes:
                        assert 0 <= sp.start < sp.stop <= counts[sp.region].size, (kernel, st.name, sp)
                        counts[sp.region][sp.start : sp.stop] += 1
            for name, c in counts.items():
                assert c.min() == 1 and c.max() == 1, f"{profile} w={w} {kernel}: {name} coverage {c.min()}..{c.max()}"
            # every launch output is produced
            for out in P.LAUNCH_OUTPUTS[kernel]:
                assert out in counts, f"{kernel} never writes {out}"


@pytest.mark.parametrize("profile,tp,widths,G", CASES)
def test_dependencies_only_on_earlier_stages_and_grid_completes(profile, tp, widths, G):
    dims = profile_dims(profile)
    for w in widths:
        lp = P.plan_layer(dims, tp, w, G)
        for kernel in (P.K1, P.K2):
            order = {st.name: st.index for st in lp.stages(kernel)}
            graph = lp.dependency_graph(kernel)
            for (stage, t), deps in graph.items():
                for dstage, _ in deps:
                    assert order[dstage] < order[stage], f"{kernel}.{stage}[{t}] waits on {dstage}"
            # every mailbox region a stage reads is written by an earlier stage of the launch
            written: set[str] = set()
            for st in lp.stages(kernel):
                for src in st.reads:
                    assert src in written or src in P.LAUNCH_INPUTS[kernel], f"{kernel}.{st.name} reads {src}"
                written.update(st.writes)
            # stages past the first read something produced in this launch
            for st in lp.stages(kernel)[1:]:
                assert any(graph[(st.name, t)] for t in range(st.num_tasks)), st.name
            _simulate(lp, kernel, graph)


def _simulate(lp: P.LayerPlan, kernel: str, graph) -> None:
    """Each workgroup runs its tasks stage by stage, in task order, waiting on dependencies;
    all workgroups resident. Progress must always be possible until every task is done."""
    G = lp.workgroups(kernel)
    queues = [[(st.name, t) for st in lp.stages(kernel) for t in st.tasks_of(b, G)] for b in range(G)]
    done: set[tuple[str, int]] = set()
    pos = [0] * G
    total = sum(len(q) for q in queues)
    while len(done) < total:
        progressed = False
        for b in range(G):
            while pos[b] < len(queues[b]) and graph[queues[b][pos[b]]] <= done:
                done.add(queues[b][pos[b]])
                pos[b] += 1
                progressed = True
        assert progressed, f"{kernel}: deadlock with {total - len(done)} tasks left"


@pytest.mark.parametrize("profile", ["llama3-8b", "gemma3-27b"])
def test_k1_on_a_grid_of_its_own(profile):
    """``wide_k1_workgroups``: K1's stages (and its attention splits) are planned on K1's grid,
    K2's on theirs; width 1 and a K1 grid equal to K2's keep the plan (and digest) unchanged."""
    dims = profile_dims(profile)
    base = dict(mailbox="bf16", wide_min_rows=64, wide_split_k=4, wide_workgroups=264)
    own = P.plan_model(dims, 1, [1, 8], 264, **base, wide_k1_workgroups=132)
    same = P.plan_model(dims, 1, [1, 8], 264, **base)
    assert P.plan_model(dims, 1, [1, 8], 264, **base, wide_k1_workgroups=264).digest() == same.digest()
    assert own.layers[1] == same.layers[1]
    lp = own.layers[8]
    assert (lp.workgroups(P.K1), lp.workgroups(P.K2)) == (132, 264)
    assert lp.k2 == same.layers[8].k2
    assert lp.attn_splits == P.attention_splits(8, lp.local.kv_heads, 132)
    for kernel in (P.K1, P.K2):
        table = lp.task_table(kernel)
        assert max(max(t) for t in table if t) < lp.workgroups(kernel)
        _simulate(lp, kernel, lp.dependency_graph(kernel))
    assert own.digest() != same.digest()
    with pytest.raises(ConfigError, match="num_workgroups must be a positive integer") as e:
        P.plan_model(dims, 1, [8], 264, wide_k1_workgroups=-1)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("G", [1, 5, 132, 304])
def test_task_tables_partition_tasks_over_workgroups(G):
    lp = P.plan_layer(profile_dims("llama3-8b"), 1, 2, G)
    for st in lp.stages():
        seen = []
        for b in range(G):
            mine = list(st.tasks_of(b, G))
            assert all(st.workgroup_of(t, G) == b for t in mine)
            assert mine == sorted(mine) and all(y - x == G for x, y in zip(mine, mine[1:]))
            seen.extend(mine)
        assert sorted(seen) == list(range(st.num_tasks))
    table = lp.task_table(P.K2)
    assert [len(t) for t in table] == [s.num_tasks for s in lp.k2]


def test_gemv_tasks_cover_rows_and_wide_tiles_fit_matrix_units():
    dims = profile_dims("llama3-8b")
    for w in (1, 2, 8):
        lp = P.plan_layer(dims, 1, w, 132)
        for st in lp.stages():
            if st.kind == "gemv":
                assert st.num_tasks * st.rows_per_task >= st.n > (st.num_tasks - 1) * st.rows_per_task
                assert st.rows_per_task >= (16 if w > 1 else 4)
        assert lp.attn_splits * w * lp.local.kv_heads <= max(132, w * lp.local.kv_heads)


@pytest.mark.parametrize("tp", [1, 2])
def test_width_layouts_never_alias(tp):
    dims = profile_dims("gemma3-27b" if tp == 1 else "llama3-8b")
    mp = P.plan_model(dims, tp, [8, 1, 2, 4, 3], 132)
    assert mp.widths == (1, 2, 3, 4, 8)
    for layout in [mp.scratch] + ([mp.peer] if mp.peer else []):
        regions = sorted(layout.regions(), key=lambda r: r.offset)
        assert regions, "empty layout"
        for r in regions:
            assert r.offset % P.ALIGN == 0 and r.nbytes > 0 and r.end <= layout.nbytes
        for a, b in zip(regions, regions[1:]):
            assert a.end <= b.offset, f"{a.name} overlaps {b.name}"
        segs = sorted(layout.widths.values(), key=lambda s: s.offset)
        for a, b in zip(segs, segs[1:]):
            assert a.end <= b.offset, f"width {a.width} segment overlaps width {b.width}"
        for seg in segs:
            for r in seg.regions.values():
                assert seg.offset <= r.offset and r.end <= seg.end
    # each width has its own epoch counters and every mailbox region a stage uses
    for w, lp in mp.layers.items():
        assert {"epoch_k1", "epoch_k2", "done_k1", "done_k2", "qkv", "act"} <= set(lp.layout.regions)
        assert lp.region("done_k2").shape == (len(lp.counted_stages(P.K2)),)
        for kernel, names in P.DONE_STAGES.items():
            assert all(lp.stage(kernel, n) for n in names)
        assert lp.layout is mp.scratch.widths[w]
    assert mp.scratch.header["health"].offset == 0
    assert mp.for_rows(3).width == 3 and mp.for_rows(5).width == 8
    with pytest.raises(ConfigError, match="exceed the largest built width 8"):
        mp.for_rows(9)


def test_mailbox_words_are_8_bytes_and_regions_sized_from_dims():
    dims = profile_dims("llama3-8b")
    lp = P.plan_layer(dims, 1, 4, 132)
    qkv = lp.region("qkv")
    assert qkv.word_bytes == 8 and qkv.shape == (4, dims.q_size + 2 * dims.kv_size)
    assert lp.region("act").shape == (4, dims.intermediate_size)
    assert lp.region("attn_acc").shape == (4, dims.num_heads, lp.attn_splits, dims.head_dim)


def test_bf16_mailbox_regions_and_per_width_choices():
    """``mailbox="bf16"``: activations in 2-byte elements, attention partials in 4, counters stay
    8-byte words; ``narrow_mailbox`` changes width 1 only; ``wide_task_bytes`` changes the rows
    chooser at widths > 1 only (8B gate/up at width 2: 16-row tiles at 4 KiB per task, 64 at 64 KiB)."""
    dims = profile_dims("llama3-8b")
    mp = P.plan_model(dims, 1, [1, 2], 132, mailbox="bf16", narrow_mailbox="tagged", wide_task_bytes=65536)
    w1, w2 = mp.layers[1], mp.layers[2]
    assert (w1.mailbox, w2.mailbox) == ("tagged", "bf16")
    assert w1.region("qkv").word_bytes == 8 and w1.region("attn_acc").word_bytes == 8
    for name, size in (("qkv", 2), ("o", 2), ("h", 2), ("hn", 2), ("act", 2), ("attn_acc", 4), ("attn_ml", 4)):
        assert w2.region(name).word_bytes == size, name
    assert w2.region("epoch_k1").word_bytes == 8 and w2.region("done_k2").word_bytes == 8
    act = w2.region("act")
    assert act.nbytes == 2 * 2 * dims.intermediate_size and act.word_offset * 2 == act.offset
    assert P.plan_model(dims, 1, [2], 132, mailbox="bf16").layers[2].stage(P.K2, "gate_up").rows_per_task == 16
    assert w2.stage(P.K2, "gate_up").rows_per_task == 64
    plain = P.plan_model(dims, 1, [1, 2], 132)
    assert plain.layers[1].stage(P.K2, "gate_up") == w1.stage(P.K2, "gate_up")  # width 1 untouched
    assert plain.digest() != mp.digest()
    tp = P.plan_layer(dims, 2, 2, 132, mailbox="bf16")
    assert tp.region("o_peer").word_bytes == 2 and tp.region("d_peer").word_bytes == 2


def test_row_tile_knobs_keep_tiles_wide_enough():
    """``narrow_task_bytes``: at width 1 the bf16 mailbox's cheaper input made 27B gate/up pick
    8-row tiles (too few bytes in flight: 27B batch 1 21.4 ms against 16.8, H200 run 9); a fixed
    cost of 16 KiB per task keeps the tagged plan's 16 rows. ``wide_min_rows``: widths > 1 skip
    narrower tiles (FP8 matrix instructions take 64 rows); width 1 ignores it."""
    gemma = profile_dims("gemma3-27b")
    cheap = P.plan_model(gemma, 1, [1], 132, mailbox="bf16")
    assert cheap.layers[1].stage(P.K2, "gate_up").rows_per_task == 8
    kept = P.plan_model(gemma, 1, [1], 132, mailbox="bf16", narrow_task_bytes=16384)
    tagged = P.plan_model(gemma, 1, [1], 132, mailbox="tagged")
    assert [s.rows_per_task for s in kept.layers[1].k2] == [s.rows_per_task for s in tagged.layers[1].k2]
    dims = profile_dims("llama3-8b")
    free = P.plan_model(dims, 1, [1, 8], 132, mailbox="bf16", wide_task_bytes=65536)
    wide = P.plan_model(dims, 1, [1, 8], 132, mailbox="bf16", wide_task_bytes=65536, wide_min_rows=64)
    assert free.layers[8].stage(P.K2, "down").rows_per_task == 32
    assert {s.rows_per_task for s in wide.layers[8].k1 + wide.layers[8].k2 if s.kind == "gemv"} == {64}
    assert wide.layers[1].k2 == free.layers[1].k2


def test_burst_model_drops_partial_waves_of_narrow_tiles():
    """``wide_burst``: with the memory system as the limit, 27B down at width 2 takes 84 64-row
    tasks instead of 336 16-row ones (H200: 21.1 -> 17.4 ms per step), while 1B and 8B keep the
    tiles that measured fastest (forcing 32 or 64 rows cost them 4-15 %)."""
    gemma, llama1, llama8 = (profile_dims(p) for p in ("gemma3-27b", "llama3-1b", "llama3-8b"))

    def rows(dims, width, stage, **kw):
        mp = P.plan_model(dims, 1, [width], 132, mailbox="bf16", wide_task_bytes=65536, **kw)
        return mp.layers[width].stage(P.K2, stage).rows_per_task

    assert rows(gemma, 2, "down") == 16 and rows(gemma, 2, "down", wide_burst=1.5) == 64
    for dims, width, stage, kept in ((llama1, 8, "o_proj", 16), (llama1, 2, "down", 16), (llama8, 8, "down", 32)):
        assert rows(dims, width, stage) == rows(dims, width, stage, wide_burst=1.5) == kept
    assert P.plan_model(gemma, 1, [1], 132, wide_burst=1.5).layers[1] == P.plan_model(gemma, 1, [1], 132).layers[1]


def test_split_k_fills_the_grid_where_row_tiles_leave_it_idle():
    """``wide_split_k``: 27B's 84 o_proj / down tiles on 132 programs become 336 / 252 tasks (4 and
    3 K slices: 3 waves of quarter-K tasks, 2 of third-K ones), FP8 8B's 64 become 128; 8B bf16's
    128 fill the grid already and stay whole, and so does width 1. A split down of a model
    without post norms gets a final stage for the residual add; the partials' slices cover K
    exactly once and every post / final row reads all of them."""
    gemma, llama8 = profile_dims("gemma3-27b"), profile_dims("llama3-8b")

    def k2(dims, width, split, **kw):
        return P.plan_model(dims, 1, [width], 132, mailbox="bf16", wide_split_k=split, **kw).layers[width]

    g = k2(gemma, 8, 4, wide_task_bytes=65536, wide_burst=1.5)
    assert [(s.name, s.tiles, s.k_splits) for s in g.k2 if s.kind == "gemv"] == [
        ("o_proj", 84, 4),
        ("gate_up", 336, 1),
        ("down", 84, 3),
    ]
    assert g.region("o_part").shape == (4, 8, 5376) and g.region("d_part").word_bytes == 4
    f = k2(llama8, 8, 4, wide_task_bytes=65536, wide_burst=1.5, wide_min_rows=64)
    assert [(s.name, s.num_tasks, s.k_splits) for s in f.k2 if s.kind == "gemv"][::2] == [
        ("o_proj", 128, 2),
        ("down", 128, 2),
    ]
    assert [s.name for s in f.k2][-1] == "final" and f.stage(P.K2, "final").reads == ("d_part", "h")
    assert f.stage(P.K2, "down").reads == ("act",)  # the residual moved to final
    whole = k2(llama8, 8, 4, wide_task_bytes=65536, wide_burst=1.5)
    assert whole.k2 == k2(llama8, 8, 0, wide_task_bytes=65536, wide_burst=1.5).k2
    assert k2(gemma, 1, 4) == k2(gemma, 1, 0)
    for plan in (g, f):
        deps = plan.dependency_graph(P.K2)
        o, post = plan.stage(P.K2, "o_proj"), plan.stage(P.K2, "post")
        assert all(len(deps[("post", r)]) == o.num_tasks for r in range(post.num_tasks))
        d = plan.stage(P.K2, "down")
        covered = sorted((sp.start, sp.stop) for t in plan.tasks(P.K2, "down") for sp in t.reads if sp.region == "act")
        slices = [
            (r * d.k + q * d.k_per_task, r * d.k + (q + 1) * d.k_per_task) for r in range(8) for q in range(d.k_splits)
        ]
        assert covered == sorted(slices * d.tiles)  # each row's K slices, once per row tile


def test_split_k_slices_choice():
    assert P.split_k_slices(84, 21504, 132, 4) == 3
    assert P.split_k_slices(84, 4096, 132, 4) == 4
    assert P.split_k_slices(64, 14336, 132, 4) == 2  # 4 slices tie with 2: fewer wins
    assert P.split_k_slices(128, 14336, 132, 4) == 1
    assert P.split_k_slices(84, 21504, 132, 2) == 1  # 2 slices: 2 waves of half tasks, no gain
    assert P.split_k_slices(64, 4096 + 64, 132, 4) == 1  # K not a multiple of 2 x 64


def test_even_waves_fill_the_last_wave_with_narrower_tasks():
    """``wide_even_waves``: GEMV tasks whose tiles leave the grid's last wave partly idle own fewer
    rows of the same tile, the same waves all full: 27B gate/up's 336 64-row tasks (2.5 waves of
    132) become 391 of 55 rows, 8B QKV's 96 (one wave, 36 programs idle) 131 of 47. Split stages,
    stages that fill their waves, width 1 and TP keep their tasks; each row is written once. Width 1
    has its own switch (``narrow_even_waves``)."""
    gemma, llama8 = profile_dims("gemma3-27b"), profile_dims("llama3-8b")
    tiling = dict(mailbox="bf16", wide_task_bytes=65536, wide_burst=1.5, wide_split_k=4)

    def plan(dims, width, even, tp=1):
        return P.plan_model(dims, tp, [width], 132, wide_even_waves=even, **tiling).layers[width]

    g = plan(gemma, 8, True)
    cut = {s.name: (s.num_tasks, s.rows_per_task, s.tile) for s in g.k1 + g.k2 if s.tile_rows}
    assert cut == {"qkv": (131, 63, 64), "gate_up": (391, 55, 64)}  # o_proj / down are split
    l8 = plan(llama8, 8, True)
    assert {s.name: (s.num_tasks, s.rows_per_task) for s in l8.k1 + l8.k2 if s.tile_rows} == {
        "qkv": (131, 47),
        "gate_up": (261, 55),
    }
    assert l8.stage(P.K2, "o_proj") == plan(llama8, 8, False).stage(P.K2, "o_proj")  # 128 tasks: full
    assert plan(gemma, 1, True) == plan(gemma, 1, False)
    assert not any(s.tile_rows for s in plan(llama8, 2, True, tp=2).k1)
    for p in (g, l8):
        for name in ("qkv", "gate_up"):
            st = p.stage(P.K1 if name == "qkv" else P.K2, name)
            dst = st.writes[0]
            spans = sorted((sp.start, sp.stop) for t in p.tasks(st.kernel, name) for sp in t.writes if sp.region == dst)
            rows = [i for a, b in spans for i in range(a, b)]
            assert rows == list(range(p.width * st.n)), name  # every row once, no overlap
        waves = -(-max(s.num_tasks for s in p.k1 + p.k2 if s.tile_rows) // 132)
        assert waves == (3 if p is g else 2)  # as many waves as the 64-row tiles took
    # width 1 (``narrow_even_waves``): 27B's 16-row o_proj / down (2.5 waves) and gate/up (10.2)
    n1 = P.plan_model(gemma, 1, [1], 132, mailbox="bf16", narrow_task_bytes=16384, narrow_even_waves=True).layers[1]
    cut1 = {s.name: (s.num_tasks, s.rows_per_task, s.tile) for s in n1.k1 + n1.k2 if s.tile_rows}
    assert cut1 == {"o_proj": (384, 14, 16), "gate_up": (1434, 15, 16), "down": (384, 14, 16)}
    for name in ("o_proj", "gate_up", "down"):
        st = n1.stage(P.K2, name)
        spans = sorted(
            (sp.start, sp.stop) for t in n1.tasks(P.K2, name) for sp in t.writes if sp.region == st.writes[0]
        )
        assert [i for a, b in spans for i in range(a, b)] == list(range(st.n)), name


def test_early_down_halves_gate_up_and_down_where_gate_up_is_long():
    """``early_down_waves``: at width 1, where gate/up spans that many waves of the grid and
    halves evenly, gate/up runs as two stages (the first counted on its own) and down as two
    K halves: the first depends only on gate/up's first half, the second adds the first's
    partial on the same workgroup. Each act row, d_lo row and output row is written once and
    the grid completes. 1B's gate/up (512 tasks, 3.9 waves of 132), widths > 1, TP and 0 keep
    the plans as they were."""
    llama8, llama1 = profile_dims("llama3-8b"), profile_dims("llama3-1b")

    def plan(dims, width=1, waves=6, tp=1):
        return P.plan_model(dims, tp, [width], 132, mailbox="bf16", narrow_task_bytes=16384, early_down_waves=waves)

    lp = plan(llama8).layers[1]
    assert [s.name for s in lp.k2] == ["o_proj", "post", "gate_up_lo", "gate_up", "down_lo", "down"]
    assert [s.index for s in lp.k2] == list(range(6))
    lo, hi = lp.stage(P.K2, "gate_up_lo"), lp.stage(P.K2, "gate_up")
    dlo, dn = lp.stage(P.K2, "down_lo"), lp.stage(P.K2, "down")
    assert (lo.num_tasks, hi.num_tasks, hi.row0, lo.n + hi.n) == (448, 448, 7168, 14336)
    assert (dlo.k, dn.k0, dn.k, dlo.offset) == (7168, 7168, 7168, dn.offset)
    assert lp.counted_stages(P.K2) == (*P.DONE_STAGES[P.K2], "gate_up_lo")
    assert lp.region("done_k2").shape == (5,) and lp.region("d_lo").word_bytes == 4
    for region, stages in (("act", ("gate_up_lo", "gate_up")), ("d_lo", ("down_lo",)), ("x_out", ("down",))):
        spans = sorted((sp.start, sp.stop) for n in stages for t in lp.tasks(P.K2, n) for sp in t.writes)
        assert [i for a, b in spans for i in range(a, b)] == list(
            range(lp.region(region).words if region != "x_out" else 4096)
        )
    deps = lp.dependency_graph(P.K2)
    assert all({d for d, _ in deps[("down_lo", t)]} == {"gate_up_lo"} for t in range(dlo.num_tasks))
    for t in range(dn.num_tasks):
        assert ("down_lo", t) in deps[("down", t)] and dlo.workgroup_of(t, 132) == dn.workgroup_of(t, 132)
        assert {d for d, _ in deps[("down", t)]} == {"gate_up", "down_lo", "post"}  # post: h
    _simulate(lp, P.K2, deps)
    gemma = plan(profile_dims("gemma3-27b")).layers[1]
    assert [s.name for s in gemma.k2][-3:] == ["down_lo", "down", "final"]
    assert gemma.stage(P.K2, "down").writes == ("d",)
    assert plan(llama1).layers[1].k2 == plan(llama1, waves=0).layers[1].k2  # 3.9 waves: whole
    assert plan(llama8, waves=0).layers[1].counted_stages(P.K2) == P.DONE_STAGES[P.K2]
    assert plan(llama8, width=2).layers[2].k2 == plan(llama8, width=2, waves=0).layers[2].k2
    assert "down_lo" not in {s.name for s in plan(llama8, tp=2).layers[1].k2}


def test_even_wave_rows_choice():
    assert P.even_wave_rows(21504, 64, 132) == 55  # 336 tiles, 3 waves -> 391 tasks
    assert P.even_wave_rows(6144, 64, 132) == 47  # 96 tiles, one wave -> 131 tasks
    assert P.even_wave_rows(4096, 32, 132) == 32  # 128 tiles already one wave of 32-row tasks
    assert P.even_wave_rows(8448, 64, 132) == 64  # exactly one full wave
    assert P.even_wave_rows(100, 64, 132) == 1  # fewer rows than programs: one row each


def test_family_variants_and_tp_stages():
    llama = P.plan_layer(profile_dims("llama3-8b"), 1, 1, 132)
    gemma = P.plan_layer(profile_dims("gemma3-27b"), 1, 1, 132)
    assert [s.name for s in llama.k2] == ["o_proj", "post", "gate_up", "down"]
    assert llama.stage(P.K2, "down").writes == ("x_out",)
    assert [s.name for s in gemma.k2] == ["o_proj", "post", "gate_up", "down", "final"]
    tp = P.plan_layer(profile_dims("llama3-8b"), 2, 1, 132)
    assert tp.stage(P.K2, "o_proj").writes == ("o_peer",) and tp.stage(P.K2, "final").reads[0] == "d_peer"
    assert tp.local.heads == 16 and tp.local.intermediate == 7168 and tp.peer_layout is not None
    rep = P.local_dims(profile_dims("llama3-8b"), 16)  # 8 KV heads over 16 ranks: replicated
    assert rep.kv_heads == 1 and rep.heads == 2


def test_fused_post_only_where_post_just_adds_the_residual_and_normalises():
    """``LayerPlan.fused_post_eligible``, the rule both backends' fused-post switches apply: a
    Llama/Qwen layer on one rank with the bf16 mailbox and an o_proj whose tasks own whole rows;
    not with Gemma's post norms, TP (partials from every rank to sum), the tagged mailbox or an
    o_proj split along K (fp32 slices to sum)."""

    def plan(profile, width, tp=1, mailbox="bf16", split=0):
        return P.plan_model(profile_dims(profile), tp, [width], 304, mailbox=mailbox, wide_split_k=split).layers[width]

    def eligible(*args, **kw):
        return plan(*args, **kw).fused_post_eligible

    assert eligible("llama3-8b", 1) and eligible("llama3-8b", 8) and eligible("qwen3-8b", 4)
    assert eligible("llama3-1b", 2) and not eligible("llama3-1b", 2, split=4)
    assert plan("llama3-1b", 2, split=4).stage(P.K2, "o_proj").k_splits == 2  # on 304 CUs 1B's o_proj splits
    assert not eligible("gemma3-27b", 1) and not eligible("tiny", 1)  # post norms
    assert not eligible("llama3-8b", 1, tp=2) and not eligible("llama3-8b", 1, tp=2, mailbox="tagged")
    assert not eligible("llama3-8b", 1, mailbox="tagged")


def test_wait_health_code_uses_runtime_packing():
    from monodecode.kernels.health import decode_health

    fault = decode_health(P.wait_health_code(P.K2, 3))
    assert (fault.site, fault.kernel, fault.layer) == ("wait_timeout", "k2", 3)
    assert P.wait_health_code(P.K1, 0) == 1 | (1 << 8) | (1 << 10)


def test_key_inputs_deterministic_and_sensitive():
    dims = profile_dims("llama3-1b")
    base = dict(weight_dtype="bf16", kv_dtype="bf16", tp_size=1, widths=(1, 2, 4, 8), block_size=16, num_workgroups=132)
    a = P.key_inputs(dims, **base)
    assert a == P.key_inputs(dims, **{**base, "widths": [8, 4, 2, 1]})
    changes = (
        {"num_workgroups": 304},
        {"widths": (1, 2)},
        {"weight_dtype": "fp8"},
        {"block_size": 32},
        {"mailbox": "bf16"},
        {"narrow_mailbox": "bf16"},
        {"wide_task_bytes": 65536},
        {"narrow_task_bytes": 16384},
        {"wide_min_rows": 64},
        {"wide_burst": 1.5},
        {"wide_split_k": 4},
        {"wide_even_waves": True},
    )
    for change in changes:
        assert P.key_inputs(dims, **{**base, **change}) != a, change
    assert P.key_inputs(profile_dims("llama3-8b"), **base)["dims_digest"] != a["dims_digest"]


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda d: P.plan_layer(d, 3, 1, 132), "tp_size 3 does not divide num_heads 32"),
        (lambda d: P.plan_layer(d, 0, 1, 132), "tp_size must be a positive integer"),
        (lambda d: P.plan_layer(d, 1, 0, 132), "width must be an integer in 1..256"),
        (lambda d: P.plan_layer(d, 1, 257, 132), "width must be an integer in 1..256"),
        (lambda d: P.plan_layer(d, 1, "2", 132), "width must be an integer"),
        (lambda d: P.plan_layer(d, 1, True, 132), "width must be an integer"),
        (lambda d: P.plan_layer(d, 1, 1, 0), "num_workgroups must be a positive integer"),
        (lambda d: P.plan_layer(d, 1, 1, 2.5), "num_workgroups must be a positive integer"),
        (lambda d: P.plan_layer({"hidden_size": 1}, 1, 1, 8), "dims must be a ModelDims"),
        (lambda d: P.plan_model(d, 1, [], 132), "widths must be a non-empty list"),
        (lambda d: P.plan_model(d, 1, [1], 132, mailbox="fp16"), "mailbox must be one of tagged, bf16, got 'fp16'"),
        (lambda d: P.plan_model(d, 1, [1], 132, narrow_mailbox="x"), "mailbox must be one of tagged, bf16"),
        (lambda d: P.plan_layer(d, 1, 2, 132, wide_task_bytes=-1), "wide_task_bytes must be a non-negative integer"),
        (lambda d: P.plan_layer(d, 1, 1, 132, narrow_task_bytes=1.5), "narrow_task_bytes must be a non-negative"),
        (lambda d: P.plan_model(d, 1, [1], 132, wide_min_rows=True), "wide_min_rows must be a non-negative integer"),
        (lambda d: P.plan_model(d, 1, [1], 132, wide_burst=-1), "wide_burst must be a number in [0, 64], got -1"),
        (lambda d: P.plan_layer(d, 1, 2, 132, wide_burst="2"), "wide_burst must be a number in [0, 64]"),
        (lambda d: P.plan_model(d, 1, [1], 132, wide_split_k=-2), "wide_split_k must be a non-negative integer"),
        (lambda d: P.plan_layer(d, 1, 2, 132, wide_split_k=2.0), "wide_split_k must be a non-negative integer"),
        (lambda d: P.plan_model(d, 1, [1], 132, wide_even_waves=1), "wide_even_waves must be true or false, got 1"),
        (lambda d: P.plan_layer(d, 1, 2, 132, wide_even_waves="yes"), "wide_even_waves must be true or false"),
        (lambda d: P.plan_model(d, 1, [2], 132, narrow_even_waves=1), "narrow_even_waves must be true or false, got 1"),
        (lambda d: P.plan_layer(d, 1, 1, 132, narrow_even_waves="no"), "narrow_even_waves must be true or false"),
        (
            lambda d: P.plan_model(d, 1, [1], 132, early_down_waves=-1),
            "early_down_waves must be a non-negative integer",
        ),
        (
            lambda d: P.plan_layer(d, 1, 1, 132, early_down_waves=True),
            "early_down_waves must be a non-negative integer",
        ),
        (lambda d: P.plan_model(d, 1, [2, 2], 132), "widths must not repeat"),
        (
            lambda d: P.key_inputs(
                d, weight_dtype="int4", kv_dtype="bf16", tp_size=1, widths=[1], block_size=16, num_workgroups=8
            ),
            "weight_dtype must be one of",
        ),
        (
            lambda d: P.key_inputs(
                d, weight_dtype="bf16", kv_dtype="fp8", tp_size=1, widths=[1], block_size=16, num_workgroups=8
            ),
            "kv_dtype must be one of",
        ),
        (
            lambda d: P.key_inputs(
                d, weight_dtype="bf16", kv_dtype="bf16", tp_size=1, widths=[1], block_size=0, num_workgroups=8
            ),
            "block_size must be a positive integer",
        ),
    ],
)
def test_bad_inputs_rejected_with_one_line(call, message):
    with pytest.raises(ConfigError) as exc:
        call(profile_dims("llama3-8b"))
    text = str(exc.value)
    assert message in text and "\n" not in text and text.startswith("kernel plan: ")


def test_tp_kv_heads_mismatch_rejected():
    # gemma3-27b has 16 KV heads: tp 32 divides 32 heads but 16 KV heads do not divide... 32 % 16 == 0 is fine;
    # tiny has 2 KV heads and 4 heads: tp 4 replicates KV; tp 3 divides nothing.
    tiny = profile_dims("tiny")
    assert P.local_dims(tiny, 4).kv_heads == 1
    with pytest.raises(ConfigError, match="does not divide"):
        P.local_dims(tiny, 3)
    for a, b in itertools.combinations(range(1, 5), 2):
        assert P.attention_splits(a, 8, 132) >= P.attention_splits(b, 8, 132)
