"""The mono path inside a real vLLM model, on CPU: vLLM's loader builds our override from the
real checkpoint, ``process_weights_after_loading`` starts the runner (reference backend), KV
caches are vLLM's own views (``create_kv_cache_views``), and a decode step runs through
``model.forward`` / ``model.compute_logits`` under vLLM's forward context with real attention
metadata objects. The result is compared with the project's independent reference decode
(weights read from the safetensors by ``monodecode.model.weights``, its own paged cache).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from vllm_testlib import engine_config, load_model, mono_options

FAMILIES = ("gemma3", "llama", "qwen3")
NUM_BLOCKS, BLOCK = 24, 16
# vLLM's LM head returns bf16 logits (one rounding, relative error <= 2^-8); the reference keeps
# fp32. Measured worst relative difference: 0.0038 on all three families.
LOGIT_ATOL, LOGIT_RTOL = 0.002, 0.004


def _vllm_kv(model, vllm_config, layout_name: str):
    """KV caches exactly as vLLM 0.33 allocates them for ``layout_name``, bound to the layers."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import bind_kv_cache

    layers = [layer.self_attn.attn for layer in model.model.layers]
    spec = layers[0].get_kv_cache_spec(vllm_config)
    spec = dataclasses.replace(spec, block_size=BLOCK)
    page = spec.page_size_bytes
    names = [a.layer_name for a in layers]
    tensor = KVCacheTensor(
        size=page * NUM_BLOCKS * len(names), layers=names, layer_stride=page * NUM_BLOCKS, block_stride=page
    )
    buf = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(buf, spec, NUM_BLOCKS, KVCacheLayout[layout_name], tensor)
    caches = dict(zip(names, views))
    bind_kv_cache(caches, vllm_config.compilation_config.static_forward_context, [])
    return names, caches


def _metadata(meta, num_reqs: int, max_query_len: int):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    return CPUAttentionMetadata(
        num_actual_tokens=int(meta.positions.shape[0]),
        max_query_len=max_query_len,
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32),
        max_seq_len=int(meta.seq_lens.max()),
        seq_lens=meta.seq_lens,
        block_table=meta.block_tables,
        slot_mapping=meta.slot_mapping,
        scheduler_metadata=None,
    )


def _counter(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def mono_models(model_dirs, vllm_distributed, tmp_path_factory):
    """family -> (vllm_config, model) with mono decode on (reference backend)."""
    out = {}
    for family in FAMILIES:
        tmp = tmp_path_factory.mktemp(f"mono-{family}")
        cfg = engine_config(
            model_dirs[family], block_size=BLOCK, additional_config={"monodecode": mono_options(tmp, widths=[1, 2, 4])}
        )
        out[family] = (cfg, load_model(cfg))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_matches_reference(family, mono_models, model_dirs):
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from monodecode.model import reference as R
    from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
    from monodecode.model.weights import load_weights
    from monodecode.vllm_plugin.models import MonoDecodeMixin
    from monodecode.vllm_plugin.step import kv_views

    cfg, model = mono_models[family]
    assert isinstance(model, MonoDecodeMixin)
    assert model.mono.state == "mono", model.mono.reasons
    dims = model.mono.dims
    names, caches = _vllm_kv(model, cfg, "LBNHC")
    vllm_kv = kv_views([caches[n] for n in names], dims.num_kv_heads, dims.head_dim)

    # the oracle: weights straight from the checkpoint, its own contiguous paged cache
    weights = load_weights(model_dirs[family], dims)
    ref_kv = PagedKVCache.allocate(dims, NUM_BLOCKS, BLOCK)
    alloc = BlockAllocator(NUM_BLOCKS, BLOCK, shuffle_seed=7)
    gen = torch.Generator().manual_seed(11)
    lens = [5, 19, 33]  # crosses block boundaries and (gemma3) the sliding window of 24
    for seq, n in enumerate(lens):
        ids = torch.randint(0, dims.vocab_size, (n,), generator=gen)
        twin = copy.deepcopy(alloc)
        R.prefill(weights, ids, ref_kv, alloc, seq_id=seq)
        R.prefill(weights, ids, vllm_kv, twin, seq_id=seq)  # same K/V into vLLM's cache

    steps_before = _counter("monodecode_steps_total", path="mono")
    for step in range(2):
        meta = alloc.decode_metadata(list(range(len(lens))))
        ids = torch.randint(0, dims.vocab_size, (len(lens),), generator=gen)
        ref_logits = R.decode_step(weights, ids, meta, ref_kv)
        md = _metadata(meta, len(lens), 1)
        with (
            set_current_vllm_config(cfg),
            set_forward_context(
                {n: md for n in names}, cfg, num_tokens=len(lens), slot_mapping={n: meta.slot_mapping for n in names}
            ),
        ):
            hidden = model(ids, meta.positions)
        logits = model.compute_logits(hidden).float()[:, : dims.vocab_size]
        assert model.mono._last.path == "mono"
        torch.testing.assert_close(logits, ref_logits, atol=LOGIT_ATOL, rtol=LOGIT_RTOL)
        # the kernels wrote this step's K/V into vLLM's cache at vLLM's slots, like the oracle
        for layer in range(dims.num_layers):
            got, want = vllm_kv.key[layer], ref_kv.key[layer]
            slots = meta.slot_mapping
            torch.testing.assert_close(got.flatten(0, 1)[slots], want.flatten(0, 1)[slots], atol=0, rtol=0)
            got, want = vllm_kv.value[layer], ref_kv.value[layer]
            torch.testing.assert_close(got.flatten(0, 1)[slots], want.flatten(0, 1)[slots], atol=0, rtol=0)
    assert _counter("monodecode_steps_total", path="mono") - steps_before == 2


def _plan_one_decode_row(model, cfg, layout_name: str):
    """``model.mono.plan`` for one decode row over vLLM caches allocated in ``layout_name``."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from monodecode.model.paged_kv import BlockAllocator

    names, _ = _vllm_kv(model, cfg, layout_name)
    alloc = BlockAllocator(NUM_BLOCKS, BLOCK)
    alloc.append_slots(0, 3)
    meta = alloc.decode_metadata([0])
    md = _metadata(meta, 1, 1)
    with set_current_vllm_config(cfg), set_forward_context({n: md for n in names}, cfg, num_tokens=1):
        return model.mono.plan(meta.positions)


def _assert_degraded_for_kv_layout(model, needle: str) -> None:
    assert model.mono.state == "degraded"
    reason = model.mono.reasons[0]
    assert reason.startswith("kv_layout: ") and needle in reason, reason
    assert _counter("monodecode_refusal_info", reason="kv_layout") == 1.0
    assert _counter("monodecode_enabled") == 0.0


def test_head_major_kv_layout_degrades(model_dirs, vllm_distributed, tmp_path):
    """vLLM's head-major layout (LBHNC) has no flat slot axis: the first eligible step degrades
    (on_refusal=degrade) instead of writing K/V to the wrong place."""
    cfg = engine_config(
        model_dirs["llama"],
        block_size=BLOCK,
        additional_config={"monodecode": mono_options(tmp_path, on_refusal="degrade")},
    )
    model = load_model(cfg)
    assert model.mono.state == "mono"
    assert _plan_one_decode_row(model, cfg, "LBHNC") is None
    _assert_degraded_for_kv_layout(model, "LBNHC")


def test_kv_layout_the_backend_cannot_address_degrades_at_binding(model_dirs, vllm_distributed, tmp_path):
    """The binding runs the backend's own layout check (``DecodeKernels.check_kv``): FlyDSL
    kernels built for another block size than vLLM's cache degrade the first eligible step with
    kv_layout, before any launch. Only the check runs (its build needs a ROCm device)."""
    from monodecode.kernels.base import BuildRequest
    from monodecode.kernels.flydsl.launch import FlyDSLKernels
    from monodecode.services.platform import Platform

    cfg = engine_config(
        model_dirs["llama"],
        block_size=BLOCK,
        additional_config={"monodecode": mono_options(tmp_path, on_refusal="degrade")},
    )
    model = load_model(cfg)
    assert model.mono.state == "mono"
    dims = model.mono.runner.dims
    flydsl = FlyDSLKernels.__new__(FlyDSLKernels)
    flydsl.req = BuildRequest(
        dims=dims,
        weight_dtype="bf16",
        tp_size=1,
        widths=(1,),
        block_size=2 * BLOCK,
        platform=Platform("rocm", "gfx942", "MI300X", 304),
    )
    flydsl.dims, flydsl._kv_cache_args = dims, {}
    model.mono.runner._kernels = flydsl  # the runner keeps its kernels private; the test swaps them in
    assert _plan_one_decode_row(model, cfg, "LBNHC") is None
    _assert_degraded_for_kv_layout(model, "flydsl K1 was built for [blocks, block_size")
