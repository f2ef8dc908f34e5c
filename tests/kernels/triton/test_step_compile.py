"""The step launch (``step_kernel.py``) on this CPU: it compiles for the H100/H200, and the packed
weights it streams are laid out where its addressing looks.

The Gluon kernel cannot run in Triton's interpreter; its numerics are ``test_step_gpu.py``'s, on a
GPU. Here it compiles for sm_90 at every width it is built for (Llama-3-1B's widths 1-8, 8B's
width 1) with no spills and within one program per SM, its shared memory at least what
``StepGeometry.shared_bytes`` plans (so the refusals that rest on it are never optimistic); and
``pack_step_weights`` puts each projection where the kernel's TMA row views and ``cp.async``
offsets read it.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from monodecode.kernels.triton.step_plan import (  # noqa: E402
    SMEM_PER_PROGRAM,
    StepGeometry,
    step_refusals,
)
from monodecode.model.profiles import profile_dims  # noqa: E402

H200_SMS = 132


@pytest.mark.parametrize(("profile", "width"), [("llama3-1b", 1), ("llama3-1b", 2), ("llama3-1b", 8), ("llama3-8b", 1)])
def test_step_kernel_compiles_for_sm90_without_spills(profile, width):
    """Every built width compiles with 0 spills in one program per SM, its shared memory at least
    the plan's estimate and within 1.1 KiB of it (the compiler's own scratch)."""
    from monodecode.kernels.triton.offline import cuda_resources
    from monodecode.kernels.triton.step_launch import compile_step

    dims = profile_dims(profile)
    assert step_refusals(dims, "bf16", 1, (width,), H200_SMS) == []
    compiled = compile_step(dims, width, H200_SMS, block_size=16)
    res = cuda_resources("step_kernel", width, 8, compiled)
    assert res.spills == 0, res
    shared = compiled.metadata.shared
    planned = StepGeometry(dims, width, H200_SMS).shared_bytes()
    assert planned <= shared <= min(SMEM_PER_PROGRAM, planned + 1126), (planned, shared)


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


def test_refusals_that_depend_on_the_programs():
    """Above 1 row a program sums down's warps through its staged input, so it may own one down
    tile only: a 3072-wide model (192 down tiles) on 132 SMs is refused at width 2, not at width 1;
    too few SMs for one attention task per row and KV head is refused, and so is an MLP no wider
    than hidden above width 1."""
    wide = dataclasses.replace(profile_dims("llama3-1b"), hidden_size=3072, num_heads=48, num_kv_heads=12)
    assert step_refusals(wide, "bf16", 1, (1,), H200_SMS) == []
    (why,) = step_refusals(wide, "bf16", 1, (1, 2), H200_SMS)
    assert why.startswith("model_dims: ") and "one down tile" in why
    (few,) = step_refusals(profile_dims("llama3-1b"), "bf16", 1, (8,), 60)
    assert few.startswith("compute_units: ") and "attention task" in few
    # an MLP no wider than hidden: the warps' sum would overwrite the staged input above width 1
    narrow = dataclasses.replace(profile_dims("llama3-1b"), intermediate_size=2048)
    assert step_refusals(narrow, "bf16", 1, (1,), H200_SMS) == []
    (why,) = step_refusals(narrow, "bf16", 1, (1, 4), H200_SMS)
    assert why.startswith("model_dims: ") and "first chunk" in why


def _weights(dims, seed=0):
    from monodecode.model.weights import random_weights

    return random_weights(dims, seed=seed, num_layers=2)


def test_packed_weights_are_where_the_kernel_reads_them():
    """Each layer's QKV, o_proj and down rows through the kernel's TMA row views (layer * rows a
    layer + the stage's first row), and gate/up's tile t as 8 gate rows then their 8 up rows."""
    from monodecode.kernels.triton.step_launch import pack_step_weights

    dims = dataclasses.replace(
        profile_dims("llama3-1b"), hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=4
    )
    g = StepGeometry(dims, 1, H200_SMS)
    w = _weights(dims)
    blob = pack_step_weights(g, w, "cpu")
    h, i = dims.hidden_size, dims.intermediate_size
    rows_h, rows_i = blob.view(-1, h), blob.view(-1, i)
    for n, lw in enumerate(w.layers):
        first_h = n * (g.layer_weights // h)
        qkv = torch.cat([lw.q_proj.weight, lw.k_proj.weight, lw.v_proj.weight])
        assert torch.equal(rows_h[first_h : first_h + g.qkv_rows], qkv)
        o0 = first_h + g.off_o // h
        assert torch.equal(rows_h[o0 : o0 + h], lw.o_proj.weight)
        gu0 = first_h + g.off_gu // h
        for t in (0, 1, i // 8 - 1):
            tile = rows_h[gu0 + 16 * t : gu0 + 16 * t + 16]
            assert torch.equal(tile[:8], lw.gate_proj.weight[8 * t : 8 * t + 8])
            assert torch.equal(tile[8:], lw.up_proj.weight[8 * t : 8 * t + 8])
        d0 = n * (g.layer_weights // i) + g.off_down // i
        assert torch.equal(rows_i[d0 : d0 + h], lw.down_proj.weight)
