"""Refusal reasons out of real vLLM config objects, for a matrix of deployments.

Configs come from vLLM's ``EngineArgs.create_engine_config`` (CPU platform). Three things the
CPU platform will not produce are set on the real objects afterwards, as a GPU platform would
leave them: CUDA-graph modes / capture sizes (a real ``CompilationConfig``), sleep mode, and
expert / decode-context parallelism (rejected by vLLM's CPU validation for this dense model).
Platform facts are descriptions of real nodes (MI300X SPX 304 CUs, MI300X CPX 38 CUs,
MI355X 256 CUs); the kernel spec is the flydsl backend's own.
"""

from __future__ import annotations

import pytest
from vllm_testlib import engine_config

from monodecode.services.platform import Platform
from monodecode.spec import reason_code, refusal_reasons

MI300X = Platform(kind="rocm", arch="gfx942", name="AMD Instinct MI300X", compute_units=304, partition_mode="SPX")
MI300X_CPX = Platform(kind="rocm", arch="gfx942", name="AMD Instinct MI300X", compute_units=38, partition_mode="CPX")
MI355X = Platform(kind="rocm", arch="gfx950", name="AMD Instinct MI355X", compute_units=256, partition_mode="SPX")
H200 = Platform(kind="cuda", arch="sm_90", name="NVIDIA H200", compute_units=132)


def _graphs(mode: str, sizes: list[int]):
    from vllm.config import CompilationConfig

    def apply(cfg):
        cfg.compilation_config = CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=sizes)

    return apply


def _set(obj_name: str, **values):
    def apply(cfg):
        obj = getattr(cfg, obj_name)
        for k, v in values.items():
            object.__setattr__(obj, k, v)

    return apply


CASES = {
    # name: (engine args, post-edit, platform, expected reason codes)
    "mi300x": ({}, None, MI300X, set()),
    "mi355x": ({}, None, MI355X, set()),
    "cpx_partition": ({}, None, MI300X_CPX, {"compute_units"}),
    "nvidia": ({}, None, H200, {"platform"}),
    "tp2": ({"tensor_parallel_size": 2}, None, MI300X, {"tp_size", "tp_shards"}),
    "pp2": ({"pipeline_parallel_size": 2}, None, MI300X, {"pipeline_parallel"}),
    "dp2": ({"data_parallel_size": 2}, None, MI300X, {"data_parallel"}),
    "lora": ({"enable_lora": True}, None, MI300X, {"lora"}),
    "ngram": (
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
        None,
        MI300X,
        {"speculative_decoding"},
    ),
    "kv_connector": (
        {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
        None,
        MI300X,
        {"kv_connector"},
    ),
    "fp8_kv": ({"kv_cache_dtype": "fp8"}, None, MI300X, {"kv_cache_dtype"}),
    "fp16": ({"dtype": "float16"}, None, MI300X, {"dtype", "weight_dtype"}),
    "fp8_weights_gfx942": ({"quantization": "fp8"}, None, MI300X, set()),
    "fp8_weights_gfx950": ({"quantization": "fp8"}, None, MI355X, set()),
    "cpu_offload": ({"cpu_offload_gb": 1}, None, MI300X, {"cpu_offload"}),
    "sleep_mode": ({}, _set("model_config", enable_sleep_mode=True), MI300X, {"sleep_mode"}),
    "expert_parallel": ({}, _set("parallel_config", enable_expert_parallel=True), MI300X, {"expert_parallel"}),
    "dcp2": ({}, _set("parallel_config", decode_context_parallel_size=2), MI300X, {"decode_context_parallel"}),
    "dbo": ({}, _set("parallel_config", enable_dbo=True), MI300X, {"dual_batch_overlap"}),
    "full_decode_only_fits": ({}, _graphs("FULL_DECODE_ONLY", [1, 2, 4, 8, 16, 32]), MI300X, set()),
    "full_and_piecewise_fits": ({}, _graphs("FULL_AND_PIECEWISE", [1, 2, 4, 8, 16]), MI300X, set()),
    "capture_sizes_misfit": ({}, _graphs("FULL_DECODE_ONLY", [1, 2, 3, 4, 6, 8, 16]), MI300X, {"capture_sizes"}),
    "full_one_routine": ({}, _graphs("FULL", [1, 2, 4, 8]), MI300X, {"graph_mode"}),
    "piecewise": ({}, _graphs("PIECEWISE", [1, 2, 4, 8]), MI300X, {"graph_mode"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_refusal_matrix(name, model_dirs):
    from monodecode.kernels import registry
    from monodecode.vllm_plugin.deployment import deployment_from_vllm_config

    kwargs, edit, platform, expected = CASES[name]
    cfg = engine_config(model_dirs["llama"], **kwargs)
    if edit is not None:
        edit(cfg)
    deployment = deployment_from_vllm_config(cfg, platform)
    spec = registry.get_backend("flydsl")().kernel_spec(platform, (1, 2, 4, 8))
    reasons = refusal_reasons(deployment, spec)
    assert {reason_code(r) for r in reasons} == expected, reasons
    assert len(reasons) == len(expected)  # one sentence per cause
    for r in reasons:
        assert "\n" not in r and len(r.split(": ", 1)[1]) > 20


@pytest.mark.parametrize("mode, refused", [("FULL_AND_PIECEWISE", True), ("FULL_DECODE_ONLY", True), ("NONE", False)])
def test_breakable_cuda_graphs_are_refused_when_graphs_are_captured(mode, refused, model_dirs, monkeypatch):
    """With vLLM's breakable CUDA graphs a PIECEWISE replay skips the plugin like a FULL one, so
    the replay accounting cannot tell them apart: graph capture with them on is refused; eager
    (no capture) is not affected."""
    from monodecode.kernels import registry
    from monodecode.vllm_plugin.deployment import deployment_from_vllm_config

    cfg = engine_config(model_dirs["llama"])
    _graphs(mode, [1, 2, 4, 8] if mode != "NONE" else [])(cfg)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    spec = registry.get_backend("flydsl")().kernel_spec(MI300X, (1, 2, 4, 8))
    reasons = refusal_reasons(deployment_from_vllm_config(cfg, MI300X), spec)
    breakable = [r for r in reasons if "VLLM_USE_BREAKABLE_CUDAGRAPH=1" in r]
    assert [reason_code(r) for r in breakable] == (["graph_mode"] if refused else []), reasons
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    assert not [r for r in refusal_reasons(deployment_from_vllm_config(cfg, MI300X), spec) if "BREAKABLE" in r]


def test_deployment_fields_from_real_config(model_dirs):
    from monodecode.vllm_plugin.deployment import deployment_from_vllm_config

    cfg = engine_config(model_dirs["gemma3"], block_size=32, quantization="fp8")
    _graphs("FULL_AND_PIECEWISE", [1, 2, 4, 8])(cfg)
    d = deployment_from_vllm_config(cfg, MI300X)
    assert (d.platform_kind, d.arch, d.compute_units, d.partition_mode) == ("rocm", "gfx942", 304, "SPX")
    assert (d.tp_size, d.pp_size, d.dp_size, d.block_size) == (1, 1, 1, 32)
    assert (d.model_dtype, d.weight_dtype, d.kv_cache_dtype) == ("bfloat16", "fp8_fnuz", "auto")
    assert (d.graph_mode, d.capture_sizes) == ("full_and_piecewise", (1, 2, 4, 8))
    assert d.dims.family == "gemma3" and d.dims.num_layers == 4 and d.dims.sliding_window == 24
    assert deployment_from_vllm_config(cfg, MI355X).weight_dtype == "fp8"


def test_capture_size_refusal_prints_sizes_that_fit(model_dirs):
    from monodecode.kernels import registry
    from monodecode.vllm_plugin.deployment import deployment_from_vllm_config

    cfg = engine_config(model_dirs["llama"])
    _graphs("FULL_DECODE_ONLY", [1, 2, 3, 4, 6, 8, 16, 24])(cfg)
    spec = registry.get_backend("flydsl")().kernel_spec(MI300X, (1, 2, 4, 8))
    (reason,) = refusal_reasons(deployment_from_vllm_config(cfg, MI300X), spec)
    assert reason.startswith("capture_sizes: FULL graph capture sizes 3, 6 are not built widths (1, 2, 4, 8)")
    assert reason.endswith("""--compilation-config '{"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24]}'""")


def test_every_reason_at_once(model_dirs):
    from monodecode.kernels import registry
    from monodecode.vllm_plugin.deployment import deployment_from_vllm_config

    cfg = engine_config(
        model_dirs["qwen3"],
        tensor_parallel_size=2,
        enable_lora=True,
        kv_cache_dtype="fp8",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
    )
    _graphs("PIECEWISE", [1, 2, 4])(cfg)
    spec = registry.get_backend("flydsl")().kernel_spec(MI300X_CPX, (1, 2, 4, 8))
    codes = [reason_code(r) for r in refusal_reasons(deployment_from_vllm_config(cfg, MI300X_CPX), spec)]
    assert sorted(codes) == sorted(
        ["compute_units", "tp_size", "lora", "speculative_decoding", "kv_cache_dtype", "graph_mode", "tp_shards"]
    )
