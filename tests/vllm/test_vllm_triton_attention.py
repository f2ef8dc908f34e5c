"""The start-up comparison with vLLM's own decoder layers on the ROCm serve pair (``TRITON_ATTN``
with ``LBNHC``), run on this CPU machine with vLLM's real Triton attention under Triton's
interpreter (``triton_attention_on_cpu.py`` says what stands in for the GPU).

The plugin binds the cache in place (the GPU path: strided views of vLLM's cache), writes a
context with the backend's own writer, builds the metadata with the backend's own builder and
compares layer 0 and one whole decode step with vLLM's layers. A kernel that reads the weights
or the KV cache otherwise than vLLM does is refused before any request; before this check ran on
GPUs, both faults below served mono with nothing noticing (the golden check compares the kernels
with the reference on the same views).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_testlib import run_child

SCRIPT = Path(__file__).with_name("triton_attention_on_cpu.py")


def _bind(model_dir: Path, tmp: Path, fault: str = "", with_log: bool = False):
    out, logged = run_child([str(SCRIPT), str(model_dir), str(tmp), fault], "RESULT ")
    return (out, logged) if with_log else out


def test_the_rocm_pair_binds_in_place_and_matches_vllms_triton_layers(model_dirs, tmp_path):
    from monodecode.vllm_plugin.serving import SERVE_SETTINGS

    rocm = SERVE_SETTINGS["rocm"]
    out = _bind(model_dirs["gemma3"], tmp_path)
    assert (out["platform"], out["backend"], out["layout"]) == (
        "rocm gfx942",
        rocm.attention_backend,
        rocm.kv_cache_layout,
    ), out
    assert out["state"] == "mono" and out["reasons"] == [], out
    assert out["compared_with_vllm"] and out["in_place"], out


@pytest.mark.parametrize(
    "fault, stage",
    [
        ("o_proj_tiles", "one decode step through every layer"),  # layer 1's o_proj: seen only in the whole step
        ("kv_swapped", "layer 0"),
    ],
)
def test_a_kernel_reading_otherwise_than_vllm_is_refused_at_binding(fault, stage, model_dirs, tmp_path):
    out = _bind(model_dirs["gemma3"], tmp_path, fault)
    assert out["built"]["state"] == "mono", out  # the reference golden check passed at build
    assert out["state"] == "degraded", out
    why = out["reasons"][0]
    assert why.startswith(f"warmup_failed: {stage}: the kernels differ from vLLM's own decoder layers"), out
    assert not out["compared_with_vllm"] and not out["in_place"], out


def test_when_vllms_layer_cannot_run_the_comparison_is_skipped_with_a_warning(model_dirs, tmp_path):
    """An error inside vLLM's own layer (a GPU-specific failure the kernels have no part in) does
    not stop a server whose kernels passed the golden check: one warning names it."""
    out, logged = _bind(model_dirs["gemma3"], tmp_path, "vllm_layer_raises", with_log=True)
    assert out["state"] == "mono" and out["in_place"] and not out["compared_with_vllm"], out
    warned = [line for line in logged.splitlines() if "could not run vLLM's own decoder layers" in line]
    assert len(warned) == 1 and "RuntimeError: HIP error: invalid device function" in warned[0], logged[-2000:]
