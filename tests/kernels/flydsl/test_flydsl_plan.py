"""The FlyDSL backend launches exactly the shared kernel plan (``monodecode/kernels/plan.py``).

``config.launch_description`` is built from what the FlyDSL kernels bake (per-width
``Geometry``: stage tables, the workgroup -> tasks rule of their loops, relative region offsets)
and what the backend allocates (segment placement in the one scratch buffer, the health word).
Here it is held against an independent ``plan_model`` call: a divergence in the grid, a stage,
its task table, a region offset or the health word's packing fails. Pure Python (no compiler).
"""

from __future__ import annotations

import pytest

from monodecode.errors import ConfigError
from monodecode.kernels.flydsl.arch import ARCHS, WAVE_SIZE
from monodecode.kernels.flydsl.config import (
    HEALTH,
    MAX_WIDTH,
    first_task,
    health_word,
    launch_description,
    merge_output,
    plan_geometry,
    task_count,
    task_origin,
)
from monodecode.kernels.health import health_code
from monodecode.kernels.plan import DONE_STAGES, plan_model, wait_health_code
from monodecode.model.profiles import profile_dims

WIDTH_SETS = [(1,), (1, 2, 4, 8), (3, 16)]


@pytest.mark.parametrize("profile", ["tiny", "llama3-1b", "llama3-8b", "gemma3-27b"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("widths", WIDTH_SETS, ids=lambda ws: "w" + "-".join(map(str, ws)))
def test_launch_description_is_the_plan(profile, arch, widths):
    dims = profile_dims(profile)
    grid = ARCHS[arch].compute_units
    desc = launch_description(dims, arch, widths)
    # one GPU: bf16 activations and counters; wide stages split along K and cut to even waves
    plan = plan_model(dims, 1, list(widths), grid, mailbox="bf16", wide_split_k=4, wide_even_waves=True)
    assert desc["grid"] == plan.num_workgroups == grid
    assert desc["scratch_bytes"] == plan.scratch.nbytes
    assert desc["health_offset"] == plan.scratch.header[HEALTH].offset
    assert sorted(desc["widths"]) == sorted(widths)
    for w in widths:
        lp, got = plan.layers[w], desc["widths"][w]
        assert got["grid"] == grid and got["attn_splits"] == lp.attn_splits
        assert got["mailbox"] == lp.mailbox == "bf16"
        # split-K merge: where the plan splits o_proj / down and post / final would only add the residual
        mergeable = not lp.post_norms and lp.tp_size == 1 and lp.mailbox == "bf16"
        split = [f"k2.{s.name}" for s in lp.k2 if s.name in ("o_proj", "down") and s.k_splits > 1]
        merged = got["split_k_merge"]
        assert list(merged) == (split if mergeable else []), "merged exactly where the plan splits"
        assert got["fused_post"] == lp.fused_post_eligible or "k2.o_proj" in merged, "no post stage where allowed"
        # one arrival counter per merged row tile, o_proj's first
        tiles = {f"k2.{s.name}": s.num_tasks // s.k_splits for s in lp.k2}
        assert got["arrive_counters"] == sum(tiles[k] for k in merged)
        assert merged.get("k2.o_proj", 0) == 0 and merged.get("k2.down", 0) in (0, tiles["k2.o_proj"])
        regions = plan.scratch.widths[w].regions
        assert got["counters"] == {
            f"{k}.{name}": regions[f"done_{k}"].offset + 8 * i
            for k, names in DONE_STAGES.items()
            for i, name in enumerate(names)
        }, "every counted stage signals (and its consumers wait on) its own counter of the plan"
        assert got["regions"] == {n: r.offset for n, r in plan.scratch.widths[w].regions.items()}
        stages = {f"{s.kernel}.{s.name}": s for s in lp.stages()}
        assert list(got["stages"]) == list(stages), "same stages, same order"
        for key, st in stages.items():
            g = got["stages"][key]
            assert (g["kind"], g["tasks"], g["offset"], g["rows"], g["n"], g["k"]) == (
                st.kind,
                st.num_tasks,
                st.offset,
                st.rows_per_task,
                st.n,
                st.k,
            ), key
            assert (g["tile"], g["k_splits"]) == ((st.tile, st.k_splits) if st.kind == "gemv" else (0, 1)), key
            replaced = (key == "k2.post" and got["fused_post"]) or (key == "k2.final" and "k2.down" in merged)
            if replaced:  # o_proj adds the residual, gate/up normalises; down's last slices write x_out
                assert g["workgroup_tasks"] == [[]] * grid, key
                continue
            assert g["workgroup_tasks"] == [list(st.tasks_of(b, grid)) for b in range(grid)], key
            # every task exactly once, on the workgroup the plan's table names
            runs = sorted(t for b, ts in enumerate(g["workgroup_tasks"]) for t in ts)
            assert runs == list(range(st.num_tasks)), key
            assert all(st.workgroup_of(t, grid) == b for b, ts in enumerate(g["workgroup_tasks"]) for t in ts)
            # what each workgroup adds to the stage's completion counter: its own tasks, so the
            # counter reaches exactly epoch * tasks when the stage is done (bf16 format)
            for b, ts in enumerate(g["workgroup_tasks"]):
                first = first_task(b, st.offset, grid)
                assert (task_count(first, st.num_tasks, grid) if first < st.num_tasks else 0) == len(ts), (key, b)
    if profile == "gemma3-27b" and 8 in widths:  # the knobs are live: 168 o_proj tiles leave CUs idle
        wide = plan.layers[8].stages()
        assert any(s.k_splits > 1 for s in wide) and any(s.tile_rows for s in wide)


@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tensor_parallel_launch_is_the_plan(arch, tp):
    dims = profile_dims("llama3-8b")
    grid = ARCHS[arch].compute_units
    widths = (1, 4, 8)
    desc = launch_description(dims, arch, widths, tp_size=tp)
    plan = plan_model(dims, tp, list(widths), grid, mailbox="tagged")  # peer buffers: tagged words
    assert desc["scratch_bytes"] == plan.scratch.nbytes
    assert desc["peer_bytes"] == plan.peer.nbytes > 0
    for w in widths:
        got, lp = desc["widths"][w], plan.layers[w]
        assert got["peer_regions"] == {n: r.offset for n, r in plan.peer.widths[w].regions.items()}
        assert got["regions"] == {n: r.offset for n, r in plan.scratch.widths[w].regions.items()}
        assert got["mailbox"] == "tagged" and not got["fused_post"]  # the ranks' o partials need summing
        assert set(got["peer_regions"]) == {"o_peer", "d_peer"} and "o" not in got["regions"]
        assert list(got["stages"]) == [f"{s.kernel}.{s.name}" for s in lp.stages()]
        assert got["stages"]["k2.final"]["tasks"] == w  # the rank-order sum of the down partials
        assert got["stages"]["k2.gate_up"]["n"] == dims.intermediate_size // tp
        assert got["stages"]["k2.o_proj"]["k"] == dims.q_size // tp


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fused_post_exactly_for_llama_style_one_rank_unsplit_o_proj(arch):
    """K2 runs no post stage for Llama/Qwen on one GPU with an unsplit o_proj (every width of the
    8B profiles, width 1 of 1B) or a merged split one (1B's wider widths: ``SPLIT_K_MERGE``);
    never for Gemma (post norms) or TP, and nowhere with the knob off. The LDS gets the rows'
    rstd only then."""

    def fused(profile, widths, tp=1):
        desc = launch_description(profile_dims(profile), arch, widths, tp_size=tp)
        return {w: e["fused_post"] for w, e in desc["widths"].items()}

    everywhere = dict.fromkeys((1, 2, 8, 16), True)
    assert fused("llama3-8b", (1, 2, 8, 16)) == everywhere == fused("qwen3-8b", (1, 2, 8, 16))
    assert fused("llama3-1b", (1, 2, 8)) == {1: True, 2: True, 8: True}
    assert not plan_geometry(profile_dims("llama3-1b"), 8, ARCHS[arch], "bf16", split_k_merge=False).fused_post
    assert not any(fused("gemma3-27b", (1, 8)).values()) and not any(fused("tiny", (1, 2)).values())
    assert not any(fused("llama3-8b", (1, 8), tp=2).values())
    dims, spec = profile_dims("llama3-8b"), ARCHS[arch]
    on, off = plan_geometry(dims, 8, spec, "bf16"), plan_geometry(dims, 8, spec, "bf16", fused_post=False)
    assert on.fused_post and not off.fused_post
    assert (
        "rstd" in on.lds2
        and "rstd" not in off.lds2
        and "rstd" not in plan_geometry(profile_dims("tiny"), 1, spec, "bf16").lds2
    )
    with pytest.raises(ConfigError, match="fused_post must be True or False, got 'yes'"):
        plan_geometry(dims, 1, spec, "bf16", fused_post="yes")


def test_width_segments_never_alias_and_hold_the_epochs():
    desc = launch_description(profile_dims("llama3-8b"), "gfx942", (1, 2, 4, 8))
    spans = []
    for w, e in desc["widths"].items():
        regions = e["regions"]
        assert {
            "epoch_k1",
            "epoch_k2",
            "done_k1",
            "done_k2",
            "qkv",
            "attn_acc",
            "attn_ml",
            "h",
            "hn",
            "act",
            "o",
        } <= set(regions)
        assert all(off % 8 == 0 for off in regions.values()), "8-byte counters; bf16 pairs read as 32-bit words"
        spans.append((min(regions.values()), max(regions.values()), w))
    spans.sort()
    assert desc["health_offset"] < spans[0][0]
    assert all(a_hi < b_lo for (_, a_hi, _), (b_lo, _, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("layer", [0, 1, 61])
def test_health_word_is_the_runtime_packing(layer):
    assert health_word(1, 1, layer) == wait_health_code("k1", layer) == health_code("wait_timeout", layer, "k1")
    assert health_word(1, 2, layer) == wait_health_code("k2", layer)
    assert health_word(2, 2, layer) == health_code("nonfinite", layer, "k2")


def test_first_task_matches_the_plan_rule_for_every_offset():
    for grid in (7, 256, 304):
        for off in (0, 1, grid - 1):
            for b in range(grid):
                assert first_task(b, off, grid) == (b - off) % grid


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("profile", ["tiny", "llama3-8b", "qwen3-8b", "gemma3-27b"])
@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8"])
def test_gemv_tiles_cover_k_and_fit_lds(arch, profile, weight_dtype):
    spec = ARCHS[arch]
    for w in (1, 2, 8, MAX_WIDTH):
        g = plan_geometry(profile_dims(profile), w, spec, weight_dtype)
        for name, tile in g.tiles.items():
            st = tile.stage
            assert tile.rows_per_wave * 4 == st.tile >= st.rows and tile.rows_per_wave % tile.row_group == 0, name
            assert tile.k_pad % tile.step == 0 and st.k_task <= tile.k_pad < st.k_task + tile.step, name
            assert st.k_task * st.k_splits == st.k and st.row_tiles * st.rows >= st.n, name
            assert tile.chunk % tile.step == 0 and tile.chunks * tile.chunk >= tile.k_pad, name
            assert w * tile.chunk * 2 <= spec.x_stage_bytes or tile.chunk == tile.step, name
            assert tile.mfma == (w >= 2), name  # the plan's wide tasks are whole 16-row tiles
            if tile.mfma:
                assert tile.tiles * tile.k_split % 4 == 0 and tile.chunk % tile.kblock == 0, name
        assert max(g.lds1["words"], g.lds2["words"]) * 4 <= spec.lds_bytes
        assert g.head_dim % WAVE_SIZE == 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("profile", ["tiny", "llama3-8b", "gemma3-27b"])
def test_gemv_tasks_cover_every_output_and_k_slice_once(arch, profile):
    """``task_origin`` (what the kernels compute per task) against the plan's stage: the tasks'
    own rows of every K slice cover each output row exactly once."""
    for w in (2, 8):
        g = plan_geometry(profile_dims(profile), w, ARCHS[arch], "bf16")
        for name, tile in g.tiles.items():
            st = tile.stage
            seen = {}
            for t in range(st.tasks):
                n0, k0, s = task_origin(t, st)
                assert k0 == s * st.k_task and 0 <= s < st.k_splits, (name, t)
                for row in range(n0, min(n0 + st.rows, st.n)):
                    seen[(row, k0)] = seen.get((row, k0), 0) + 1
            want = {(row, s * st.k_task) for row in range(st.n) for s in range(st.k_splits)}
            assert set(seen) == want and set(seen.values()) == {1}, (name, w)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"width": 0}, "width 0 out of range 1..16"),
        ({"width": 17}, "width 17 out of range 1..16"),
        ({"weight_dtype": "int4"}, "weight dtype 'int4' not supported"),
        ({"tp_size": 3}, "does not divide"),
    ],
)
def test_bad_specialisations_are_one_line(kwargs, message):
    args = {"dims": profile_dims("llama3-8b"), "width": 1, "spec": ARCHS["gfx942"], "weight_dtype": "bf16", **kwargs}
    with pytest.raises(ConfigError, match=message):
        plan_geometry(**args)


def test_split_k_merge_for_llama_1b_never_with_post_norms():
    """llama3-1b at width 8 on gfx942 splits o_proj and down in 2 K slices of 128 row tiles each:
    both are merged by their last slice, so K2 runs no post and no final task, and takes 256
    arrival counters (o_proj's tiles, then down's). Width 1 (unsplit), gemma3-27b (post norms:
    its final stage normalises d) and the knob off merge nothing. A bad knob is one line."""
    dims, spec = profile_dims("llama3-1b"), ARCHS["gfx942"]
    desc = launch_description(dims, "gfx942", (1, 8))
    w8, w1 = desc["widths"][8], desc["widths"][1]
    assert (w8["stages"]["k2.o_proj"]["k_splits"], w8["stages"]["k2.down"]["k_splits"]) == (2, 2)
    assert w8["split_k_merge"] == {"k2.o_proj": 0, "k2.down": 128} and w8["arrive_counters"] == 256
    assert w8["stages"]["k2.post"]["tasks"] == w8["stages"]["k2.final"]["tasks"] == 8  # in the plan...
    for stage in ("k2.post", "k2.final"):  # ...but no workgroup runs them
        assert not any(w8["stages"][stage]["workgroup_tasks"]), stage
    assert w1["split_k_merge"] == {} and w1["arrive_counters"] == 0
    geom = plan_geometry(dims, 8, spec, "bf16")
    assert geom.o_merge and geom.d_merge and geom.fused_post and not geom.final
    off = plan_geometry(dims, 8, spec, "bf16", split_k_merge=False)
    assert not (off.o_merge or off.d_merge or off.fused_post) and off.final and off.arrive_counters == 0
    gemma = launch_description(profile_dims("gemma3-27b"), "gfx942", (8,))["widths"][8]
    assert gemma["stages"]["k2.down"]["k_splits"] > 1  # split, yet its final stage has a norm to do
    assert gemma["split_k_merge"] == {} and gemma["arrive_counters"] == 0
    assert any(gemma["stages"]["k2.final"]["workgroup_tasks"]) and any(gemma["stages"]["k2.post"]["workgroup_tasks"])
    with pytest.raises(ConfigError, match="split_k_merge must be True or False, got 'yes'"):
        plan_geometry(dims, 8, spec, "bf16", split_k_merge="yes")


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("width", [2, 8, 16])
def test_split_k_merge_finishes_every_output_once(arch, width):
    """What the merging kernels compute per tile (``task_origin``, ``merge_output``), on ints: each
    merged row tile gets exactly ``k_splits`` arrivals per launch, one per K slice (so the
    monotonic counter's ``old % k_splits == k_splits - 1`` is this launch's last one), and the
    outputs the tiles' last slices finish cover every (token, row) of the stage exactly once."""
    geom = plan_geometry(profile_dims("llama3-1b"), width, ARCHS[arch], "bf16")
    merged = [n for n, m in (("o_proj", geom.o_merge), ("down", geom.d_merge)) if m]
    assert merged == ["o_proj", "down"]
    counters = set()
    for name in merged:
        st = geom.stage("k2", name)
        slices: dict[int, list[int]] = {}
        for t in range(st.tasks):
            row0, _k0, s = task_origin(t, st)
            tile = t % st.row_tiles  # the counter the kernel adds to
            assert row0 == tile * st.rows
            slices.setdefault(tile, []).append(s)
            counters.add(geom.arrive(name) + tile)
        assert all(sorted(v) == list(range(st.k_splits)) for v in slices.values()), name
        outs = [merge_output(i, tile, st.rows) for tile in slices for i in range(width * st.rows)]
        outs = [(tok, row) for tok, row in outs if row < st.n]
        assert sorted(outs) == [(tok, row) for tok in range(width) for row in range(st.n)], name
    assert counters == set(range(geom.arrive_counters)), "each counter is one tile's, none shared"
