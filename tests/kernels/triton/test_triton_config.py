"""The Triton launch configuration (``kernels/triton/config.py``): its refusals, each one
``ConfigError`` line naming the problem and raised before any region of the plan is looked up;
the per-stage choices timed on the H200 (benchmarks/README.md, run 19); and the launch exit as
compiled for sm_90 on the CPU."""

from __future__ import annotations

import dataclasses

import pytest

from monodecode.errors import ConfigError
from monodecode.kernels.plan import plan_model
from monodecode.kernels.triton.config import (
    CUDA,
    attn_launch_on_layer,
    cuda_programs_per_sm,
    gemv_chunk,
    k1_constexprs,
    k2_constexprs,
    ka_constexprs,
    plan_for,
    residency_misfits,
    target_for,
)
from monodecode.model.profiles import profile_dims


@pytest.mark.parametrize("split_k", [0, 4])
def test_tensor_parallel_plans_are_refused_in_one_line(split_k):
    """A TP plan has no ``o`` region (its o_proj writes peer slots): the refusal must come first,
    not a KeyError from the region lookup."""
    dims = profile_dims("llama3-8b")
    plan = plan_model(dims, 2, [2], 132, mailbox="bf16", wide_split_k=split_k).layers[2]
    with pytest.raises(ConfigError, match="^triton kernels: only tp_size 1 is implemented$"):
        k2_constexprs(dims, plan, dataclasses.replace(CUDA, wide_split_k=split_k))


def test_bad_target_fields_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="^triton kernels: fp8_wide must be 'widen' or 'pair', got 'fp16'$"):
        plan_for(profile_dims("llama3-8b"), [2], 132, dataclasses.replace(CUDA, fp8_wide="fp16"), fp8=True)
    with pytest.raises(ConfigError, match="^triton kernels: no target for platform kind 'tpu'$"):
        target_for("tpu")
    dims = profile_dims("llama3-8b")
    plan = plan_for(dims, [8], 132, CUDA, fp8=True).layers[8]
    with pytest.raises(ConfigError, match="^triton kernels: split_k_merge must be '', 'down' or 'all', got 'yes'$"):
        k2_constexprs(dims, plan, dataclasses.replace(CUDA, split_k_merge="yes"), fp8=True)
    with pytest.raises(ConfigError, match="^triton kernels: attn_prefetch must be '', 'qk_norm' or 'all', got True$"):
        k1_constexprs(dims, plan, dataclasses.replace(CUDA, attn_prefetch=True), 16)


def _k1(profile: str, width: int, target=CUDA) -> dict:
    dims = profile_dims(profile)
    plan = plan_for(dims, [width], 132, target).layers[width]
    return k1_constexprs(dims, plan, target, 16)


def test_attention_prefetch_only_where_timed_faster_and_where_the_tile_fits():
    """K1's first K/V tile before the QKV wait: on q/k-norm layers (27B, runs 151-152), not on
    Llama-style ones (runs 153-154), and never past 128 bytes a thread (FP8 width 1's 4-warp K1;
    27B at width 8, one split a row: whole-context 128-position tiles)."""
    assert _k1("gemma3-27b", 1)["ATTN_PREFETCH"] and _k1("gemma3-27b", 2)["ATTN_PREFETCH"]
    assert not _k1("gemma3-27b", 8)["ATTN_PREFETCH"]
    assert not _k1("llama3-8b", 1)["ATTN_PREFETCH"] and not _k1("llama3-8b", 8)["ATTN_PREFETCH"]
    every = dataclasses.replace(CUDA, attn_prefetch="all")
    assert _k1("llama3-8b", 1, every)["ATTN_PREFETCH"]
    dims = profile_dims("llama3-8b")
    plan = plan_for(dims, [1], 132, every, fp8=True).layers[1]
    assert not k1_constexprs(dims, plan, every, 16, fp8=True)["ATTN_PREFETCH"]
    assert k1_constexprs(dims, plan_for(dims, [2], 132, every, fp8=True).layers[2], every, 16, fp8=True)[
        "ATTN_PREFETCH"
    ]


def test_the_attention_launch_only_on_layers_that_can_reach_its_context():
    """Gemma-3-27B's sliding layers see at most 1024 positions, fewer than the 4096 from which the
    CUDA default attends in the attention launch, so five of every six layers leave it out; a
    window as long as the threshold, a launch that holds every step's attention (min context 0),
    Llama's unwindowed layers and ``attn_launch_every_layer`` keep it."""
    dims = profile_dims("gemma3-27b")
    on = [attn_launch_on_layer(CUDA, dims.window_for_layer(layer) or 0) for layer in range(12)]
    assert on == [False] * 5 + [True] + [False] * 5 + [True]
    assert attn_launch_on_layer(dataclasses.replace(CUDA, attn_launch_every_layer=True), 1024)
    assert attn_launch_on_layer(dataclasses.replace(CUDA, attn_launch_min_context=0), 1024)
    assert attn_launch_on_layer(dataclasses.replace(CUDA, attn_launch_min_context=1024), 1024)
    assert not attn_launch_on_layer(dataclasses.replace(CUDA, attn_launch_min_context=1025), 1024)
    assert attn_launch_on_layer(CUDA, profile_dims("llama3-8b").window_for_layer(0) or 0)


def test_qkv_chunks_hold_their_own_bytes_in_flight():
    """QKV at widths > 1 takes 256-wide chunks (128 KiB of weights in flight per program) where
    the other stages' 64 KiB gives 128; width 1 keeps its own chunk."""
    assert _k1("gemma3-27b", 8)["BK"] == 256
    assert _k1("llama3-8b", 2)["BK"] == 256
    assert _k1("gemma3-27b", 8, dataclasses.replace(CUDA, qkv_inflight_bytes=0))["BK"] == 128
    assert _k1("llama3-8b", 1)["BK"] == CUDA.bk_narrow
    dims = profile_dims("llama3-8b")
    plan = plan_for(dims, [8], 132, CUDA).layers[8]
    gate_up = plan.stage("k2", "gate_up")
    assert gemv_chunk(CUDA, 8, gate_up, False) == 128  # not the QKV figure


def test_whole_context_tasks_take_the_larger_attention_tile():
    """128-position tiles only where one task covers a row's whole context (one split per row)."""
    wide = _k1("gemma3-27b", 8)
    assert wide["S"] == 1 and wide["BT"] == 128
    split = _k1("llama3-8b", 8)
    assert split["S"] > 1 and split["BT"] == CUDA.attn_tile
    assert _k1("gemma3-27b", 1)["BT"] == CUDA.attn_tile
    assert _k1("gemma3-27b", 8, dataclasses.replace(CUDA, whole_attn_tile=0))["BT"] == CUDA.attn_tile


def test_launch_exit_atomics_are_relaxed_in_the_compiled_kernels():
    """The last program's exit atomics must not be fenced (``mailbox.finish_launch``): acq_rel
    made it wait a round trip per atomic in a row before the launch could end (run 19: 3.5 -> 1.8 µs
    between launches). Compiled for sm_90 on the CPU; the stage hand-offs keep their order."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget

    from monodecode.kernels.triton.sources import kernel_sources

    dims = profile_dims("tiny")
    mplan = plan_for(dims, [2], 8, CUDA)
    for name, src in kernel_sources(dims, "bf16", 2, 16, mplan, CUDA):
        if name == "ka":  # the attention launch is a plain grid: no launch counter to advance
            continue
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        body = ptx[: ptx.rindex("ret;")]
        atoms = re.findall(r"atom\.global\.\S+", body)
        exit_atoms = atoms[-6:]  # the epoch add, then the five counter settles
        assert [a.split(".")[-2] for a in exit_atoms] == ["add"] + ["max"] * 5, (name, exit_atoms)
        assert all(".relaxed." in a for a in exit_atoms), (name, exit_atoms)
        assert any(".release." in a or ".acq_rel." in a for a in atoms[:-6]), name  # hand-offs stay ordered


def _ptx_and_meta(name, src, target):
    import triton
    from triton.backends.compiler import GPUTarget

    from monodecode.kernels.triton.config import compile_options

    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=compile_options(target, 2, name))
    return compiled.asm["ptx"], compiled.metadata


def test_programmatic_dependent_launch_waits_before_any_memory_access_and_releases_at_the_end():
    """``Target.pdl`` (``overlap.py``): with "exit" (the CUDA default) every launch is made with
    programmatic stream serialization, each kernel waits for the previous launch before its first
    global memory access (the epoch counter, the step's lengths), and lets the next launch go
    only after its last hand-off; "" compiles neither. Compiled for sm_90 on the CPU (the H200
    runs the numerics with it: ``test_triton_numerics``)."""
    import re

    from monodecode.kernels.triton.sources import kernel_sources

    access = re.compile(r"\b(?:ld|st|atom|red)(?:\.\w+)*\.global\b|\bcp\.async\b")
    dims = profile_dims("tiny")
    assert CUDA.pdl == "exit"
    mplan = plan_for(dims, [2], 8, CUDA)
    for name, src in kernel_sources(dims, "bf16", 2, 16, mplan, CUDA):
        ptx, meta = _ptx_and_meta(name, src, CUDA)
        assert meta.launch_pdl, name
        assert ptx.count("griddepcontrol.wait;") == 1 and ptx.count("griddepcontrol.launch_dependents;") == 1, name
        wait, release = ptx.index("griddepcontrol.wait;"), ptx.index("griddepcontrol.launch_dependents;")
        assert wait < access.search(ptx).start(), (name, "a global access before the wait")
        ordered = [m.start() for m in re.finditer(r"atom\.global\.(?:release|acq_rel)", ptx)]
        assert ordered and release > ordered[-1], (name, "the next launch released before a hand-off")
    off = dataclasses.replace(CUDA, pdl="")
    for name, src in kernel_sources(dims, "bf16", 2, 16, plan_for(dims, [2], 8, off), off):
        ptx, meta = _ptx_and_meta(name, src, off)
        assert not meta.launch_pdl and "griddepcontrol" not in ptx, name


def test_pdl_and_maxnreg_are_refused_in_one_line_and_never_reach_hip():
    dims = profile_dims("llama3-8b")
    plan = plan_for(dims, [8], 132, CUDA).layers[8]
    with pytest.raises(ConfigError, match="^triton kernels: pdl must be '', 'entry' or 'exit', got 'yes'$"):
        k2_constexprs(dims, plan, dataclasses.replace(CUDA, pdl="yes"))
    from monodecode.kernels.triton.config import compile_options

    with pytest.raises(ConfigError, match="^triton kernels: maxnreg must be 0 or 24..255, got 300$"):
        compile_options(dataclasses.replace(CUDA, maxnreg=300), 8, "k2")
    assert compile_options(dataclasses.replace(CUDA, maxnreg=168), 8, "k2")["maxnreg"] == 168
    assert "maxnreg" not in compile_options(dataclasses.replace(CUDA, maxnreg=168), 8, "ka")  # shares its SMs
    ka_cap = dataclasses.replace(CUDA, attn_launch_maxnreg=128)
    assert compile_options(ka_cap, 8, "ka")["maxnreg"] == 128 and "maxnreg" not in compile_options(ka_cap, 8, "k1")
    with pytest.raises(ConfigError, match="^triton kernels: attn_launch_maxnreg must be 0 or 24..255, got 16$"):
        compile_options(dataclasses.replace(CUDA, attn_launch_maxnreg=16), 8, "ka")
    hip = dataclasses.replace(target_for("hip"), pdl="exit")
    assert k1_constexprs(dims, plan_for(dims, [1], 304, hip).layers[1], hip, 16)["PDL"] == 0
    assert k2_constexprs(dims, plan, CUDA)["PDL"] == 2


def test_attention_launch_splits_keep_a_task_s_bytes_per_position():
    """Run 52: 1B (64-dimension heads) was faster at batch 8 with half the splits 8B (128) needs;
    the split count follows the head's bytes, so only narrower heads get fewer, longer tasks (the
    power-of-two rule, without ``attn_launch_slots_per_sm`` and the per-head caps)."""
    pow2 = dataclasses.replace(CUDA, attn_launch_slots_per_sm=(), attn_launch_max_splits_per_head=())

    def splits(profile, width, target=pow2):
        dims = profile_dims(profile)
        return ka_constexprs(dims, plan_for(dims, [width], 132, target).layers[width], target, 16)["S"]

    assert (splits("llama3-1b", 8), splits("llama3-8b", 8)) == (8, 16)
    assert splits("llama3-1b", 1) == splits("llama3-8b", 1) == CUDA.attn_launch_max_splits
    unscaled = dataclasses.replace(pow2, attn_launch_head_dim=0)
    assert splits("llama3-1b", 8, unscaled) == splits("llama3-8b", 8, unscaled) == 16


def test_even_waves_skip_the_fp8_pair():
    """Cut tasks save bytes, not matrix instructions: the FP8 pair's plans keep whole tiles (run
    20: FP8 b2-8 2 % slower with them), bf16 and widened FP8 weights get them."""
    dims = profile_dims("llama3-8b")

    def cut(target, fp8):
        plan = plan_for(dims, [8], 132, target, fp8=fp8).layers[8]
        return any(st.tile_rows for st in plan.k1 + plan.k2)

    assert cut(CUDA, fp8=False)
    assert not cut(CUDA, fp8=True)
    assert cut(dataclasses.replace(CUDA, fp8_wide="widen"), fp8=True)
    assert not cut(dataclasses.replace(CUDA, wide_even_waves=False), fp8=False)


def test_fp8_wide_stages_reach_only_fp8_gemvs_at_widths_above_1():
    """``Target.fp8_wide_stages`` pipelines FP8 GEMVs at widths > 1 only: BF16 weights and width
    1's FMA tiles keep their own depth (run 60 timed it against the default), and so does K1 on
    a grid of its own (``fp8_wide_k1_programs_per_sm``), which reads the BF16 knobs."""
    dims = profile_dims("llama3-8b")
    three = dataclasses.replace(CUDA, fp8_wide_stages=3)
    shared = dataclasses.replace(three, fp8_wide_k1_programs_per_sm=0)

    def stages(target, width, fp8):
        plan = plan_for(dims, [width], 132, target, fp8=fp8).layers[width]
        return (
            k1_constexprs(dims, plan, target, 16, fp8=fp8)["NUM_STAGES"],
            k2_constexprs(dims, plan, target, fp8=fp8)["NUM_STAGES"],
        )

    assert stages(three, 8, True) == (CUDA.gemv_stages, 3)
    assert stages(shared, 8, True) == (3, 3)
    assert stages(CUDA, 8, True) == (CUDA.gemv_stages, CUDA.gemv_stages)
    assert stages(three, 8, False) == stages(CUDA, 8, False)
    assert stages(three, 1, True) == stages(CUDA, 1, True) == (CUDA.fp8_narrow_stages,) * 2


def test_fp8_weights_take_two_smaller_programs_per_sm():
    """Runs 63-64: FP8 GEMVs on two 4-warp programs per SM (at widths > 1 the second issues while
    the first waits at the barrier in front of its matrix instructions; at width 1 its warps
    cover the first's dependency chains), with tiles that let both fit in shared memory; BF16
    weights keep one 8-warp program per SM. The attention launch's splits are per SM, so they do
    not double with the grid."""
    from monodecode.kernels.triton.config import compile_options, ka_constexprs

    dims = profile_dims("llama3-8b")

    def grid(width, fp8, target=CUDA, kernel="k2"):
        return plan_for(dims, [width], 132, target, fp8=fp8).layers[width].workgroups(kernel)

    assert (grid(1, False), grid(8, False), grid(1, True), grid(8, True), grid(2, True)) == (132, 132, 264, 264, 264)
    # K1 at widths > 1 on one 8-warp program per SM (run 67), its chunks sized for it
    assert (grid(1, True, kernel="k1"), grid(8, True, kernel="k1"), grid(8, False, kernel="k1")) == (264, 132, 132)
    assert compile_options(CUDA, 8, "k1", fp8=True)["num_warps"] == 8
    own = plan_for(dims, [8], 132, CUDA, fp8=True).layers[8]
    shared = dataclasses.replace(CUDA, fp8_wide_k1_programs_per_sm=0)
    assert grid(8, True, shared, "k1") == 264 and compile_options(shared, 8, "k1", fp8=True)["num_warps"] == 4
    assert gemv_chunk(CUDA, 8, own.stage("k1", "qkv"), True) == 256  # the FP8 pair's widest
    assert gemv_chunk(shared, 8, plan_for(dims, [8], 132, shared, fp8=True).layers[8].stage("k1", "qkv"), True) == 128
    assert grid(8, True, dataclasses.replace(CUDA, fp8_wide_programs_per_sm=0)) == 132
    assert grid(1, True, dataclasses.replace(CUDA, fp8_narrow_programs_per_sm=0)) == 132
    assert grid(8, False, dataclasses.replace(CUDA, wide_programs_per_sm=3)) == 396
    assert (
        compile_options(CUDA, 8, "k2", fp8=True)["num_warps"]
        == compile_options(CUDA, 1, "k1", fp8=True)["num_warps"]
        == 4
    )
    assert compile_options(CUDA, 8, "k2")["num_warps"] == compile_options(CUDA, 1, "k2")["num_warps"] == 8
    plan = plan_for(dims, [8], 132, CUDA, fp8=True).layers[8]
    assert gemv_chunk(CUDA, 8, plan.stage("k2", "gate_up"), True) == 128  # 64 rows x 1 byte x 4 stages x 128
    assert (
        ka_constexprs(dims, plan, CUDA, 16, fp8=True)["S"]
        == ka_constexprs(dims, plan_for(dims, [8], 132, CUDA).layers[8], CUDA, 16)["S"]
    )
    bads = ({"wide_programs_per_sm": 0}, {"fp8_wide_programs_per_sm": 5}, {"narrow_programs_per_sm": True})
    for bad in bads + ({"fp8_narrow_programs_per_sm": -1}, {"fp8_wide_k1_programs_per_sm": 9}):
        name, value = next(iter(bad.items()))
        with pytest.raises(ConfigError, match=rf"^triton kernels: {name} must be [01]\.\.4, got {value!r}$"):
            plan_for(dims, [8], 132, dataclasses.replace(CUDA, **bad), fp8=True)


def test_deferred_rstd_only_at_width_1_and_on_warp_group_tiles():
    """``qkv_src``: the pre-norm's rstd goes to the QKV result at width 1 and on tiles of at least
    ``deferred_rstd_min_rows`` (64-row tiles, every wide tile since ``wide_min_rows`` is 64), not
    on 32-row ones (run 29: 1B 7-8 % slower there), and nowhere with ``deferred_rstd`` off."""

    def src(profile, width, target=CUDA):
        return _k1(profile, width, target)["QKV_SRC"]

    assert [src("llama3-8b", w) for w in (1, 2, 8)] == [4, 4, 4]
    assert [src("llama3-1b", w) for w in (1, 2, 8)] == [4, 4, 4]
    narrow = dataclasses.replace(CUDA, wide_min_rows=0)  # 1B's QKV then takes 32-row tiles
    assert [src("llama3-1b", w, narrow) for w in (1, 2, 8)] == [4, 0, 0]
    off = dataclasses.replace(CUDA, deferred_rstd=False)
    assert [src("llama3-8b", w, off) for w in (1, 8)] == [0, 0]


def test_no_post_stage_where_it_would_only_add_and_normalise():
    """``fused_post``: Llama-style layers drop the one-program post stage (o_proj adds the
    residual, gate/up normalises h), except where o_proj is split along K and not merged by its
    last slice (its partials need summing: FP8 8B at widths > 1 without ``split_k_merge``), with
    Gemma's post norms, or on the tagged mailbox."""

    def no_post(profile, width, target=CUDA, fp8=False):
        dims = profile_dims(profile)
        plan = plan_for(dims, [width], 132, target, fp8=fp8).layers[width]
        return k2_constexprs(dims, plan, target, fp8=fp8)["NO_POST"]

    assert no_post("llama3-8b", 1) and no_post("llama3-8b", 8) and no_post("llama3-1b", 2)
    assert no_post("llama3-8b", 1, fp8=True) and no_post("llama3-8b", 2, fp8=True)
    assert not no_post("llama3-8b", 2, dataclasses.replace(CUDA, split_k_merge=""), fp8=True)
    assert not no_post("gemma3-27b", 1)
    assert not no_post("llama3-8b", 1, dataclasses.replace(CUDA, fused_post=False))
    assert not no_post("llama3-8b", 8, dataclasses.replace(CUDA, mailbox="tagged"))


def test_split_tiles_merge_in_their_last_slice_only_where_post_and_final_only_add():
    """``split_k_merge``: a split o_proj / down tile is summed by its last slice, which drops the
    post / final stage ("down": only down's), and K2 gets one arrival counter per merged tile;
    never with Gemma's post norms (its stages normalise whole rows) or unsplit stages."""
    from monodecode.kernels.triton.config import k2_arrive_counters

    def k2(profile, width, merge, fp8=True):
        dims = profile_dims(profile)
        target = dataclasses.replace(CUDA, split_k_merge=merge)
        plan = plan_for(dims, [width], 132, target, fp8=fp8).layers[width]
        return k2_constexprs(dims, plan, target, fp8=fp8), k2_arrive_counters(plan, target)

    c, n = k2("llama3-8b", 8, "all")  # FP8 8B at width 8 (264 programs): o_proj and down in 4 K slices of 64 tiles
    assert (c["O_KS"], c["D_KS"], c["O_MERGE"], c["D_MERGE"], c["NO_POST"], c["FINAL"]) == (
        4,
        4,
        True,
        True,
        True,
        False,
    )
    assert n == 64 + 64
    c, n = k2("llama3-8b", 8, "down")
    assert (c["O_MERGE"], c["D_MERGE"], c["NO_POST"], c["FINAL"], n) == (False, True, False, False, 64)
    c, n = k2("llama3-8b", 8, "")
    assert (c["O_MERGE"], c["D_MERGE"], c["NO_POST"], c["FINAL"], n) == (False, False, False, True, 0)
    c, n = k2("gemma3-27b", 8, "all", fp8=False)  # split, but its post / final stages normalise
    assert c["O_KS"] > 1 and not c["O_MERGE"] and not c["D_MERGE"] and c["FINAL"] and n == 0
    c, n = k2("llama3-8b", 1, "all")  # width 1: nothing split
    assert not c["O_MERGE"] and not c["D_MERGE"] and n == 0


def test_down_in_halves_only_for_long_bf16_gate_up_at_width_1():
    """``early_down_waves``: K2 gets the halves' constants (gate/up's first half of tasks, down's
    first K half) for BF16 8B at width 1 (gate/up 6.8 waves of 132 programs), and 27B's (10.2)
    without width 1's even waves, which cut its gate/up tasks; FP8 weights, 1B (3.9 waves),
    widths > 1 and a target without it keep down whole."""

    def halves(profile, width=1, target=CUDA, fp8=False):
        dims = profile_dims(profile)
        plan = plan_for(dims, [width], 132, target, fp8=fp8).layers[width]
        c = k2_constexprs(dims, plan, target, fp8=fp8)
        assert (c["GU_LO_TASKS"] > 0) == (c["D_K0"] > 0) == (c["D_LO_W"] > 0)
        if c["D_K0"]:  # two equal halves of the reduction, each a whole number of K chunks
            assert c["D_K0"] * 2 == dims.intermediate_size and c["D_K0"] % (c["D_BK"] * c["D_SPLIT"]) == 0
        return c["D_K0"]

    assert halves("llama3-8b") == 7168 and not halves("gemma3-27b")
    assert halves("gemma3-27b", target=dataclasses.replace(CUDA, narrow_even_waves=False)) == 10752
    assert not halves("llama3-8b", fp8=True) and not halves("llama3-1b") and not halves("llama3-8b", 8)
    assert not halves("llama3-8b", target=dataclasses.replace(CUDA, early_down_waves=0))


def test_width_1_even_waves_cut_only_tiles_that_leave_a_wave_part_idle():
    """``narrow_even_waves``: 27B's width-1 o_proj / down (336 16-row tiles: 2.5 waves of 132) and
    gate/up (1344: 10.2 waves) become 384 14-row and 1434 15-row tasks (3 and 11 full waves), and
    down runs whole; 1B's and 8B's tiles already fill their waves, so their plans are unchanged."""

    def stages(profile, even=True):
        target = dataclasses.replace(CUDA, narrow_even_waves=even)
        plan = plan_for(profile_dims(profile), [1], 132, target).layers[1]
        return {st.name: (st.num_tasks, st.rows_per_task, st.tile) for st in plan.k1 + plan.k2 if st.kind == "gemv"}

    got = stages("gemma3-27b")
    assert got["o_proj"] == got["down"] == (384, 14, 16) and got["gate_up"] == (1434, 15, 16), got
    assert got["qkv"] == (512, 16, 16) and "down_lo" not in got  # 16 rows are the fewest that fill 4 waves
    for profile in ("llama3-1b", "llama3-8b"):
        assert stages(profile) == stages(profile, even=False), profile


def test_attention_launch_splits_fill_one_wave_where_the_slots_are_known():
    """``Target.attn_launch_slots_per_sm`` (run 69): 128-dimensional heads split so the tasks fill
    3 programs on each of 132 SMs once (8 KV heads: 6 splits at batch 8, not 16 in 2.6 waves),
    at most ``attn_launch_max_splits``; head sizes without a count keep the power-of-two rule."""
    splits = [CUDA.attn_launch_splits(w, 8, 132, 128) for w in (1, 2, 4, 8)]
    assert splits == [32, 24, 12, 6]
    assert all(w * 8 * s <= 3 * 132 < w * 8 * (s + 1) for w, s in zip((2, 4, 8), splits[1:], strict=True))
    pow2 = dataclasses.replace(CUDA, attn_launch_slots_per_sm=())
    assert [pow2.attn_launch_splits(w, 8, 132, 128) for w in (1, 2, 4, 8)] == [32, 32, 32, 16]
    assert CUDA.attn_launch_splits(8, 8, 132, 96) == pow2.attn_launch_splits(8, 8, 132, 96)
    dims = profile_dims("llama3-8b")
    c = ka_constexprs(dims, plan_for(dims, [8], 132, CUDA).layers[8], CUDA, 16)
    assert (c["S"], c["SP"]) == (6, 8)
    for bad in (((128, 0),), ((128,),), 3, ((128, True),)):
        with pytest.raises(
            ConfigError, match=r"^triton kernels: attn_launch_slots_per_sm must be \(head_dim, programs\) pairs"
        ):
            dataclasses.replace(CUDA, attn_launch_slots_per_sm=bad).attn_launch_splits(8, 8, 132, 128)
        with pytest.raises(
            ConfigError, match=r"^triton kernels: attn_launch_max_splits_per_head must be \(head_dim, splits\) pairs"
        ):
            dataclasses.replace(CUDA, attn_launch_max_splits_per_head=bad).attn_launch_splits(8, 8, 132, 128)


def test_64_wide_heads_split_up_to_64_ways():
    """``attn_launch_max_splits_per_head`` (run 77): 1B's 64-dimensional heads (4 attention
    programs per SM) take 64 splits at batch 1, 512 tasks in the one wave of 528, where the
    common cap of 32 left half of it idle; 33 at batch 2 (one full wave); batches 4-8 and
    128-dimensional heads as before."""
    assert [CUDA.attn_launch_splits(w, 8, 132, 64) for w in (1, 2, 4, 8)] == [64, 33, 16, 8]
    common = dataclasses.replace(CUDA, attn_launch_max_splits_per_head=())
    assert [common.attn_launch_splits(w, 8, 132, 64) for w in (1, 2, 4, 8)] == [32, 32, 16, 8]
    assert [CUDA.attn_launch_splits(w, 8, 132, 128) for w in (1, 2, 4, 8)] == [32, 24, 12, 6]
    dims = profile_dims("llama3-1b")
    c = ka_constexprs(dims, plan_for(dims, [1], 132, CUDA).layers[1], CUDA, 16)
    assert (c["S"], c["SP"]) == (64, 64)


def test_programs_per_sm_follow_registers_shared_memory_and_threads():
    """Hopper's residency rule (``cuda_programs_per_sm``), each limit binding once: the attention
    launch of 1B at 124 registers holds 4 programs of 4 warps, at 156 only 3 (run 74: a
    refactor that took it there made 1B 32k x 8 27 % slower); 8B's at 168 registers and 74 KB of
    shared memory 3 (both limits); FP8 K1's 8 warps with 116 KiB of shared memory 1; 16-warp
    programs of 16 registers are bound by the SM's 2048 threads, not their registers."""
    assert cuda_programs_per_sm(124, 4, 39424) == 4
    assert cuda_programs_per_sm(156, 4, 39424) == 3
    assert cuda_programs_per_sm(168, 4, 74240) == 3
    assert cuda_programs_per_sm(128, 8, 118784) == 1
    assert cuda_programs_per_sm(16, 16, 0) == 4
    assert cuda_programs_per_sm(124, 4, 39424, regs_per_sm=32768) == 2  # the GPU's own register file


def test_launches_holding_fewer_programs_than_planned_are_named():
    """``residency_misfits``: what the benchmark logs beside a build's timings and the launcher
    reports on the GPU. The attention launch of 1B at batch 8 is planned for 4 programs per SM
    (``attn_launch_slots_per_sm``), FP8 K2 at batch 8 for 2; holding those (or more) is no misfit."""
    dims = profile_dims("llama3-1b")
    plan = plan_for(dims, [8], 132, CUDA).layers[8]
    assert residency_misfits(CUDA, plan, False, {"k1": 1, "k2": 1, "ka": 4}) == []
    assert residency_misfits(CUDA, plan, False, {"k1": 1, "k2": 2, "ka": 5}) == []
    assert residency_misfits(CUDA, plan, False, {"k1": 1, "k2": 1, "ka": 3}) == [
        "width 8 ka: 3 programs per SM, planned for 4"
    ]
    fp8 = plan_for(dims, [8], 132, CUDA, fp8=True).layers[8]
    assert residency_misfits(CUDA, fp8, True, {"k1": 1, "k2": 1}) == ["width 8 k2: 1 programs per SM, planned for 2"]
    # a head size without a count in the slots table: the power-of-two rule plans no residency
    pow2 = dataclasses.replace(CUDA, attn_launch_slots_per_sm=())
    assert residency_misfits(pow2, plan, False, {"k1": 1, "k2": 1, "ka": 1}) == []


def test_group_merge_slices_fit_the_head_size_s_budget():
    """``Target.attn_launch_group_merge`` (on for CUDA): the merge's slice of head_dim halves
    until the group's partials in one slice fit the head size's ``attn_launch_merge_elements``
    (8B at batch 1: 4 heads x 32 splits x 64 = 8192 values; 1B: 4 x 64 x 16 = 4096), so the
    attention launch keeps its registers (``test_triton_cuda_residency``)."""

    def merge(profile, width, target=CUDA):
        dims = profile_dims(profile)
        c = ka_constexprs(dims, plan_for(dims, [width], 132, target).layers[width], target, 16)
        return c["GQ"], c["DC"], c["SP"]

    assert merge("llama3-8b", 1) == (4, 64, 32)
    assert merge("llama3-8b", 8) == (4, 128, 8)
    assert merge("llama3-1b", 1) == (4, 16, 64)
    assert merge("gemma3-27b", 1)[:2] == (2, 128)
    off = dataclasses.replace(CUDA, attn_launch_group_merge=False)
    assert merge("llama3-8b", 1, off)[:2] == (0, 0)  # the per-head merge
    with pytest.raises(ConfigError, match=r"^triton kernels: attn_launch_merge_elements must be \(head_dim, values\)"):
        merge("llama3-8b", 1, dataclasses.replace(CUDA, attn_launch_merge_elements=((128, 0),)))
