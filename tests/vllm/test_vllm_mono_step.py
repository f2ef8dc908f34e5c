"""The mono path inside a real vLLM model, on CPU: vLLM's loader builds our override from the
real checkpoint, ``process_weights_after_loading`` starts the runner (reference backend), KV
caches are vLLM's own views (``create_kv_cache_views``) in the layout and CPU attention packing
vLLM resolves (bound through ``bind_kv_cache``, which runs the plugin's binding), and a decode
step runs through
``model.forward`` / ``model.compute_logits`` under vLLM's forward context with real attention
metadata objects. The result is compared with the project's independent reference decode
(weights read from the safetensors by ``monodecode.model.weights``, its own paged cache).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm_testlib import bind_vllm_kv, cpu_metadata, engine_config, load_model, mono_options

from monodecode.errors import RefusalError

FAMILIES = ("gemma3", "llama", "qwen3")
NUM_BLOCKS, BLOCK = 6, 128  # vLLM's CPU platform runs 128-token blocks
# vLLM's LM head returns bf16 logits (one rounding, relative error <= 2^-8); the reference keeps
# fp32. Measured worst relative difference: 0.0038 on all three families.
LOGIT_ATOL, LOGIT_RTOL = 0.002, 0.004


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

    cfg, model = mono_models[family]
    assert isinstance(model, MonoDecodeMixin)
    assert model.mono.state == "mono", model.mono.reasons
    dims = model.mono.dims
    names, caches = bind_vllm_kv(model, cfg, NUM_BLOCKS)
    assert model.mono.state == "mono", model.mono.reasons
    layers = model.mono._binding.cpu_layers  # vLLM's CPU packing, as the binding addresses it
    every = torch.arange(NUM_BLOCKS)

    # the oracle: weights straight from the checkpoint, its own contiguous paged cache
    weights = load_weights(model_dirs[family], dims)
    ref_kv = PagedKVCache.allocate(dims, NUM_BLOCKS, BLOCK)
    alloc = BlockAllocator(NUM_BLOCKS, BLOCK, shuffle_seed=7)
    gen = torch.Generator().manual_seed(11)
    lens = [5, 140, 33]  # crosses a block boundary and (gemma3) the sliding window of 24
    for seq, n in enumerate(lens):
        R.prefill(weights, torch.randint(0, dims.vocab_size, (n,), generator=gen), ref_kv, alloc, seq_id=seq)
    all_slots = torch.arange(NUM_BLOCKS * BLOCK)
    for layer, lkv in enumerate(layers):  # the same K/V into vLLM's cache, through vLLM's packing
        lkv.scatter(lkv.key, all_slots, ref_kv.key[layer].flatten(0, 1))
        lkv.scatter(lkv.value, all_slots, ref_kv.value[layer].flatten(0, 1))

    steps_before = _counter("monodecode_steps_total", path="mono")
    for step in range(2):
        meta = alloc.decode_metadata(list(range(len(lens))))
        ids = torch.randint(0, dims.vocab_size, (len(lens),), generator=gen)
        ref_logits = R.decode_step(weights, ids, meta, ref_kv)
        md = cpu_metadata(meta, len(lens), 1)
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
        slots = meta.slot_mapping
        for layer, lkv in enumerate(layers):
            for got, want in (
                (lkv.gather(lkv.key, every), ref_kv.key[layer]),
                (lkv.gather(lkv.value, every), ref_kv.value[layer]),
            ):
                torch.testing.assert_close(got.flatten(0, 1)[slots], want.flatten(0, 1)[slots], atol=0, rtol=0)
    assert _counter("monodecode_steps_total", path="mono") - steps_before == 2


def _assert_degraded(model, code: str, needle: str) -> None:
    assert model.mono.state == "degraded"
    reason = model.mono.reasons[0]
    assert reason.startswith(f"{code}: ") and needle in reason, reason
    assert _counter("monodecode_refusal_info", reason=code) == 1.0
    assert _counter("monodecode_enabled") == 0.0


def test_a_layout_other_than_the_platforms_pair_is_refused_at_binding(model_dirs, vllm_distributed, tmp_path):
    """An engine that resolved LBNHC for CPU_ATTN (vLLM itself refuses that; here forced) is
    refused when vLLM binds the cache, naming backend and layout, before any forward."""
    cfg = engine_config(
        model_dirs["llama"], additional_config={"monodecode": mono_options(tmp_path, on_refusal="degrade")}
    )
    model = load_model(cfg)
    assert model.mono.state == "mono"
    bind_vllm_kv(model, cfg, layout="LBNHC")
    _assert_degraded(model, "kv_layout", "vLLM resolved KV layout LBNHC for attention backend CPU_ATTN")


def test_refusal_at_binding_raises_out_of_vllms_kv_initialization(model_dirs, vllm_distributed, tmp_path):
    cfg = engine_config(model_dirs["llama"], additional_config={"monodecode": mono_options(tmp_path)})
    model = load_model(cfg)
    with pytest.raises(RefusalError, match="kv_layout: vLLM resolved KV layout LBNHC"):
        bind_vllm_kv(model, cfg, layout="LBNHC")


def test_kv_layout_the_backend_cannot_address_is_refused_at_binding(
    model_dirs, vllm_distributed, tmp_path, monkeypatch
):
    """The binding runs the kernels' own layout check (``DecodeKernels.check_kv``) on the views:
    Triton kernels built for another block size than vLLM's cache are refused with kv_layout
    when vLLM binds the cache (checked on a GPU-platform binding: strided views of LBNHC)."""
    from monodecode.kernels.base import BuildRequest
    from monodecode.kernels.triton.launch import TritonKernels
    from monodecode.services.platform import Platform
    from monodecode.vllm_plugin import binding

    cfg = engine_config(
        model_dirs["llama"],
        block_size=BLOCK,
        additional_config={"monodecode": mono_options(tmp_path, on_refusal="degrade")},
    )
    model = load_model(cfg)
    assert model.mono.state == "mono"
    dims = model.mono.runner.dims
    triton = TritonKernels.__new__(TritonKernels)
    triton.req = BuildRequest(
        dims=dims,
        weight_dtype="bf16",
        tp_size=1,
        widths=(1,),
        block_size=2 * BLOCK,
        platform=Platform("cuda", "sm90", "H200", 132),
    )
    triton.dims = dims
    model.mono.runner._kernels = triton  # the runner keeps its kernels private; the test swaps them in
    # what needs a GPU: the platform's pair (FLASH_ATTN + LBNHC) and the layers' backend name
    model.mono.platform = Platform("cuda", "sm90", "H200", 132)
    monkeypatch.setattr(binding, "layer_backend", lambda attn: "FLASH_ATTN")
    bind_vllm_kv(model, cfg, layout="LBNHC")
    _assert_degraded(model, "kv_layout", "triton kernels: built for KV block size 256, cache has 128")


def test_unknown_attention_metadata_is_never_a_decode_step(mono_models):
    """Metadata of a class the bound backend does not build (FlashInfer's has num_prefills and
    num_decode_tokens but no block table) is read as no metadata, not classified as decode."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    cfg, model = mono_models["llama"]
    names, _ = bind_vllm_kv(model, cfg, NUM_BLOCKS)

    @dataclasses.dataclass
    class FlashInferMetadata:  # the fields vLLM's FlashInfer metadata has, and not a block table
        num_actual_tokens: int = 1
        num_decodes: int = 1
        num_decode_tokens: int = 1
        num_prefills: int = 0
        num_prefill_tokens: int = 0

    with set_current_vllm_config(cfg), set_forward_context({n: FlashInferMetadata() for n in names}, cfg, num_tokens=1):
        assert model.mono.plan(torch.tensor([3])) is None
    assert model.mono._last.reason == "no_metadata"
