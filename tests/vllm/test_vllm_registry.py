"""vLLM's model registry and loader with our overrides registered.

The registry resolves each supported architecture to our subclass (a general plugin cannot
know at load time whether mono decode is requested; see test_vllm_plugin_loader.py), and the
subclass decides from the VllmConfig: not requested -> the object vLLM builds and serves is an
instance of vLLM's own class, built by vLLM's own constructor; requested -> our subclass, whose
module tree and parameters are exactly vLLM's (nothing replaced or wrapped).
"""

from __future__ import annotations

import dataclasses

import pytest
from vllm_testlib import engine_config, load_model, mono_options

FAMILIES = {
    "llama": ("LlamaForCausalLM", "vllm.model_executor.models.llama", "MonoLlamaForCausalLM"),
    "qwen3": ("Qwen3ForCausalLM", "vllm.model_executor.models.qwen3", "MonoQwen3ForCausalLM"),
    "gemma3": ("Gemma3ForCausalLM", "vllm.model_executor.models.gemma3", "MonoGemma3ForCausalLM"),
}


def _stock_class(family):
    import importlib

    arch, module, _ = FAMILIES[family]
    return getattr(importlib.import_module(module), arch)


def _tree(model):
    """Every submodule's type (the root, ours or vLLM's, aside) and every tensor's shape/dtype."""
    return [(name, type(m)) for name, m in model.named_modules() if name], {
        name: (tuple(p.shape), p.dtype) for name, p in model.state_dict().items()
    }


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_registry_resolves_our_subclass(family, model_dirs):
    from monodecode.vllm_plugin import models

    arch, _, ours = FAMILIES[family]
    cfg = engine_config(model_dirs[family])
    cls, resolved_arch = cfg.model_config.registry.resolve_model_cls([arch], cfg.model_config)
    assert resolved_arch == arch
    assert cls is getattr(models, ours)
    assert issubclass(cls, _stock_class(family))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_info_is_vllms(family):
    """vLLM derives capabilities (PP, LoRA, ...) from the class; ours must read the same."""
    from vllm.model_executor.models.registry import _ModelInfo

    from monodecode.vllm_plugin import models

    ours = dataclasses.asdict(_ModelInfo.from_model_cls(getattr(models, FAMILIES[family][2])))
    stock = dataclasses.asdict(_ModelInfo.from_model_cls(_stock_class(family)))
    assert ours.pop("architecture") == FAMILIES[family][2]
    assert stock.pop("architecture") == FAMILIES[family][0]
    assert ours == stock


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stock_instance_unless_requested(family, model_dirs, vllm_distributed, tmp_path):
    from monodecode.vllm_plugin.models import MonoDecodeMixin

    stock_cls = _stock_class(family)
    off = load_model(engine_config(model_dirs[family]))
    assert type(off) is stock_cls
    assert not hasattr(off, "mono")

    # "enabled": false wins over the decode_backend alias
    off2 = load_model(
        engine_config(
            model_dirs[family],
            additional_config={"decode_backend": "latency_specialized", "monodecode": {"enabled": False}},
        )
    )
    assert type(off2) is stock_cls

    on = load_model(engine_config(model_dirs[family], additional_config={"monodecode": mono_options(tmp_path)}))
    assert isinstance(on, MonoDecodeMixin) and isinstance(on, stock_cls)
    assert on.mono.state == "mono"
    # nothing of vLLM's replaced or wrapped: same modules, same parameters (names, shapes, dtypes),
    # except where vLLM's CPU kernels pack linear weights: there mono decode keeps the loaded matrix
    # (vLLM's _cpu_skip_gemm_dispatch) where stock leaves an empty tensor beside its packed copy
    modules_on, tensors_on = _tree(on)
    modules_off, tensors_off = _tree(off)
    assert modules_on == modules_off
    packed = {n for n, (shape, _) in tensors_off.items() if shape == (0,)}
    if packed:
        print(f"vLLM's CPU backend packed {len(packed)} stock linear weights; mono decode keeps them loaded")
        assert all(
            n.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")) for n in packed
        )
    assert {n: t for n, t in tensors_on.items() if n not in packed} == {
        n: t for n, t in tensors_off.items() if n not in packed
    }
    for name, p in off.state_dict().items():
        if name not in packed:
            assert bool((on.state_dict()[name] == p).all()), name


def test_pooling_adapter_of_our_class_stays_stock(model_dirs, vllm_distributed, tmp_path):
    """vLLM derives pooling models from the registered class (``--convert embed``): the adapter
    subclasses ours, so it must still build and run exactly stock when mono decode is off, and
    an explicit opt-in is refused (a pooling model has no decode steps)."""
    from monodecode.errors import RefusalError
    from monodecode.vllm_plugin.models import MonoLlamaForCausalLM

    model = load_model(engine_config(model_dirs["llama"], runner="pooling", convert="embed"))
    assert isinstance(model, MonoLlamaForCausalLM) and type(model) is not MonoLlamaForCausalLM
    assert model.mono is None
    assert hasattr(model, "pooler")

    with pytest.raises(RefusalError) as err:
        load_model(
            engine_config(
                model_dirs["llama"],
                runner="pooling",
                convert="embed",
                additional_config={"monodecode": mono_options(tmp_path)},
            )
        )
    assert "runner_type" in err.value.codes
