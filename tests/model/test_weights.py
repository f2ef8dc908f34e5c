"""Weights: the Linear contract, FP8 quantization, checkpoint loading and its errors, random weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from monodecode.errors import ModelConfigError
from monodecode.model import Linear, dims_from_hf_config, load_weights, quantize_fp8, random_weights
from monodecode.model.profiles import TINY_CONFIG
from monodecode.model.tiny import tiny_state_dict

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.mark.parametrize("fnuz", [False, True])
def test_quantize_fp8_per_channel(fnuz):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different scale
    w[5] = 0.0
    lin = quantize_fp8(w, fnuz=fnuz)
    fmax = 240.0 if fnuz else 448.0
    assert lin.kind == ("fp8_fnuz" if fnuz else "fp8")
    assert lin.weight.dtype == (torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
    assert lin.scale.dtype == torch.float32 and lin.scale.shape == (64,)
    # Each row's absmax maps to the format's max; the all-zero row gets scale 1 and stays zero.
    assert torch.allclose(lin.weight.float().abs().amax(1)[torch.arange(64) != 5], torch.tensor(fmax))
    assert lin.scale[5] == 1.0 and lin.dequant()[5].eq(0).all()
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, plus a subnormal step.
    err = (lin.dequant() - w).abs()
    bound = w.abs() * 2.0**-4 + lin.scale[:, None] * 2.0**-9
    assert (err <= bound).all()
    assert err.max() > 0  # really quantized


def test_linear_math():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 48, generator=g)
    x = torch.randn(3, 48, generator=g)
    fp8 = quantize_fp8(w)
    expected = x @ fp8.dequant().T
    assert torch.allclose(fp8(x), expected, atol=1e-5)
    bf = Linear(w.to(torch.bfloat16))
    exact = x.to(torch.bfloat16).float() @ bf.dequant().T
    y = bf(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), exact, rtol=2**-8, atol=1e-6)  # one bf16 rounding of an fp32 sum
    assert bf(x.to(torch.bfloat16), out_dtype=torch.float32).dtype == torch.float32
    assert (bf.out_features, bf.in_features) == (32, 48)


@pytest.mark.parametrize(
    "args,needle",
    [
        ((torch.zeros(4, dtype=torch.bfloat16),), "2-D"),
        ((torch.zeros(4, 4),), "dtype torch.float32"),
        ((torch.zeros(4, 4, dtype=torch.bfloat16), torch.ones(4)), "takes no scale"),
        ((torch.zeros(4, 4).to(torch.float8_e4m3fn),), "fp32 scale"),
        ((torch.zeros(4, 4).to(torch.float8_e4m3fn), torch.ones(3)), "fp32 scale"),
    ],
)
def test_linear_rejects_bad_tensors(args, needle):
    with pytest.raises(ValueError, match=needle):
        Linear(*args)


def _write_tiny(path, sd=None, config=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or TINY_CONFIG))
    save_file(sd if sd is not None else tiny_state_dict(), str(path / "model.safetensors"))
    return path


def test_load_weights_maps_hf_names(tmp_path):
    sd = tiny_state_dict()
    w = load_weights(_write_tiny(tmp_path / "m", sd))
    assert w.dims.family == "gemma3" and len(w.layers) == 4 and w.weight_dtype == "bf16"
    layer = w.layers[2]
    assert torch.equal(layer.q_proj.weight, sd["model.layers.2.self_attn.q_proj.weight"])
    assert torch.equal(layer.attn_post_norm, sd["model.layers.2.post_attention_layernorm.weight"])
    assert torch.equal(layer.mlp_norm, sd["model.layers.2.pre_feedforward_layernorm.weight"])
    assert torch.equal(layer.mlp_post_norm, sd["model.layers.2.post_feedforward_layernorm.weight"])
    assert torch.equal(w.final_norm, sd["model.norm.weight"])
    assert w.lm_head.weight is w.embed  # tied
    fp8 = load_weights(tmp_path / "m", weight_dtype="fp8_fnuz")
    assert fp8.weight_dtype == "fp8_fnuz" and fp8.lm_head.kind == "bf16"


def test_load_weights_sharded_and_multimodal_prefix(tmp_path):
    sd = tiny_state_dict()
    names = sorted(sd)
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(d / fname))
    index = {"weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    a = load_weights(d)
    mm = _write_tiny(tmp_path / "mm", {k.replace("model.", "model.language_model.", 1): v for k, v in sd.items()})
    b = load_weights(mm)
    assert torch.equal(a.embed, b.embed) and torch.equal(a.layers[3].down_proj.weight, b.layers[3].down_proj.weight)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelConfigError, match="listed in the index but missing"):
        load_weights(d)


def test_load_weights_untied_head(tmp_path):
    cfg = dict(TINY_CONFIG, tie_word_embeddings=False)
    sd = tiny_state_dict()
    sd["lm_head.weight"] = torch.randn(512, 256).to(torch.bfloat16)
    w = load_weights(_write_tiny(tmp_path, sd, cfg))
    assert torch.equal(w.lm_head.weight, sd["lm_head.weight"]) and w.lm_head.weight is not w.embed


def _mutated(**changes):
    sd = tiny_state_dict()
    for k, v in changes.items():
        if v is None:
            del sd[k.replace("__", ".")]
        else:
            sd[k.replace("__", ".")] = v
    return sd


@pytest.mark.parametrize(
    "sd,needle",
    [
        (
            _mutated(**{"model__layers__1__self_attn__k_proj__weight": None}),
            "missing tensor 'model.layers.1.self_attn.k_proj.weight'",
        ),
        (
            _mutated(**{"model__layers__0__mlp__up_proj__weight": torch.zeros(768, 255, dtype=torch.bfloat16)}),
            "'model.layers.0.mlp.up_proj.weight' has shape (768, 255), config implies (768, 256)",
        ),
        (_mutated(**{"model__embed_tokens__weight": None}), "no embed_tokens.weight"),
        (
            _mutated(**{"model__layers__3__mlp__down_proj__weight": torch.zeros(256, 768).to(torch.float8_e4m3fn)}),
            "dtype torch.float8_e4m3fn; give a bf16/fp16/fp32 checkpoint",
        ),
    ],
)
def test_load_weights_errors_name_the_tensor(tmp_path, sd, needle):
    with pytest.raises(ModelConfigError) as e:
        load_weights(_write_tiny(tmp_path, sd))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_load_weights_file_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    with pytest.raises(ModelConfigError, match="no \\*.safetensors files"):
        load_weights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelConfigError, match="cannot read .*model.safetensors"):
        load_weights(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ModelConfigError, match="not a valid safetensors index"):
        load_weights(tmp_path)
    with pytest.raises(ModelConfigError, match="weight dtype 'int4'"):
        load_weights(tmp_path, weight_dtype="int4")


def test_random_weights():
    dims = dims_from_hf_config(TINY_CONFIG)
    a, b = random_weights(dims, seed=1), random_weights(dims, seed=1)
    c = random_weights(dims, seed=2, weight_dtype="fp8", num_layers=2)
    assert torch.equal(a.layers[3].gate_proj.weight, b.layers[3].gate_proj.weight)
    assert not torch.equal(a.embed, c.embed)
    assert len(c.layers) == 2 and c.weight_dtype == "fp8" and c.layers[1].down_proj.scale.shape == (256,)
    assert a.layers[0].q_proj.weight.shape == (dims.q_size, dims.hidden_size)
    assert a.lm_head.weight is a.embed


@pytest.mark.parametrize(
    "index, needle",
    [
        (b'{"weight_map": {"a": "../../../../etc/passwd"}}', "names the shard '../../../../etc/passwd', outside"),
        (b'{"weight_map": {"a": "/etc/passwd"}}', "names the shard '/etc/passwd', outside"),
        (b'{"weight_map": {"a": 7}}', "names a shard '7' that is not a file name"),
        (b'{"weight_map": ["x"]}', "is not a valid safetensors index (no 'weight_map' object)"),
        (b"[1]", "is not a valid safetensors index"),
        (b"\xff\xfe{}", "is not UTF-8 text"),
        (b"[" * 100_000, "is nested too deeply"),
    ],
)
def test_a_hostile_index_is_one_line_and_stays_in_the_model_dir(tmp_path, index, needle):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    (tmp_path / "model.safetensors.index.json").write_bytes(index)
    with pytest.raises(ModelConfigError) as e:
        load_weights(tmp_path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_fifo_index_or_shard_never_blocks(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    with pytest.raises(ModelConfigError, match="is not a regular file"):
        load_weights(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ModelConfigError, match="model.safetensors is not a regular file"):
        load_weights(tmp_path)
