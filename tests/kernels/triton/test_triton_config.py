"""The Triton launch configuration's refusals (``kernels/triton/config.py``, pure Python): each is
one ``ConfigError`` line naming the problem, raised before any region of the plan is looked up."""

from __future__ import annotations

import dataclasses

import pytest

from monodecode.errors import ConfigError
from monodecode.kernels.plan import plan_model
from monodecode.kernels.triton.config import CUDA, k2_constexprs, plan_for, target_for
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
