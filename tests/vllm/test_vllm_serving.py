"""The serve settings (``vllm_plugin.serving``) against vLLM's own backend classes and its own
KV layout resolution (``resolve_kv_cache_layout``, the engine core's start-up check)."""

from __future__ import annotations

import pytest
import vllm_testlib  # noqa: F401  (VLLM_TARGET_DEVICE=cpu before vLLM is imported)
from vllm_testlib import engine_config

from monodecode.errors import ConfigError
from monodecode.vllm_plugin.serving import SERVE_SETTINGS, pair_reason, serve_settings


def _backend_class(name: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        return AttentionBackendEnum[name].get_class()
    except (ImportError, RuntimeError) as e:  # a GPU-only import at module level
        pytest.skip(f"vLLM's {name} backend cannot be imported on this CPU machine with this vLLM: {e}")


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


@pytest.mark.parametrize("platform", sorted(SERVE_SETTINGS))
def test_each_platforms_pair_is_accepted_by_vllms_own_resolution(platform, config, monkeypatch):
    s = serve_settings(platform)
    assert s.args == ("--attention-backend", s.attention_backend)
    assert s.env == {"VLLM_KV_CACHE_LAYOUT": s.kv_cache_layout}
    declared = _backend_class(s.attention_backend).supported_kv_cache_layouts()
    assert declared is None or s.kv_cache_layout in [layout.name for layout in declared]
    assert _resolve(config, monkeypatch, [s.attention_backend], s.kv_cache_layout) == s.kv_cache_layout
    assert pair_reason(platform, s.attention_backend, s.kv_cache_layout) is None


@pytest.mark.parametrize("backend", ["ROCM_ATTN", "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN"])
def test_the_old_image_layout_makes_every_rocm_backend_refuse_to_start(backend, config, monkeypatch):
    """VLLM_KV_CACHE_LAYOUT=LBNHC (what the image used to set on ROCm) with any ROCm backend: the
    engine core raises, so the ROCm pair must name a backend that accepts its layout."""
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT=LBNHC does not satisfy every supported set"):
        _resolve(config, monkeypatch, [backend], "LBNHC")
    assert serve_settings("rocm").attention_backend != backend


def test_cpu_attention_accepts_only_its_own_layout(config, monkeypatch):
    with pytest.raises(ValueError, match="does not satisfy every supported set"):
        _resolve(config, monkeypatch, ["CPU_ATTN"], "LBNHC")
    assert _resolve(config, monkeypatch, ["CPU_ATTN"], None) == serve_settings("cpu").kv_cache_layout


def test_any_other_pair_is_refused_naming_backend_and_layout():
    why = pair_reason("rocm", "ROCM_ATTN", "LHBNC")
    assert why.startswith("attention_backend: ") and "ROCM_ATTN" in why and "LHBNC" in why and "TRITON_ATTN" in why
    why = pair_reason("rocm", "TRITON_ATTN", "LHBNC")
    assert why.startswith("kv_layout: ") and "LHBNC" in why and "VLLM_KV_CACHE_LAYOUT=LBNHC" in why
    assert pair_reason("cuda", "FLASHINFER", "LBNHC").startswith("attention_backend: ")
    assert pair_reason("cpu", "CPU_ATTN", "LBNHC").startswith("kv_layout: ")


def test_unknown_platform_is_one_clear_error():
    with pytest.raises(ConfigError, match="platform 'tpu': mono decode serves on cpu, cuda, rocm"):
        serve_settings("tpu")
