"""Startup refusal (raise / degrade), per-step decisions from real vLLM metadata, step
accounting under graph replay, and fail-stop before logits, inside real vLLM models on CPU."""

from __future__ import annotations

import json

import pytest
import torch
from vllm_testlib import bind_vllm_kv, engine_config, load_model, mono_options

from monodecode.errors import RefusalError

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}


def _sample(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def _md(num_tokens: int, num_reqs: int, max_query_len: int, slot0: int = 0):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    seq_lens = torch.full((num_reqs,), 8, dtype=torch.int32)
    return CPUAttentionMetadata(
        num_actual_tokens=num_tokens,
        max_query_len=max_query_len,
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32),
        max_seq_len=8,
        seq_lens=seq_lens,
        block_table=torch.arange(num_reqs, dtype=torch.int32)[:, None],
        slot_mapping=torch.arange(num_tokens) + slot0,
        scheduler_metadata=None,
    )


def test_refusal_raises_with_every_reason(model_dirs, vllm_distributed, tmp_path):
    cfg = engine_config(
        model_dirs["llama"],
        enable_lora=True,
        speculative_config=NGRAM,
        additional_config={"monodecode": mono_options(tmp_path)},
    )
    with pytest.raises(RefusalError) as err:
        load_model(cfg)
    assert sorted(err.value.codes) == ["lora", "speculative_decoding"]
    assert str(err.value).startswith("mono decode refused: ")


def test_refusal_degrades_to_stock_and_exports_why(model_dirs, vllm_distributed, tmp_path):
    cfg = engine_config(
        model_dirs["llama"],
        enable_lora=True,
        speculative_config=NGRAM,
        additional_config={"monodecode": mono_options(tmp_path, on_refusal="degrade")},
    )
    model = load_model(cfg)
    assert model.mono.state == "degraded"
    assert _sample("monodecode_enabled") == 0.0
    assert _sample("monodecode_refusal_info", reason="lora") == 1.0
    assert _sample("monodecode_refusal_info", reason="speculative_decoding") == 1.0
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    names = [layer.self_attn.attn.layer_name for layer in model.model.layers]
    before = _sample("monodecode_fallback_steps_total", reason="degraded")
    with set_current_vllm_config(cfg), set_forward_context({n: _md(1, 1, 1) for n in names}, cfg, num_tokens=1):
        assert model.mono.plan(torch.tensor([7])) is None
    model.compute_logits(torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16))
    assert _sample("monodecode_fallback_steps_total", reason="degraded") - before == 1


@pytest.fixture(scope="module")
def mono_llama(model_dirs, vllm_distributed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lifecycle")
    cfg = engine_config(model_dirs["llama"], additional_config={"monodecode": mono_options(tmp, widths=[1, 2, 4])})
    model = load_model(cfg)
    assert model.mono.state == "mono"
    bind_vllm_kv(model, cfg)
    return cfg, model


@pytest.mark.parametrize(
    "rows, reqs, max_q, mode, reason",
    [
        (5, 1, 5, "NONE", "prefill"),
        (6, 3, 4, "NONE", "mixed_batch"),
        (5, 5, 1, "NONE", "rows_exceed_width"),
        (2, 2, 1, "PIECEWISE", "graph_mode"),
        (3, 3, 1, "NONE", None),
        (4, 4, 1, "FULL", None),
    ],
)
def test_step_decisions_from_real_metadata(mono_llama, rows, reqs, max_q, mode, reason):
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.forward_context import set_forward_context

    cfg, model = mono_llama
    names = [layer.self_attn.attn.layer_name for layer in model.model.layers]
    md = _md(rows, reqs, max_q)
    label = ("fallback_steps_total", {"reason": reason}) if reason else ("steps_total", {"path": "mono"})
    before = _sample("monodecode_" + label[0], **label[1])
    with (
        set_current_vllm_config(cfg),
        set_forward_context({n: md for n in names}, cfg, num_tokens=rows, cudagraph_runtime_mode=CUDAGraphMode[mode]),
    ):
        plan = model.mono.plan(torch.arange(rows) + 7)
    assert (plan is None) == (reason is not None)
    assert model.mono._last.reason == reason
    if plan is not None:
        assert plan.decision.width == {3: 4, 4: 4}[rows]
        assert plan.metas[0].slot_mapping.tolist() == list(range(rows))
    assert _sample("monodecode_" + label[0], **label[1]) - before == 1


def test_no_metadata_runs_vllms_forward(model_dirs, vllm_distributed, tmp_path):
    """A profile / dummy pass (no attention metadata) takes vLLM's own forward (with vLLM's
    native op implementations: the published wheel lacks the compiled CPU ops) and is not a step:
    not counted (issue 13 item 7: warm-up forwards never move the step series)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    cfg = engine_config(
        model_dirs["gemma3"],
        compilation_config={"custom_ops": ["none"]},
        additional_config={"monodecode": mono_options(tmp_path)},
    )
    model = load_model(cfg)
    before = _sample("monodecode_fallback_steps_total", reason="no_metadata")
    with set_current_vllm_config(cfg), set_forward_context(None, cfg, num_tokens=2):
        out = model(torch.tensor([3, 4]), torch.tensor([0, 1]))
    assert out.shape == (2, model.config.hidden_size)
    assert model.mono._last.reason == "no_metadata" and not model.mono._last.real
    assert _sample("monodecode_fallback_steps_total", reason="no_metadata") - before == 0


def test_graph_replay_steps_are_counted_from_compute_logits(mono_llama):
    """Under a FULL graph vLLM replays our forward without running its Python; the step is
    accounted in compute_logits with the decision captured for the padded size."""
    from monodecode.runtime.vote import StepInfo

    _, model = mono_llama
    mono = model.mono
    for size in (1, 2, 4, 8):  # what capturing the FULL graphs of these sizes records
        mono.runner.capture_step(StepInfo(num_rows=size, graph_mode="full"))
    mono._forward_ran = False
    hidden = torch.zeros(3, model.config.hidden_size, dtype=torch.bfloat16)
    mono_before = _sample("monodecode_steps_total", path="mono")
    model.compute_logits(hidden)  # 3 rows replay the size-4 graph: mono
    assert _sample("monodecode_steps_total", path="mono") - mono_before == 1
    big_before = _sample("monodecode_fallback_steps_total", reason="rows_exceed_width")
    model.compute_logits(torch.zeros(6, model.config.hidden_size, dtype=torch.bfloat16))  # size-8 graph: stock
    model.compute_logits(torch.zeros(9, model.config.hidden_size, dtype=torch.bfloat16))  # no graph holds 9 rows
    assert _sample("monodecode_fallback_steps_total", reason="rows_exceed_width") - big_before == 2


def test_failstop_before_logits_and_restart(model_dirs, vllm_distributed, tmp_path, monkeypatch):
    """A kernel failure (fault drill: NaN out of layer 1 at the first mono step) stops the step
    in compute_logits: no logits, marker + termination message with the cause; the next start
    exports it and, at the N-in-window limit, starts degraded."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from monodecode.runtime.failstop import FailStop

    monkeypatch.setenv("MONODECODE_FAULT", "nonfinite:layer=1,step=0")
    opts = mono_options(tmp_path, widths=[1, 2], max_failstops=1)
    cfg = engine_config(model_dirs["qwen3"], additional_config={"monodecode": opts})
    model = load_model(cfg)
    assert model.mono.state == "mono"
    names = [layer.self_attn.attn.layer_name for layer in model.model.layers]
    bind_vllm_kv(model, cfg)
    steps = _sample("monodecode_steps_total", path="fallback") + _sample("monodecode_steps_total", path="mono")
    with set_current_vllm_config(cfg), set_forward_context(None, cfg, num_tokens=1):
        assert model.mono.plan(torch.tensor([7])) is None  # vLLM's warm-up pass: no step, the drill stays armed
    model.compute_logits(torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16))
    assert _sample("monodecode_steps_total", path="fallback") + _sample("monodecode_steps_total", path="mono") == steps
    with set_current_vllm_config(cfg), set_forward_context({n: _md(1, 1, 1) for n in names}, cfg, num_tokens=1):
        hidden = model(torch.tensor([5]), torch.tensor([7]))
    with pytest.raises(FailStop) as err:
        model.compute_logits(hidden)
    assert "rank 0, step 0, site nonfinite" in str(err.value)
    marker = json.loads((tmp_path / "failstop" / "failstop-rank0.json").read_text())
    assert marker["events"][-1]["site"] == "nonfinite" and marker["events"][-1]["layer"] == 1
    assert "site nonfinite" in (tmp_path / "termination-log").read_text()

    monkeypatch.delenv("MONODECODE_FAULT")
    before = _sample("monodecode_failstop_total", site="nonfinite")
    restarted = load_model(
        engine_config(model_dirs["qwen3"], additional_config={"monodecode": {**opts, "on_refusal": "degrade"}})
    )
    assert restarted.mono.state == "degraded"
    assert [r.split(":")[0] for r in restarted.mono.reasons] == ["failstop_loop"]
    assert _sample("monodecode_last_failstop_timestamp_seconds") > 0
    assert _sample("monodecode_failstop_total", site="nonfinite") >= max(before, 1.0)
