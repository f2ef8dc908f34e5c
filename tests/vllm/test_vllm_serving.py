"""The serve settings (``vllm_plugin.serving``) against vLLM's own backend classes and its own
KV layout resolution (``resolve_kv_cache_layout``, the engine core's start-up check). vLLM's ROCm
backend modules read the GPU's arch at import: gfx942's stands in (aiter_on_cpu.py)."""

from __future__ import annotations

import pytest
import vllm_testlib  # noqa: F401  (VLLM_TARGET_DEVICE=cpu before vLLM is imported)
from aiter_on_cpu import backend_class as _backend_class
from vllm_testlib import engine_config

from monodecode.errors import ConfigError
from monodecode.vllm_plugin.serving import SERVE_PAIRS, SERVE_SETTINGS, pair_reason, serve_settings

PAIRS = [pair for pairs in SERVE_PAIRS.values() for pair in pairs]


def _resolve(vllm_config, monkeypatch, backends: list[str], requested: str | None):
    """vLLM's engine-core resolution for a worker running ``backends``, with
    ``VLLM_KV_CACHE_LAYOUT=requested``."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout

    if requested is None:
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", requested)
    vllm_config.cache_config.kv_cache_layout = None
    supported = [layout.name for layout in get_supported_kv_cache_layouts([_backend_class(b) for b in backends])]
    return resolve_kv_cache_layout(vllm_config, [supported]).name


@pytest.fixture
def config(model_dirs):
    return engine_config(model_dirs["llama"])


@pytest.mark.parametrize("s", PAIRS, ids=lambda s: f"{s.platform}-{s.attention_backend}")
def test_each_pair_is_accepted_by_vllms_own_resolution(s, config, monkeypatch):
    assert s.args == ("--attention-backend", s.attention_backend)
    assert s.env["VLLM_KV_CACHE_LAYOUT"] == s.kv_cache_layout
    declared = _backend_class(s.attention_backend).supported_kv_cache_layouts()
    assert declared is None or s.kv_cache_layout in [layout.name for layout in declared]
    assert _resolve(config, monkeypatch, [s.attention_backend], s.kv_cache_layout) == s.kv_cache_layout
    assert pair_reason(s.platform, s.attention_backend, s.kv_cache_layout) is None
    assert serve_settings(s.platform, s.attention_backend) == s


def test_rocm_defaults_to_aiter_on_with_aiters_attention():
    """AMD's recommended setting: AITER on, its flash attention (vLLM would otherwise pick ROCM_ATTN
    first, whose packed K|V mono decode cannot read); the older Triton pair stays selectable."""
    rocm = serve_settings("rocm")
    assert (rocm.attention_backend, rocm.kv_cache_layout) == ("ROCM_AITER_FA", "LBHNC")
    assert rocm.env == {"VLLM_KV_CACHE_LAYOUT": "LBHNC", "VLLM_ROCM_USE_AITER": "1"}
    assert SERVE_SETTINGS["rocm"] == rocm
    assert serve_settings("rocm", "TRITON_ATTN").env == {"VLLM_KV_CACHE_LAYOUT": "LBNHC"}
    with pytest.raises(ConfigError, match="attention backend 'ROCM_ATTN': mono decode on rocm runs with ROCM_AITER_FA"):
        serve_settings("rocm", "ROCM_ATTN")


@pytest.mark.parametrize("backend", ["ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"])
def test_the_triton_pairs_layout_makes_every_rocm_backend_refuse_to_start(backend, config, monkeypatch):
    """VLLM_KV_CACHE_LAYOUT=LBNHC (the TRITON_ATTN pair's) with any ROCm backend: the engine core
    raises, so every AITER pair names the head-major LBHNC."""
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=LBNHC does not satisfy every supported set"):
        _resolve(config, monkeypatch, [backend], "LBNHC")
    assert all(p.kv_cache_layout == "LBHNC" for p in SERVE_PAIRS["rocm"] if p.attention_backend == backend)


def test_cpu_attention_accepts_only_its_own_layout(config, monkeypatch):
    with pytest.raises(ValueError, match="does not satisfy every supported set"):
        _resolve(config, monkeypatch, ["CPU_ATTN"], "LBNHC")
    assert _resolve(config, monkeypatch, ["CPU_ATTN"], None) == serve_settings("cpu").kv_cache_layout


def test_any_other_pair_is_refused_naming_backend_and_layout():
    why = pair_reason("rocm", "ROCM_ATTN", "LHBNC")
    assert why.startswith("attention_backend: ") and "ROCM_ATTN" in why and "LHBNC" in why and "TRITON_ATTN" in why
    assert "--attention-backend ROCM_AITER_FA, VLLM_KV_CACHE_LAYOUT=LBHNC" in why
    why = pair_reason(
        "rocm", "ROCM_AITER_UNIFIED_ATTN", "LHBNC"
    )  # AITER's other layout: its head stride spans the cache
    assert why.startswith("kv_layout: ") and "VLLM_KV_CACHE_LAYOUT=LBHNC" in why
    why = pair_reason("rocm", "TRITON_ATTN", "LHBNC")
    assert why.startswith("kv_layout: ") and "LHBNC" in why and "VLLM_KV_CACHE_LAYOUT=LBNHC" in why
    assert pair_reason("cuda", "FLASHINFER", "LBNHC").startswith("attention_backend: ")
    assert pair_reason("cpu", "CPU_ATTN", "LBNHC").startswith("kv_layout: ")


def test_unknown_platform_is_one_clear_error():
    with pytest.raises(ConfigError, match="platform 'tpu': mono decode serves on cpu, cuda, rocm"):
        serve_settings("tpu")
