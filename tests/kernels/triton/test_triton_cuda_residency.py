"""The CUDA target's persistent launches fit the programs per SM their plans put there.

K1 and K2 wait on each other's programs (completion counters), so every program of a grid must
be resident at once: a cooperative launch refuses a grid that is not, and the step then falls
back. FP8 weights run two programs per SM (``Target.fp8_wide_programs_per_sm`` /
``fp8_narrow_programs_per_sm``; K1 at widths > 1 one, ``fp8_wide_k1_programs_per_sm``), so their
registers and shared memory must leave room for that many.
Compiled for sm_90 on the CPU (ptxas ``-v`` and Triton's shared-memory figure, ``offline.py``);
the H200 runs confirm it (benchmarks/README.md, runs 63-65)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is installed by the project's 'triton' extra (make test)")

from monodecode.kernels.triton.config import CUDA, assumed_programs_per_sm, plan_for, residency_misfits  # noqa: E402
from monodecode.kernels.triton.offline import compile_width  # noqa: E402
from monodecode.model.profiles import profile_dims  # noqa: E402

SMS = 132  # the H200


@pytest.mark.parametrize("width", [1, 8])
@pytest.mark.parametrize("profile", ["llama3-1b", "llama3-8b", "qwen3-8b", "gemma3-27b"])
def test_fp8_persistent_launches_fit_their_programs_per_sm(profile, width):
    """What the launcher checks on the GPU (``residency_misfits``), here from the sm_90 compile."""
    dims = profile_dims(profile)
    plan = plan_for(dims, [width], SMS, CUDA, fp8=True).layers[width]
    for r in compile_width(dims, "fp8", width, "sm_90", CUDA, num_programs=SMS):
        if r.kernel == "ka":  # a plain grid, not persistent
            continue
        assert residency_misfits(CUDA, plan, True, {r.kernel: r.workgroups_per_cu}) == [], (
            f"{profile} width {width} {r.kernel}: {r.regs} registers x {r.num_warps} warps, {r.lds_bytes} B shared"
        )


@pytest.mark.parametrize("group_merge", [True, False])
@pytest.mark.parametrize("width", [1, 8])
@pytest.mark.parametrize("profile", ["llama3-1b", "llama3-8b", "gemma3-27b"])
def test_attention_launch_fits_the_programs_its_splits_count_on(profile, width, group_merge):
    """``Target.attn_launch_slots_per_sm`` splits the context so the attention launch's tasks fill
    one wave of that many programs per SM: its registers and shared memory must let exactly that
    many reside (fewer: a part-full second wave; more: idle room in the one wave). With the
    group merge (the default: 8192 values per slice took 1B's registers from 124 to 154) and
    without it."""
    import dataclasses

    target = dataclasses.replace(CUDA, attn_launch_group_merge=group_merge)
    dims = profile_dims(profile)
    want = assumed_programs_per_sm(target, plan_for(dims, [width], SMS, target).layers[width], False).get("ka")
    assert want  # every head size of the benchmark's profiles has its count
    (r,) = compile_width(dims, "bf16", width, "sm_90", target, num_programs=SMS, kernels=("ka",))
    assert r.workgroups_per_cu == want, (
        f"{profile} width {width}: {r.regs} registers x {r.num_warps} warps, {r.lds_bytes} B shared: "
        f"{r.workgroups_per_cu} attention programs per SM, attn_launch_slots_per_sm says {want}"
    )
