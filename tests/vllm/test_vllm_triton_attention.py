"""The start-up comparison with vLLM's own decoder layers on the ROCm ``TRITON_ATTN`` pair (with
``LBNHC``, AITER off; AITER's pair: test_vllm_aiter_attention.py), run on this CPU machine with
vLLM's real Triton attention under Triton's interpreter (``triton_attention_on_cpu.py`` says what
stands in for the GPU).

The plugin binds the cache in place (the GPU path: strided views of vLLM's cache), writes a
context with the backend's own writer, builds the metadata with the backend's own builder and
compares layer 0 and one whole decode step with vLLM's layers. A kernel that reads the weights
or the KV cache otherwise than vLLM does is refused before any request; before this check ran on
GPUs, both faults below served mono with nothing noticing (the golden check compares the kernels
with the reference on the same views). The width policy then times the kernels against vLLM's
Triton layers (``stock.VllmStockBench``) at several contexts and drops a width that loses.

Then a real vLLM engine serves on that pair: mono decode on vLLM's cache in place, its
continuations re-scored by a stock engine on the same backend (tests/e2e/rescore.py's measure).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from vllm_testlib import needs_engine, run_child

SCRIPT = Path(__file__).with_name("triton_attention_on_cpu.py")
REPO = Path(__file__).resolve().parents[2]


def _bind(model_dir: Path, tmp: Path, fault: str = "", with_log: bool = False):
    out, logged = run_child([str(SCRIPT), "bind", str(model_dir), str(tmp), fault], "RESULT ")
    return (out, logged) if with_log else out


def test_the_rocm_pair_binds_in_place_and_matches_vllms_triton_layers(model_dirs, tmp_path):
    """Then the width policy times the kernels (a fake slow at width 2) against vLLM's Triton
    layers on a private cache in vLLM's layout, at three contexts up to ``max_model_len``: width 1
    wins at every one and is served, width 2 loses at the longest and is dropped (its shorter
    contexts are not timed)."""
    from monodecode.vllm_plugin.serving import serve_settings

    rocm = serve_settings("rocm", "TRITON_ATTN")
    out = _bind(model_dirs["gemma3"], tmp_path, "slow_width_2")
    assert (out["platform"], out["backend"], out["layout"]) == (
        "rocm gfx942",
        rocm.attention_backend,
        rocm.kv_cache_layout,
    ), out
    assert out["state"] == "mono" and out["reasons"] == [], out
    assert out["compared_with_vllm"] and out["in_place"], out
    widths = out["widths"]
    print(widths["report"])
    assert widths["stock"] == "vllm_layers" and widths["served"] == [1], widths
    assert widths["dropped"]["2"].startswith("slower than stock: width 2 at context 31: "), widths
    assert list(widths["speedup"]["1"]) == ["7", "15", "31"] and list(widths["speedup"]["2"]) == ["31"], widths


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


# ---- a real engine serving on the ROCm pair ----------------------------------------------------

# Re-scoring bound (nats), as in tests/e2e: two correct decoders differ by bf16 rounding, hundredths
LOGPROB_BOUND = 0.5


def _generate(model_dir: Path, tmp: Path, which: str, fault: str = "") -> dict:
    out, _ = run_child([str(SCRIPT), "generate", str(model_dir), str(tmp), which, fault], "RESULT ")
    return out


def _rescore(model_dir: Path, tmp: Path, *generated: dict) -> list:
    """Each run's continuations re-scored by one stock engine (tests/e2e/rescore.py's measure)."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    from rescore import Continuation, agreement

    runs = [[Continuation(**c) for c in g["continuations"]] for g in generated]
    tmp.mkdir(parents=True, exist_ok=True)
    sequences = tmp / "sequences.json"
    sequences.write_text(json.dumps([c.prompt_ids + c.token_ids for conts in runs for c in conts]))
    scored, _ = run_child([str(SCRIPT), "score", str(model_dir), str(tmp), str(sequences)], "RESULT ")
    logprobs = iter(scored["prompt_logprobs"])
    return [agreement(conts, [next(logprobs) for _ in conts]) for conts in runs]


@needs_engine
def test_a_real_engine_serves_mono_on_the_rocm_pair_and_agrees_with_stock(model_dirs, tmp_path):
    """vLLM's engine (scheduler, CPU model runner, worker) with ``TRITON_ATTN`` layers: a batch of
    4 rows decodes mono on vLLM's cache in place (the GPU binding), every decode step mono; the
    continuations, re-scored by a stock engine on the same attention backend, stay within the
    bound. The same kernels going wrong after warm-up (o_proj tiles misread) are far outside it,
    so the check can fail."""
    model = model_dirs["gemma3"]
    mono = _generate(model, tmp_path / "mono", "mono")
    assert mono["backend"] == "TRITON_ATTN" and mono["state"] == "mono" and mono["in_place"], mono
    new = len(mono["continuations"][0]["token_ids"])
    assert mono["mono_steps"] == new - 1 and mono["steps"] == new, mono  # one prefill, then all mono
    broken = _generate(model, tmp_path / "broken", "mono", "o_proj_tiles")
    assert broken["mono_steps"] == new - 1, broken
    good, bad = _rescore(model, tmp_path / "score", mono, broken)
    print(f"re-scored by a stock TRITON_ATTN engine: mono {good.as_dict()} (worst at {good.worst})")
    print(f"re-scored: o_proj misread after warm-up {bad.as_dict()}")
    assert good.max_drift <= LOGPROB_BOUND and good.max_regret <= LOGPROB_BOUND, good
    assert max(bad.max_drift, bad.max_regret) > LOGPROB_BOUND, bad
