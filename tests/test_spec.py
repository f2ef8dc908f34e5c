"""Deployment refusal rules: pure, and every reason comes out at once."""

import dataclasses

from monodecode.model.profiles import profile_dims
from monodecode.spec import Deployment, KernelSpec, fitting_capture_sizes, reason_code, refusal_reasons

DIMS = profile_dims("llama3-8b")
AMD = KernelSpec(
    backend="flydsl",
    platform_kinds=("rocm",),
    archs=("gfx942", "gfx950"),
    grid_size=256,
    tp_sizes=(1, 2, 4, 8),
    block_sizes=(16,),
    widths=(1, 2, 4, 8),
    head_dims=(64, 128),
    built_dims=(DIMS.digest(),),
)
GOOD = Deployment(
    platform_kind="rocm",
    arch="gfx942",
    compute_units=304,
    partition_mode="SPX",
    tp_size=2,
    weight_dtype="fp8_fnuz",
    block_size=16,
    dims=DIMS,
    graph_mode="full",
    capture_sizes=(1, 2, 4, 8, 16),
)


def codes(reasons):
    return [reason_code(r) for r in reasons]


def test_supported_deployment_has_no_reasons():
    assert refusal_reasons(GOOD, AMD) == []


def test_every_reason_is_reported_at_once():
    bad = dataclasses.replace(
        GOOD,
        platform_kind="rocm",
        arch="gfx90a",
        compute_units=38,
        partition_mode="CPX",
        tp_size=3,
        pp_size=2,
        dp_size=2,
        expert_parallel=True,
        lora=True,
        speculative="eagle3",
        kv_connector="LMCacheConnectorV1",
        sleep_mode=True,
        dcp_size=2,
        cpu_offload=True,
        model_dtype="float16",
        weight_dtype="int4",
        kv_cache_dtype="fp8_e4m3",
        block_size=32,
        dims=profile_dims("qwen3-8b"),
        graph_mode="piecewise",
        artifact_problem="no_artifact: nothing baked",
        extra_reasons=("custom: extra",),
    )
    got = codes(refusal_reasons(bad, AMD))
    assert got == [
        "arch",
        "compute_units",
        "tp_size",
        "tp_size",
        "pipeline_parallel",
        "data_parallel",
        "expert_parallel",
        "lora",
        "speculative_decoding",
        "kv_connector",
        "sleep_mode",
        "decode_context_parallel",
        "cpu_offload",
        "dtype",
        "weight_dtype",
        "kv_cache_dtype",
        "block_size",
        "dims_not_built",
        "graph_mode",
        "no_artifact",
        "custom",
    ]


def test_reasons_are_sentences_naming_values():
    bad = dataclasses.replace(GOOD, compute_units=38, partition_mode="CPX", speculative="ngram")
    reasons = refusal_reasons(bad, AMD)
    assert any("256 resident workgroups" in r and "38 CUs (partition mode CPX)" in r for r in reasons)
    assert any("speculative decoding (ngram)" in r for r in reasons)
    assert all("\n" not in r for r in reasons)


def test_platform_kind_and_unknown_dims():
    r = refusal_reasons(dataclasses.replace(GOOD, platform_kind="cpu", arch="cpu", dims=None), AMD)
    assert codes(r)[:1] == ["platform"] and "model" in codes(r)


def test_family_and_head_dim():
    spec = dataclasses.replace(AMD, families=("llama",), built_dims=None, head_dims=(128,))
    r = refusal_reasons(dataclasses.replace(GOOD, dims=profile_dims("gemma3-27b"), tp_size=2), spec)
    assert codes(r) == ["model_family"]  # gemma3-27b has head_dim 128
    r = refusal_reasons(dataclasses.replace(GOOD, dims=profile_dims("llama3-1b")), spec)
    assert codes(r) == ["head_dim"]


def test_tp_must_split_heads():
    spec = dataclasses.replace(AMD, built_dims=None, tp_sizes=None)
    assert codes(refusal_reasons(dataclasses.replace(GOOD, tp_size=16), spec)) == ["tp_size"]  # 8 KV heads


def test_capture_sizes_must_map_onto_widths_and_suggest_a_fix():
    d = dataclasses.replace(GOOD, capture_sizes=(1, 2, 3, 4, 6, 8, 16, 32))
    r = refusal_reasons(d, AMD)
    assert codes(r) == ["capture_sizes"]
    assert "3, 6" in r[0] and '"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]' in r[0]
    assert fitting_capture_sizes((3, 6, 16), (1, 2, 4, 8)) == [1, 2, 4, 8, 16]
    # eager mode ignores capture sizes
    assert refusal_reasons(dataclasses.replace(d, graph_mode="none"), AMD) == []


def test_supported_features_are_allowed():
    spec = dataclasses.replace(AMD, supports=frozenset({"lora"}))
    assert refusal_reasons(dataclasses.replace(GOOD, lora=True), spec) == []
