"""The step launch (``step_kernel.py``) on this CPU: it compiles for the H100/H200, and the packed
weights it streams are laid out where its addressing looks.

The Gluon kernel cannot run in Triton's interpreter; its numerics are ``test_step_gpu.py``'s, on a
GPU. Here it compiles for sm_90 at the widths it is built for (Llama-3-1B's widths 1, 2 and 8,
8B's 1 and 8, where down's input streams) with no spills and within one program per SM, its shared memory at least what
``StepGeometry.shared_bytes`` plans (so the refusals that rest on it are never optimistic); and
``pack_step_weights`` puts each projection where the kernel's TMA row views and ``cp.async``
offsets read it.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from monodecode.kernels.triton.step_plan import (  # noqa: E402
    NCTR,
    SMEM_PER_PROGRAM,
    StepGeometry,
    step_refusals,
)
from monodecode.model.profiles import profile_dims  # noqa: E402

H200_SMS = 132


@pytest.mark.parametrize(
    ("profile", "width", "weight_dtype"),
    [("llama3-1b", 1, "bf16"), ("llama3-1b", 2, "bf16"), ("llama3-1b", 8, "bf16"), ("llama3-8b", 1, "bf16"),
     ("llama3-8b", 8, "bf16"), ("llama3-8b", 1, "fp8"), ("llama3-8b", 2, "fp8"), ("llama3-8b", 8, "fp8"),
     ("llama3-1b", 8, "fp8"), ("gemma3-27b", 1, "bf16")],
)  # fmt: skip
def test_step_kernel_compiles_for_sm90_without_spills(profile, width, weight_dtype):
    """Every built width compiles with 0 spills in one program per SM, its shared memory at least
    the plan's estimate and within 1.1 KiB of it (the compiler's own scratch); FP8's ring holds
    e4m3 and its weights are widened before mma.sync, not the activations narrowed."""
    from monodecode.kernels.triton.offline import cuda_resources
    from monodecode.kernels.triton.step_launch import SHARED_SCRATCH, compile_step

    dims = profile_dims(profile)
    assert step_refusals(dims, weight_dtype, 1, (width,), H200_SMS) == []
    compiled = compile_step(dims, width, H200_SMS, block_size=16, weight_dtype=weight_dtype)
    res = cuda_resources("step_kernel", width, 8, compiled)
    assert res.spills == 0, res
    shared = compiled.metadata.shared
    planned = StepGeometry(dims, width, H200_SMS, weight_dtype=weight_dtype).shared_bytes()
    assert planned <= shared <= min(SMEM_PER_PROGRAM, planned + SHARED_SCRATCH), (planned, shared)
    # FP8's weights widened: on FMA (width 1) by cvt from e4m3 pairs, on mma.sync by integer ops
    # and one bf16 multiply (``_bf16_of_e4m3``), never the activations narrowed
    ptx = compiled.asm["ptx"]
    fp8 = weight_dtype == "fp8"
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) == (fp8 and width == 1)
    assert ("mul.rn.bf16x2" in ptx) == (fp8 and width > 1)
    if width > 1:  # every product on bf16 operands: the activations stay bf16
        mmas = set(re.findall(r"mma\.sync\.aligned\.[\w.]+", ptx))
        assert mmas and all(".bf16.bf16." in m for m in mmas), mmas


@pytest.mark.parametrize(("profile", "width", "plan"), [("llama3-1b", 1, {"ring": 4}), ("llama3-1b", 8, {"ring": 2}),
                                                   ("llama3-8b", 1, {"ring": 2}), ("llama3-1b", 8, {"stream_down": 0}),
                                                   ("llama3-1b", 2, {"wide_tma": 0}),
                                                   ("llama3-8b", 8, {"wide_tma": 1}), ("llama3-1b", 8, {"kv_step": 1}),
                                                   ("llama3-8b", 1, {"early_down": 0}), ("llama3-1b", 8, {"early_down": 0}),
                                                   ("llama3-1b", 8, {"stream_down": 0, "early_down": 0}),
                                                   ("llama3-8b", 1, {"att_pad": 0}), ("llama3-1b", 2, {"att_pad": 1}),
                                                   ("llama3-8b", 4, {"att_pad": 1}), ("llama3-8b", 1, {"one_sum": 0}),
                                                   ("llama3-1b", 1, {"one_sum": 0}), ("gemma3-27b", 1, {"one_sum": 0}),
                                                   ("llama3-8b", 8, {"one_sum": 0}), ("llama3-1b", 8, {"one_sum": 0}),
                                                   ("llama3-8b", 1, {"grid": 128}), ("llama3-8b", 8, {"grid": 128})])  # fmt: skip
def test_plan_variants_compile_without_spills(profile, width, plan):
    """The benchmark's step variants (``PLAN_KNOBS``: a 4-slot ring at width 1, a 2-slot one,
    1B's down input staged whole above 1 row, 1B's 4-slot ring filled by ``cp.async``, 8B's
    3-slot one by TMA at width 8, 1B's attention stepping 16 positions a warp at width 8, not its
    default 32; 32 at widths 1-4 spills 8-56 bytes and is not a variant kept; down waiting for the
    whole of gate/up at its start, staged and streamed; the attention's partials summed through
    unpadded rows at width 1, padded ones at widths 2 and 4; the norms summing their squares
    across the block once a chunk, not the default's once a row; 8B on a grid of 128 programs) compile with 0 spills too, the ring's
    slots in the shared memory as planned."""
    from monodecode.kernels.triton.offline import cuda_resources
    from monodecode.kernels.triton.step_launch import SHARED_SCRATCH, compile_step

    dims = profile_dims(profile)
    compiled = compile_step(dims, width, H200_SMS, 16, plan)
    assert cuda_resources("step_kernel", width, 8, compiled).spills == 0
    planned = StepGeometry(dims, width, H200_SMS, **plan).shared_bytes()
    assert planned <= compiled.metadata.shared <= planned + SHARED_SCRATCH


def _chunk_refill(ptx: str) -> str:
    """Width 1's chunk loop from its slot wait (the kernel's first ``try_wait``) to the first load
    of the slot's weights: the refill between them."""
    body = ptx[ptx.index("mbarrier.try_wait") :]
    return body[: re.search(r"ld\.shared\.v4\.b(16|32)\s", body).start()]


@pytest.mark.parametrize(("weight_dtype", "plan", "barriers"), [("bf16", {}, 4), ("fp8", {}, 4),
                                                                 ("fp8", {"one_box": 0}, 5)])  # fmt: skip
def test_fp8s_refill_asks_for_a_chunk_in_one_box(weight_dtype, plan, barriers):
    """Width 1's TMA refill (``StepGeometry.box_parts``): FP8's two-part chunk in one box by
    default, so one copy and 4 ``bar.sync``s a chunk (Triton's barrier analysis puts one between
    any two of the slot's mbarrier and TMA operations), as bf16's one-part chunk; a box a part
    (``one_box`` 0) two copies and 5. 0 spills, the shared memory as planned."""
    from monodecode.kernels.triton.offline import cuda_resources
    from monodecode.kernels.triton.step_launch import SHARED_SCRATCH, compile_step

    dims = profile_dims("llama3-8b")
    compiled = compile_step(dims, 1, H200_SMS, 16, plan, weight_dtype=weight_dtype)
    refill = _chunk_refill(compiled.asm["ptx"])
    assert refill.count("bar.sync") == barriers
    assert refill.count("cp.async.bulk.tensor") == (2 if plan else 1)
    assert cuda_resources("step_kernel", 1, 8, compiled).spills == 0
    planned = StepGeometry(dims, 1, H200_SMS, weight_dtype=weight_dtype, **plan).shared_bytes()
    assert planned <= compiled.metadata.shared <= planned + SHARED_SCRATCH


@pytest.mark.parametrize(("width", "padded"), [(1, True), (2, False)])
def test_attention_partials_padded_by_default_at_width_1_only(width, padded):
    """``StepGeometry.pads_att_sum``: width 1's build sums the attention's warp partials through
    padded rows (its PTX differs from ``att_pad`` 0's), width 2's through plain ones (the same PTX
    as ``att_pad`` 0's), as runs 178-180 measured."""
    from monodecode.kernels.triton.step_launch import compile_step

    dims = profile_dims("llama3-8b")
    default = compile_step(dims, width, H200_SMS, 16).asm["ptx"]
    plain = compile_step(dims, width, H200_SMS, 16, {"att_pad": 0}).asm["ptx"]
    assert (default != plain) == padded


def test_norms_summed_once_take_fewer_barriers():
    """``one_sum`` (the default): the norms reduce their squares across the block once a row,
    not once a 1024-column chunk (``one_sum`` 0), so 8B's builds (4 chunks a row) have fewer
    ``bar.sync``s at width 1 (FMA staging) and at width 8 (mma's staged rows)."""
    from monodecode.kernels.triton.step_launch import compile_step

    dims = profile_dims("llama3-8b")
    for width in (1, 8):
        default, once = (
            compile_step(dims, width, H200_SMS, 16, p).asm["ptx"].count("bar.sync") for p in ({"one_sum": 0}, {})
        )
        assert once < default, (width, once, default)


def test_bad_plans_are_refused_in_one_line():
    """An unknown knob, a value out of range or of the wrong type, and a plan that does not fit a
    width's shared memory (a 4-slot ring beside 1B's whole down input at width 8) are one
    ConfigError line from the build."""
    from monodecode.errors import ConfigError
    from monodecode.kernels.triton.step_plan import PLAN_KNOBS, checked_plan

    assert checked_plan(None) == {} and checked_plan({"ring": 4}) == {"ring": 4}
    knobs = {
        "ring",
        "stream_down",
        "wide_tma",
        "kv_step",
        "early_down",
        "mma1",
        "span",
        "one_box",
        "att_pad",
        "one_sum",
        "grid",
    }
    assert set(PLAN_KNOBS) == knobs
    with pytest.raises(ValueError, match="Gemma-3's post norms are staged on width 1's FMA path only, not with mma1"):
        StepGeometry(profile_dims("gemma3-27b"), 1, H200_SMS, mma1=1).check()
    for plan, msg in (({"pf": 8}, "unknown knob 'pf'"), ({"ring": 9}, "ring must be an integer 2-8"),
                      ({"ring": 1}, "ring must be an integer 2-8"), ({"ring": True}, "ring must be"),
                      ({"ring": "4"}, "ring must be")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            checked_plan(plan)
    with pytest.raises(ValueError, match="exceed"):  # beside down's whole input
        StepGeometry(profile_dims("llama3-1b"), 8, H200_SMS, ring=4, stream_down=0).check()
    StepGeometry(profile_dims("llama3-1b"), 8, H200_SMS, ring=4, kv_step=1).check()  # streamed
    with pytest.raises(ValueError, match="exceed"):  # ... beside width 8's default 32-position K/V slots
        StepGeometry(profile_dims("llama3-1b"), 8, H200_SMS, ring=4).check()
    # the default steps 32 positions a warp from width 8 at 64-wide heads, by model and width alone
    assert [StepGeometry(profile_dims("llama3-1b"), w, H200_SMS).kv_groups for w in (1, 2, 4, 8)] == [1, 1, 1, 2]
    assert StepGeometry(profile_dims("llama3-8b"), 8, H200_SMS).kv_groups == 1
    StepGeometry(profile_dims("llama3-1b"), 1, H200_SMS, ring=4).check()
    with pytest.raises(ValueError, match="exceed"):  # 8B's 128-wide heads: two 128 KiB K/V slots
        StepGeometry(profile_dims("llama3-8b"), 1, H200_SMS, kv_step=2).check()
    one_b = StepGeometry(profile_dims("llama3-1b"), 8, H200_SMS, kv_step=2)
    one_b.check()  # two 64 KiB K/V slots beside a 3-slot weight ring
    assert (one_b.kv_slots, one_b.ring_slots, one_b.constexprs(16)["PW"]) == (2, 3, 32)
    with pytest.raises(ConfigError, match="unknown knob") as e:
        _small_build((1,), plan={"depth": 2})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="exceed"):
        _small_build((1, 2), plan={"ring": 6})
    assert _small_build((1,), plan={"ring": 2})[1].geometry[1].ring_slots == 2


def test_a_variant_reads_the_packed_weights_it_shares():
    """A build with ``share`` (the benchmark's step variants) reads the other build's packed
    weights and TMA views, which are the model's layout whatever the plan: one copy on the GPU."""
    import dataclasses

    from monodecode.kernels.triton.step_launch import StepKernels

    dims, base = _small_build((1,))
    variant = StepKernels(base.req, _weights(dims), H200_SMS, "cpu", plan={"ring": 4}, share=base)
    assert variant.weights is base.weights and variant.descriptors is base.descriptors
    assert variant.geometry[1].ring_slots == 4 and base.geometry[1].ring_slots == 3
    own = StepKernels(dataclasses.replace(base.req), _weights(dims), H200_SMS, "cpu", plan={"ring": 4})
    assert own.weights is not base.weights and torch.equal(own.weights, base.weights)


def test_geometry_counts_tiles_splits_and_padding():
    """Llama-3-1B at width 1 and 8 on 132 SMs, worked by hand: QKV 3072 rows = 192 tiles (2 a
    program), o_proj and down 128 (1), gate/up 16384 (125 -> 1); a layer's chunks 2x2 + 2 + 1x2 +
    1x8 = 16; splits fill the programs with one attention task each (8 KV heads: 16 at width 1, 2 at
    width 8); 8B's layer is padded so down starts at whole rows of 4096 and 14336 (lcm 28672)."""
    one = StepGeometry(profile_dims("llama3-1b"), 1, H200_SMS)
    assert one.stage_tiles() == (192, 128, 1024, 128)
    assert one.tiles_per_program() == (2, 1, 8, 1)
    assert one.chunks_per_layer() == 2 * 2 + 1 * 2 + 8 * 2 + 1 * 8
    assert one.splits == 16 and StepGeometry(profile_dims("llama3-1b"), 8, H200_SMS).splits == 2
    big = StepGeometry(profile_dims("llama3-8b"), 1, H200_SMS)
    assert big.off_down % 28672 == 0 and big.layer_weights % 28672 == 0
    assert big.off_down >= big.off_gu + 2 * 14336 * 4096 and big.off_down - (big.off_gu + 2 * 14336 * 4096) < 28672


def test_down_starts_on_the_chunks_gate_ups_rounds_but_the_last_produced():
    """``down_early_chunks``, against a walk of gate/up's tiles: tile t runs in round t // programs
    and makes SiLU(g)·u outputs 8 t .. 8 t + 7, so a chunk of down's input is early when every
    tile making it runs before the last round (8B: 13 of 14 chunks, 1B: 7 of 8, on 132 SMs). Off
    with the knob, with one gate/up round, or where streamed down copies a late chunk at its start."""
    for name in ("llama3-1b", "llama3-8b"):
        for width in (1, 2, 8):
            g = StepGeometry(profile_dims(name), width, H200_SMS)
            tiles, last = g.stage_tiles()[2], g.tiles_per_program()[2] - 1
            chunk_round = {}
            for t in range(tiles):
                c = 8 * t // 1024
                chunk_round[c] = max(chunk_round.get(c, 0), t // H200_SMS)
            early = [c for c in sorted(chunk_round) if chunk_round[c] < last]
            assert early == list(range(g.down_early_chunks)), (name, width, early)
            assert StepGeometry(profile_dims(name), width, H200_SMS, early_down=0).down_early_chunks == 0
    assert StepGeometry(profile_dims("llama3-8b"), 1, H200_SMS).down_early_chunks == 13
    assert StepGeometry(profile_dims("llama3-1b"), 1, H200_SMS).down_early_chunks == 7
    one_round = StepGeometry(profile_dims("llama3-1b"), 1, 1100)  # 1024 gate/up tiles on 1100 programs
    assert one_round.tiles_per_program()[2] == 1 and one_round.down_early_chunks == 0
    # an MLP of 2048 (256 gate/up tiles, 2 rounds): chunk 0 is early; streamed at width 4 with a
    # 4-slot ring, down copies its first 3 X chunks at its start, so it waits for all of gate/up there
    narrow = dataclasses.replace(profile_dims("llama3-1b"), intermediate_size=2048)
    assert StepGeometry(narrow, 1, H200_SMS).down_early_chunks == 1
    assert StepGeometry(narrow, 4, H200_SMS).ring_slots == 4
    assert StepGeometry(narrow, 4, H200_SMS).down_early_chunks == 0


def test_the_busiest_program_streams_its_share_of_a_layer():
    """``busiest_program_share`` against a walk of every program's tiles (tile t of a stage on
    program t % programs, its chunks K / 1024): 8B on 132 SMs, the busiest program 104 chunks (3
    QKV, 2 o_proj, 14 gate/up, 2 down tiles) against a mean of 13312 / 132; 1B 30 against 3712 / 132."""
    for name, busiest, total in (("llama3-8b", 104, 13312), ("llama3-1b", 30, 3712)):
        g = StepGeometry(profile_dims(name), 1, H200_SMS)
        h, i = g.dims.hidden_size // 1024, g.dims.intermediate_size // 1024
        load = [0] * H200_SMS
        for tiles, chunks in zip(g.stage_tiles(), (h, h, h, i)):
            for t in range(tiles):
                load[t % H200_SMS] += chunks
        assert (max(load), sum(load)) == (busiest, total), name
        assert g.busiest_program_share() == pytest.approx(max(load) / (sum(load) / H200_SMS))


def test_a_grid_of_fewer_programs_divides_8bs_stages_evenly():
    """``grid`` (``PLAN_KNOBS``): 128 programs on 132 SMs, every count of the plan taken over the
    128 (its NPROG, its tiles a program), where each of 8B's stages divides evenly: the busiest
    program streams the mean, the same 104 chunks as on 132; a grid of the SMs or more leaves
    them; the attention keeps its 16 splits at width 1."""
    from monodecode.kernels.triton.step_launch import step_source

    dims = profile_dims("llama3-8b")
    full, even = StepGeometry(dims, 1, H200_SMS), StepGeometry(dims, 1, H200_SMS, grid=128)
    assert (even.programs, even.constexprs(16)["NPROG"]) == (128, 128)
    assert even.busiest_program_share() == 1.0 < full.busiest_program_share()
    assert even.chunks_per_layer() == full.chunks_per_layer() == 104
    assert even.splits == full.splits == 16
    assert StepGeometry(dims, 1, H200_SMS, grid=H200_SMS + 4).programs == H200_SMS
    src = step_source(dims, 1, H200_SMS, 16, {"grid": 128})
    assert src.constants[(src.fn.arg_names.index("NPROG"),)] == 128


def test_refusals_that_depend_on_the_programs():
    """Above 1 row a program keeps two down accumulators: a 3072-wide model (192 down tiles, 2 a
    program on 132 SMs) streams down's input and is served at width 2, a 5120-wide one (320
    tiles, 3 a program) is refused at width 2, not at width 1; an MLP no wider than hidden
    streams too (the warps' sums would overwrite a whole staged input); too few SMs for one
    attention task per row and KV head is refused."""
    wide = dataclasses.replace(profile_dims("llama3-1b"), hidden_size=3072, num_heads=48, num_kv_heads=12)
    assert step_refusals(wide, "bf16", 1, (1, 2), H200_SMS) == []
    assert StepGeometry(wide, 2, H200_SMS).streams_down and not StepGeometry(wide, 1, H200_SMS).streams_down
    wider = dataclasses.replace(profile_dims("llama3-8b"), hidden_size=5120, num_heads=40, num_kv_heads=10)
    assert step_refusals(wider, "bf16", 1, (1,), H200_SMS) == []
    (why,) = step_refusals(wider, "bf16", 1, (1, 2), H200_SMS)
    assert why.startswith("model_dims: ") and "two down tiles at most" in why and "need 3" in why
    (few,) = step_refusals(profile_dims("llama3-1b"), "bf16", 1, (8,), 60)
    assert few.startswith("compute_units: ") and "attention task" in few
    narrow = dataclasses.replace(profile_dims("llama3-1b"), intermediate_size=2048)
    assert step_refusals(narrow, "bf16", 1, (1, 4), H200_SMS) == []
    g = StepGeometry(narrow, 4, H200_SMS)
    assert g.streams_down and g.x_chunks == max(2048 // 1024, g.x_slots) + 1


def test_streamed_down_keeps_its_x_slots_apart_from_the_sums_and_free_until_read():
    """Streamed down's plan (``StepGeometry.x_slots``): X chunk k is copied with the weight chunk
    ``ring - 1`` ahead of the arithmetic that is down's k-th of tile 0, into slot 1 + k % slots;
    walking that order chunk by chunk, no slot is copied into before every tile has read its last
    X chunk, the slots never reach chunk 0 (the warps' sums) and fit the staged input, for 8B at
    every ring the plan allows and a model of one down tile a program."""
    for dims, width in ((profile_dims("llama3-8b"), 8), (profile_dims("llama3-8b"), 2),
                        (dataclasses.replace(profile_dims("llama3-1b"), intermediate_size=2048), 4)):  # fmt: skip
        for ring in (2, 3, 4):
            g = StepGeometry(dims, width, H200_SMS, ring=ring)
            assert g.streams_down
            td, nk, xs = g.tiles_per_program()[3], dims.intermediate_size // 1024, g.x_slots
            assert 1 + xs <= g.x_chunks and dims.hidden_size // 1024 < g.x_chunks
            pre = (ring - 2) // td + 1  # X chunks copied at the stage's start, one slot each
            assert pre <= xs
            for rs in range(nk * td):  # down's chunks, k-outer: rs = k * td + j
                k2, j2 = divmod(rs + ring - 1, td)  # the weight chunk asked for before rs's arithmetic
                if j2 == 0 and pre <= k2 < nk:  # its X chunk goes with it, into the slot of k2 - xs
                    assert rs >= 0 and (k2 - xs) * td + td - 1 < rs, (ring, k2, rs)  # every tile read k2 - xs
                k = rs // td
                copied_at = k * td - (ring - 1)  # where chunk k's copy went out (k >= pre)
                assert k < pre or 0 <= copied_at <= rs  # after down's wait, before its first use


def _weights(dims, seed=0, weight_dtype="bf16"):
    from monodecode.model.weights import random_weights

    return random_weights(dims, seed=seed, weight_dtype=weight_dtype, num_layers=2)


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8"])
def test_packed_weights_are_where_the_kernel_reads_them(weight_dtype):
    """Each layer's QKV, o_proj and down rows through the kernel's TMA row views (layer * rows a
    layer + the stage's first row), and gate/up's tile t as 8 gate rows then their 8 up rows;
    FP8's e4m3 bytes as stored, and each packed row's scale at the kernel's index for it
    (``scale_offsets``: a layer's rows in the packed order)."""
    from monodecode.kernels.triton.step_launch import pack_step_weights

    dims = dataclasses.replace(
        profile_dims("llama3-1b"), hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=4
    )
    g = StepGeometry(dims, 1, H200_SMS, weight_dtype=weight_dtype)
    w = _weights(dims, weight_dtype=weight_dtype)
    blob, scales = pack_step_weights(g, w, "cpu")
    bits = blob.view(torch.uint8) if weight_dtype == "fp8" else blob  # (torch compares no e4m3 on the CPU)
    same = lambda a, lin: torch.equal(a, lin.weight.view(bits.dtype))  # noqa: E731
    h, i = dims.hidden_size, dims.intermediate_size
    rows_h, rows_i = bits.view(-1, h), bits.view(-1, i)
    so = g.scale_offsets
    for n, lw in enumerate(w.layers):
        first_h = n * (g.layer_weights // h)
        q, k = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
        assert same(rows_h[first_h : first_h + q], lw.q_proj) and same(rows_h[first_h + q : first_h + q + k], lw.k_proj)
        assert same(rows_h[first_h + q + k : first_h + g.qkv_rows], lw.v_proj)
        o0 = first_h + g.off_o // h
        assert same(rows_h[o0 : o0 + h], lw.o_proj)
        gu0 = first_h + g.off_gu // h
        for t in (0, 1, i // 8 - 1):
            tile = rows_h[gu0 + 16 * t : gu0 + 16 * t + 16]
            assert torch.equal(tile[:8], lw.gate_proj.weight[8 * t : 8 * t + 8].view(bits.dtype))
            assert torch.equal(tile[8:], lw.up_proj.weight[8 * t : 8 * t + 8].view(bits.dtype))
        d0 = n * (g.layer_weights // i) + g.off_down // i
        assert same(rows_i[d0 : d0 + h], lw.down_proj)
        if weight_dtype == "bf16":
            assert scales.numel() == 1
            continue
        sc = scales[n * so["end"] : (n + 1) * so["end"]]
        assert torch.equal(sc[q : q + k], lw.k_proj.scale) and torch.equal(sc[so["o"] : so["gu"]], lw.o_proj.scale)
        for t in (0, i // 8 - 1):  # the scales of gate/up's tile t: its 8 gate rows', then their up rows'
            tile = sc[so["gu"] + 16 * t : so["gu"] + 16 * t + 16]
            assert torch.equal(tile[:8], lw.gate_proj.scale[8 * t : 8 * t + 8])
            assert torch.equal(tile[8:], lw.up_proj.scale[8 * t : 8 * t + 8])
        assert torch.equal(sc[so["down"] :], lw.down_proj.scale) and so["end"] == g.qkv_rows + 2 * h + 2 * i


def test_gemma3_is_served_at_width_1_its_o_proj_through_its_own_view():
    """Gemma-3 (``StepGeometry.gemma``) at width 1 only, bf16 only; a model with q/k-norm but
    not the rest of Gemma-3 (Qwen3) is still refused. Its packed layer on a Gemma-shaped model
    whose hidden (1280) is no multiple of 1024 and whose heads x head_dim (1024) is not hidden:
    QKV and gate/up through the rows of hidden, o_proj through the rows of heads x head_dim (the
    kernel's third TMA view), down through the rows of intermediate; a stage of K = hidden is
    ceil(1280 / 1024) = 2 chunks, o_proj's 1, and the act rows hold o_proj's and down's raw sums."""
    from monodecode.kernels.triton.step_launch import pack_step_weights

    gemma = profile_dims("gemma3-27b")
    assert step_refusals(gemma, "bf16", 1, (1,), H200_SMS) == []
    (wide,) = step_refusals(gemma, "bf16", 1, (1, 8), H200_SMS)
    assert wide.startswith("model_dims: ") and "width 1 only" in wide
    assert any(w.startswith("weight_dtype: ") for w in step_refusals(gemma, "fp8", 1, (1,), H200_SMS))
    qwen = profile_dims("qwen3-8b")
    assert qwen.qk_norm and any("Llama-style and Gemma-3" in w for w in step_refusals(qwen, "bf16", 1, (1,)))
    big = StepGeometry(gemma, 1, H200_SMS)
    assert big.gemma and big.k_chunks == 6 and big.tiles_per_program() == (4, 3, 21, 3)
    assert big.chunks_per_layer() == 4 * 6 + 3 * 4 + 21 * 6 + 3 * 21
    dims = dataclasses.replace(gemma, hidden_size=1280, intermediate_size=2048, num_heads=8, num_kv_heads=4)
    g = StepGeometry(dims, 1, H200_SMS)
    g.check()
    h, i, q = 1280, 2048, 1024
    assert (g.k_chunks, g.constexprs(16)["KH"], g.constexprs(16)["QS"]) == (2, 2, q)
    a = g.act_offsets
    assert (a["att"], a["h1"], a["gu"], a["o"], a["dn"], a["end"]) == (
        g.qkv_rows, g.qkv_rows + q, g.qkv_rows + q + h, g.qkv_rows + q + h + i, g.qkv_rows + q + 2 * h + i,
        g.qkv_rows + q + 3 * h + i,
    )  # fmt: skip
    w = _weights(dims)
    blob, _ = pack_step_weights(g, w, "cpu")
    rows_h, rows_i, rows_q = blob.view(-1, h), blob.view(-1, i), blob.view(-1, q)
    for n, lw in enumerate(w.layers):
        first_h = n * (g.layer_weights // h)
        assert torch.equal(rows_h[first_h : first_h + q], lw.q_proj.weight)
        assert torch.equal(rows_h[first_h + g.qkv_rows - dims.kv_size : first_h + g.qkv_rows], lw.v_proj.weight)
        o0 = n * (g.layer_weights // q) + g.off_o // q
        assert torch.equal(rows_q[o0 : o0 + h], lw.o_proj.weight)
        gu0 = first_h + g.off_gu // h
        assert torch.equal(rows_h[gu0 + 8 : gu0 + 16], lw.up_proj.weight[:8])
        d0 = n * (g.layer_weights // i) + g.off_down // i
        assert torch.equal(rows_i[d0 : d0 + h], lw.down_proj.weight)


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8"])
def test_wide_tma_boxes_land_each_warp_its_own_columns_in_halves(weight_dtype):
    """Above 1 row the TMA ring's view (``weight_descriptors``) reads chunk k of a tile as two
    [8 column blocks, 16 rows, 64] boxes, at column 0 and 64: box h's block w is the tile's
    columns ``1024 k + 128 w + 64 h ..`` + 64, which is warp w's operand half h (``_chunk_mma``),
    swizzled as wide as a box row (128 bytes bf16, 64 fp8). Checked by reading the packed weights
    through the descriptor's own shape and strides."""
    from monodecode.kernels.triton.step_launch import pack_step_weights, weight_descriptors
    from monodecode.kernels.triton.step_plan import BK, NUM_WARPS, ROWS

    dims = dataclasses.replace(
        profile_dims("llama3-1b"), hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=4
    )
    g = StepGeometry(dims, 8, H200_SMS, weight_dtype=weight_dtype)
    blob, _ = pack_step_weights(g, _weights(dims, weight_dtype=weight_dtype), "cpu")
    wide = weight_descriptors(blob, dims)[(True, 1)]
    blob = blob.view(torch.uint8) if weight_dtype == "fp8" else blob
    half = BK // NUM_WARPS // 2
    for desc, k_dim in zip(wide, (dims.hidden_size, dims.intermediate_size)):
        swizzle = 64 * blob.element_size()
        assert desc.block_shape == [NUM_WARPS, ROWS, half] and desc.layout.swizzle_byte_width == swizzle
        view = blob.as_strided(desc.shape, desc.strides)  # [column block, row, 128]
        rows = blob.view(-1, k_dim)
        for row0, k in ((0, 0), (ROWS * 5, k_dim // BK - 1)):
            for h in (0, 1):
                box = view[k * NUM_WARPS : (k + 1) * NUM_WARPS, row0 : row0 + ROWS, h * half : (h + 1) * half]
                want = rows[row0 : row0 + ROWS, k * BK : (k + 1) * BK].reshape(ROWS, NUM_WARPS, 2, half)[:, :, h]
                assert torch.equal(box, want.permute(1, 0, 2)), (k_dim, row0, k, h)


def _small_build(widths=(1, 2), plan=None, weight_dtype="bf16"):
    """``StepKernels`` of a 2-layer Llama-shaped model small enough for this CPU (hidden 1024,
    intermediate 3072), built on the CPU: everything but the launch itself."""
    from monodecode.kernels.base import BuildRequest
    from monodecode.kernels.triton.step_launch import StepKernels
    from monodecode.services.platform import Platform

    dims = dataclasses.replace(
        profile_dims("llama3-1b"), hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=4, num_layers=2
    )
    platform = Platform(kind="cuda", arch="sm_90", name="NVIDIA H100", compute_units=H200_SMS, torch_usable=True)
    req = BuildRequest(dims, weight_dtype, 1, widths, 16, platform)
    return dims, StepKernels(req, _weights(dims, weight_dtype=weight_dtype), H200_SMS, "cpu", plan=plan)


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8"])
def test_launch_arguments_match_the_kernel_signature(weight_dtype):
    """The host's argument list for a whole step and for one layer has exactly the kernel's
    runtime parameters, in order, with the buffers of that launch shape (each shape its own
    counters) and every layer's cache as an element offset from layer 0's; FP8's e4m3 weights
    and their scales where the kernel reads them, its constexpr on."""
    from monodecode.kernels.triton.launch import _Meta
    from monodecode.kernels.triton.step_kernel import step_kernel
    from monodecode.model.paged_kv import BlockAllocator, PagedKVCache

    dims, k = _small_build(weight_dtype=weight_dtype)
    kv = PagedKVCache.allocate(dims, num_blocks=8, block_size=16)
    alloc = BlockAllocator(8, 16)
    alloc.append_slots(0, 20)
    alloc.append_slots(1, 3)
    meta = _Meta(alloc.decode_metadata([0, 1]), "cpu")
    x = torch.zeros(2, dims.hidden_size, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    names = [n for n in step_kernel.arg_names if n != "NW"]
    step_args, consts = k.arguments(0, 2, x, meta, kv, out)
    layer_args, _ = k.arguments(1, 1, x, meta, kv, out)
    runtime = [n for n in names if n not in consts]
    assert len(step_args) == len(runtime) == len(layer_args)
    a, b = dict(zip(runtime, step_args)), dict(zip(runtime, layer_args))
    assert (a["first"], a["nlayers"], b["first"], b["nlayers"]) == (0, 2, 1, 1)
    assert a["ctr_ptr"].numel() == 2 * NCTR and b["ctr_ptr"].numel() == NCTR and a["epoch_ptr"] is not b["epoch_ptr"]
    for cache, offsets in (("kc_ptr", "koff_ptr"), ("vc_ptr", "voff_ptr")):
        caches = kv.key if cache == "kc_ptr" else kv.value
        assert a[cache] is caches[0]
        want = [(t.data_ptr() - caches[0].data_ptr()) // 2 for t in caches]
        assert a[offsets].tolist() == want and want[1] != 0
    assert a["bt_stride"] == meta.block_tables.stride(0) and a["x_ptr"] is x and a["out_ptr"] is out
    assert a["w_ptr"] is k.weights and a["ws_ptr"] is k.wscale and consts["FP8"] == (weight_dtype == "fp8")
    assert k.weights.dtype == (torch.float8_e4m3fn if weight_dtype == "fp8" else torch.bfloat16)
    assert k.wscale.numel() == (2 * consts["LAYER_S"] if weight_dtype == "fp8" else 1)


def test_caches_the_kernel_cannot_address_are_refused_in_one_line():
    """Layers whose caches differ in layout, or start at an offset the kernel's 16-element
    alignment hint would lie about, are refused with one ConfigError line, before any launch."""
    from monodecode.errors import ConfigError
    from monodecode.model.paged_kv import PagedKVCache

    dims, k = _small_build((1,))
    good = PagedKVCache.allocate(dims, num_blocks=4, block_size=16)
    k.check_kv(good)
    wide = PagedKVCache.allocate(dims, num_blocks=4, block_size=16)
    strided = PagedKVCache(
        [good.key[0], torch.zeros(4, 16, 2 * dims.num_kv_heads, dims.head_dim, dtype=torch.bfloat16)[:, :, ::2]],
        list(wide.value),
        16,
    )
    with pytest.raises(ConfigError, match="share one layout") as e:
        k.check_kv(strided)
    assert "\n" not in str(e.value)
    flat = torch.zeros(2 * 4 * 16 * dims.num_kv_heads * dims.head_dim + 8, dtype=torch.bfloat16)
    n = 4 * 16 * dims.num_kv_heads * dims.head_dim
    shifted = PagedKVCache(
        [flat[:n].view(4, 16, dims.num_kv_heads, dims.head_dim), flat[8 : 8 + n].view(4, 16, dims.num_kv_heads, dims.head_dim)],
        list(wide.value),
        16,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="start 32 bytes apart"):
        k.check_kv(shifted)
    with pytest.raises(ConfigError, match="block size 16, cache has 32"):
        k.check_kv(PagedKVCache.allocate(dims, num_blocks=4, block_size=32))


def test_timeline_stamps_compile_in_only_when_asked():
    """The served build carries no trace of the benchmark's timeline (no ``%globaltimer``); with
    ``prof`` the eight stamp sites are in (the stages' entry, input staged and part counted, and
    each attention task's q, k and v in and partial stored), and the stamped builds of 1B and 8B at widths 1 and 8
    have 0 spills too (at width 8 on 255 registers; 1B's spilled 40 bytes before session 24), so
    a timeline times the kernel the verdicts time."""
    from monodecode.kernels.triton.offline import cuda_resources
    from monodecode.kernels.triton.step_launch import compile_step

    plain = compile_step(profile_dims("llama3-1b"), 1, H200_SMS, 16)
    assert "globaltimer" not in plain.asm["ptx"]
    for name in ("llama3-1b", "llama3-8b"):
        for width in (1, 8):
            stamped = compile_step(profile_dims(name), width, H200_SMS, 16, prof=True)
            assert stamped.asm["ptx"].count("%globaltimer") == 8
            assert cuda_resources("step_kernel", width, 8, stamped).spills == 0, (name, width)
