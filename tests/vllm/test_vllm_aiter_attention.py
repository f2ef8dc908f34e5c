"""Mono decode on AMD's recommended serving setup, AITER on, run on this CPU machine: the
``ROCM_AITER_UNIFIED_ATTN`` pair (``LBHNC``) with AITER's own Triton attention kernel under
Triton's interpreter, and one linear layer (layer 1's ``o_proj``) held (16, 16)-preshuffled by
AITER's own ``shuffle_weight``, its GEMM reading it through AITER's permutation
(triton_attention_on_cpu.py and aiter_on_cpu.py say what stands in for the GPU).

The plugin binds vLLM's cache in place, undoes the shuffle into a row-major copy (its bytes
reported) and compares one decode step with vLLM's own layers on AITER's attention: they agree.
A plugin that does not see the shuffle reads the shuffled bytes row-major: refused at start-up
by that comparison (the golden check against the reference, on the same misread weights, passes).
Then a real vLLM engine serves every decode step mono on that pair.

The default ROCm pair, ``ROCM_AITER_FA`` (same LBHNC layout and K|V split), binds in place here
too; its own layers cannot run on this machine (its cache writer and its global-layer decode are
HIP kernels), so the comparison with them is skipped with one warning: it runs on an AMD node.

The three bindings share one child process (one interpreter and vLLM start-up), each on a fresh
model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vllm_testlib import needs_engine, run_child

SCRIPT = Path(__file__).with_name("triton_attention_on_cpu.py")
ATTENTION = "ROCM_AITER_UNIFIED_ATTN"
O_PROJ_COPY = 256 * 256 * 2  # the tiny model's o_proj [hidden, q heads * head_dim], bf16
COPY_LINE = "keeps row-major copies of"


def _run(*args) -> tuple[dict, str]:
    env = {**os.environ, "MONODECODE_TEST_ATTENTION": ATTENTION, "VLLM_LOGGING_LEVEL": "INFO"}
    return run_child([str(SCRIPT), *map(str, args)], "RESULT ", env=env)


@pytest.fixture(scope="module")
def binds(model_dirs, tmp_path_factory) -> tuple[dict, str]:
    """run name -> the plugin's state after binding, and the child's whole log."""
    names = ("none", "preshuffle_unseen", "backend=ROCM_AITER_FA")
    out, logged = _run("bind_each", model_dirs["gemma3"], tmp_path_factory.mktemp("aiter"), *names)
    return dict(zip(names, out["runs"])), logged


def test_aiters_pair_binds_in_place_reads_the_preshuffled_weight_and_matches_vllms_layers(binds):
    from monodecode.vllm_plugin.serving import serve_settings

    runs, logged = binds
    out = runs["none"]
    pair = serve_settings("rocm", ATTENTION)
    assert (out["platform"], out["backend"], out["layout"]) == ("rocm gfx942", ATTENTION, pair.kv_cache_layout), out
    assert out["state"] == "mono" and out["reasons"] == [], out
    assert out["compared_with_vllm"] and out["in_place"], out
    assert out["weight_copy_bytes"] == O_PROJ_COPY, out
    reported = [line for line in logged.splitlines() if COPY_LINE in line]
    assert len(reported) == 2, logged[-2000:]  # this model's and the ROCM_AITER_FA one's
    assert "1 AITER-preshuffled weights on rank 0 (the kernels read row-major): 0.1 MiB of GPU memory" in reported[0]
    assert "model.layers.1.self_attn.o_proj" in reported[0]


def test_a_preshuffled_weight_read_row_major_is_refused_at_start_up(binds):
    out = binds[0]["preshuffle_unseen"]
    assert out["built"]["state"] == "mono", out  # the golden check reads the same misread weights
    assert out["state"] == "degraded" and out["weight_copy_bytes"] == 0, out
    assert out["reasons"][0].startswith(
        "warmup_failed: one decode step through every layer: the kernels differ from vLLM's own decoder layers"
    ), out


def test_the_default_aiter_flash_attention_pair_binds_in_place(binds):
    from monodecode.vllm_plugin.serving import serve_settings

    runs, logged = binds
    out = runs["backend=ROCM_AITER_FA"]
    pair = serve_settings("rocm")
    assert (out["backend"], out["layout"]) == ("ROCM_AITER_FA", pair.kv_cache_layout), out
    assert out["state"] == "mono" and out["in_place"] and out["weight_copy_bytes"] == O_PROJ_COPY, out
    assert not out["compared_with_vllm"], out
    warned = [line for line in logged.splitlines() if "could not run vLLM's own decoder layers" in line]
    assert len(warned) == 1 and "(attention ROCM_AITER_FA)" in warned[0], logged[-2000:]


@needs_engine
def test_a_real_engine_serves_mono_with_aiter_on(model_dirs, tmp_path):
    """vLLM's engine (scheduler, CPU model runner, worker) with AITER's attention layers and the
    preshuffled o_proj: a batch of 4 rows decodes mono on vLLM's cache in place, every decode
    step after the prefill; the start-up comparison ran on the engine's own cache."""
    out, _ = _run("generate", model_dirs["gemma3"], tmp_path, "mono")
    assert out["backend"] == ATTENTION and out["state"] == "mono" and out["in_place"], out
    assert out["compared_with_vllm"] and out["weight_copy_bytes"] == O_PROJ_COPY, out
    new = len(out["continuations"][0]["token_ids"])
    assert out["mono_steps"] == new - 1 and out["steps"] == new, out
