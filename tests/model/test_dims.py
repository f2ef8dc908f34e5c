"""Model dims from HF configs: every family, both field spellings, and every bad-input path."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from monodecode.errors import ModelConfigError
from monodecode.model.dims import dims_from_hf_config, load_dims
from monodecode.model.profiles import PROFILES, TINY_CONFIG, profile_config, profile_dims

transformers = pytest.importorskip("transformers")


# Configs as the hub writes them with transformers < 5 (legacy spellings).
LEGACY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}
LEGACY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 36,
    "tie_word_embeddings": False,
}
LEGACY_GEMMA3 = {  # Gemma 3 27B's text decoder, as in the multimodal checkpoint's text_config
    "model_type": "gemma3_text",
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "vocab_size": 262208,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 168,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "max_position_embeddings": 131072,
}


def test_every_profile_parses():
    for name in PROFILES:
        d = profile_dims(name)
        assert d.num_layers == len(d.layer_types)
        assert d.q_size == d.num_heads * d.head_dim and d.gqa_group * d.num_kv_heads == d.num_heads


def test_llama_legacy_spelling():
    d = dims_from_hf_config(LEGACY_LLAMA)
    assert (d.family, d.architecture, d.head_dim, d.num_kv_heads) == ("llama", "LlamaForCausalLM", 64, 8)
    assert d.activation == "silu" and not d.norm_one_plus and not d.post_norms and not d.qk_norm
    assert d.rope_full.kind == "llama3" and d.rope_full.factor == 32.0 and d.rope_full.original_max_position == 8192
    assert d.rope_sliding is None and d.sliding_window is None and set(d.layer_types) == {"full"}
    assert d.attn_scale == pytest.approx(64**-0.5) and d.embed_scale == 1.0 and d.tie_word_embeddings
    # The transformers-5 spelling of the same model gives the same dims.
    assert profile_dims("llama3-1b") == d


def test_qwen3_legacy_spelling():
    d = dims_from_hf_config(LEGACY_QWEN3)
    assert d.family == "qwen3" and d.qk_norm and not d.norm_one_plus
    assert d.rope_full.theta == 1e6 and d.rope_full.kind == "default"
    assert set(d.layer_types) == {"full"} and d.sliding_window is None
    assert profile_dims("qwen3-8b") == d


def test_gemma3_legacy_spelling_and_pattern():
    d = dims_from_hf_config(LEGACY_GEMMA3)
    assert d.family == "gemma3" and d.architecture == "Gemma3ForCausalLM"
    assert d.norm_one_plus and d.post_norms and d.qk_norm and d.activation == "gelu_tanh"
    assert d.layer_types[:6] == ("sliding",) * 5 + ("full",) and d.layer_types.count("full") == 10
    assert d.window_for_layer(0) == 1024 and d.window_for_layer(5) is None
    assert d.rope_for_layer(0).theta == 10000.0 and d.rope_for_layer(5).kind == "linear"
    assert d.attn_scale == pytest.approx(168**-0.5) and d.embed_scale == pytest.approx(math.sqrt(5376))
    assert d.tie_word_embeddings
    assert profile_dims("gemma3-27b") == d


def test_gemma3_multimodal_wrapper_unwraps_text_config():
    cfg = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": dict(LEGACY_GEMMA3),
        "vision_config": {"hidden_size": 1152},
    }
    d = dims_from_hf_config(cfg)
    assert d.family == "gemma3" and d.hidden_size == 5376
    with pytest.raises(ModelConfigError, match="text_config"):
        dims_from_hf_config({"model_type": "gemma3"})


def test_gemma3_flat_rope_parameters_describe_global_layers():
    cfg = dict(LEGACY_GEMMA3, rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0})
    del cfg["rope_scaling"], cfg["rope_theta"]
    d = dims_from_hf_config(cfg)
    assert d.rope_full.kind == "linear" and d.rope_sliding.theta == 10000.0


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_dims_agree_with_hf_config_objects(family):
    """A config written by transformers' own config class (transformers-5 spelling) parses to its numbers."""
    kw = dict(
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=7,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=300,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(
            **kw,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        )
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**kw)
    else:
        cfg = transformers.Gemma3TextConfig(**kw, sliding_window=64, query_pre_attn_scalar=24)
    raw = json.loads(cfg.to_json_string())
    d = dims_from_hf_config(raw)
    assert (
        d.hidden_size,
        d.num_layers,
        d.num_heads,
        d.num_kv_heads,
        d.head_dim,
        d.intermediate_size,
        d.vocab_size,
    ) == (96, 7, 6, 2, 32, 160, 300)
    assert d.rms_norm_eps == cfg.rms_norm_eps and d.tie_word_embeddings == cfg.tie_word_embeddings
    hf_types = getattr(cfg, "layer_types", None) or ["full_attention"] * 7
    assert [t + "_attention" for t in d.layer_types] == list(hf_types)
    if family == "gemma3":
        assert d.sliding_window == 64 and d.attn_scale == pytest.approx(24**-0.5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_inverse_frequencies_match_hf_rope_init(family):
    """RopeSpec.inv_freq equals transformers' own rope init (llama3 scaling, linear scaling, default)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if family == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=256,
            num_attention_heads=2,
            head_dim=128,
            max_position_embeddings=65536,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
        d = dims_from_hf_config(json.loads(cfg.to_json_string()))
        hf, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
        ours = torch.tensor(d.rope_full.inv_freq(128), dtype=torch.float32)
        assert torch.allclose(ours, hf, rtol=1e-6, atol=0)
        assert ours[-1] < ours[0] / 1000  # scaling is really applied at low frequencies
    else:
        cfg = transformers.Gemma3TextConfig(
            hidden_size=256,
            num_attention_heads=2,
            head_dim=128,
            num_hidden_layers=6,
            num_key_value_heads=1,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
        d = dims_from_hf_config(json.loads(cfg.to_json_string()))
        hf, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, layer_type="full_attention")
        ours = torch.tensor(d.rope_for_layer(5).inv_freq(128), dtype=torch.float32)
        assert torch.allclose(ours, hf, rtol=1e-6, atol=0)
        local = torch.tensor(d.rope_for_layer(0).inv_freq(128), dtype=torch.float32)
        expected = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
        assert torch.allclose(local, expected, rtol=1e-6)


def test_digest_is_stable_and_sensitive():
    a, b = profile_dims("tiny"), dims_from_hf_config(copy.deepcopy(TINY_CONFIG))
    assert a.digest() == b.digest() and len(a.digest()) == 64
    assert dims_from_hf_config(dict(TINY_CONFIG, sliding_window=32)).digest() != a.digest()


def test_weight_bytes_per_layer():
    d = profile_dims("llama3-8b")
    params = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert d.weight_bytes_per_layer(2) == params * 2 and d.weight_bytes_per_layer(1) == params


def _drop(cfg, key):
    out = copy.deepcopy(cfg)
    del out[key]
    return out


# (config, substring the single error line must contain)
BAD = [
    ("not a dict", "JSON object"),
    (dict(LEGACY_LLAMA, model_type="mistral"), "model_type 'mistral'"),
    (dict(LEGACY_QWEN3, model_type="qwen3_moe"), "model_type 'qwen3_moe'"),
    (dict(LEGACY_LLAMA, architectures=["MixtralMoeForCausalLM"]), "mixture of experts"),
    (_drop(LEGACY_LLAMA, "hidden_size"), "'hidden_size'"),
    (_drop(LEGACY_LLAMA, "num_hidden_layers"), "'num_hidden_layers'"),
    (_drop(LEGACY_LLAMA, "num_attention_heads"), "'num_attention_heads'"),
    (_drop(LEGACY_LLAMA, "intermediate_size"), "'intermediate_size'"),
    (_drop(LEGACY_LLAMA, "vocab_size"), "'vocab_size'"),
    (dict(LEGACY_LLAMA, hidden_size="2048"), "'hidden_size' must be int"),
    (dict(LEGACY_LLAMA, hidden_size=2048.0), "'hidden_size' must be int"),
    (dict(LEGACY_LLAMA, num_hidden_layers=True), "'num_hidden_layers' must be int"),
    (dict(LEGACY_LLAMA, vocab_size=0), "'vocab_size' must be > 0"),
    (dict(LEGACY_LLAMA, rms_norm_eps=-1e-5), "'rms_norm_eps' must be > 0"),
    (dict(LEGACY_LLAMA, num_key_value_heads=5), "'num_key_value_heads' (5) must divide"),
    (dict(LEGACY_LLAMA, num_key_value_heads=0), "'num_key_value_heads' must be > 0"),
    (dict(LEGACY_LLAMA, hidden_size=2050), "'hidden_size' (2050) is not a multiple"),
    (dict(LEGACY_QWEN3, head_dim=127), "'head_dim' must be even"),
    (dict(LEGACY_LLAMA, hidden_act="relu"), "'hidden_act' is 'relu'"),
    (dict(LEGACY_GEMMA3, hidden_activation="gelu_new"), "'hidden_activation' is 'gelu_new'"),
    (dict(LEGACY_LLAMA, attention_bias=True), "'attention_bias'"),
    (dict(LEGACY_LLAMA, mlp_bias=True), "'mlp_bias'"),
    (dict(LEGACY_GEMMA3, attn_logit_softcapping=50.0), "'attn_logit_softcapping'"),
    (dict(LEGACY_GEMMA3, final_logit_softcapping="30"), "'final_logit_softcapping' must be float"),
    (dict(LEGACY_GEMMA3, use_bidirectional_attention=True), "'use_bidirectional_attention'"),
    (_drop(LEGACY_GEMMA3, "sliding_window"), "'sliding_window'"),
    (dict(LEGACY_GEMMA3, sliding_window_pattern=0), "'sliding_window_pattern' must be > 0"),
    (dict(LEGACY_GEMMA3, layer_types=["sliding_attention"] * 3), "'layer_types' must be a list of 62"),
    (dict(LEGACY_GEMMA3, layer_types=["full_attention"] * 61 + ["chunked_attention"]), "'layer_types[61]'"),
    (dict(LEGACY_GEMMA3, query_pre_attn_scalar="168"), "'query_pre_attn_scalar' must be float"),
    (dict(LEGACY_LLAMA, rope_theta="big"), "'rope_theta' must be float"),
    (dict(LEGACY_LLAMA, rope_scaling="llama3"), "'rope_scaling' must be an object"),
    (dict(LEGACY_LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'rope_scaling.rope_type' is 'yarn'"),
    (dict(LEGACY_LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0}), "'rope_scaling.low_freq_factor'"),
    (
        dict(LEGACY_LLAMA, rope_scaling={**LEGACY_LLAMA["rope_scaling"], "original_max_position_embeddings": "8k"}),
        "'rope_scaling.original_max_position_embeddings' must be int",
    ),
    (
        dict(LEGACY_LLAMA, rope_scaling={**LEGACY_LLAMA["rope_scaling"], "high_freq_factor": 1.0}),
        "'rope_scaling.high_freq_factor'",
    ),
    (dict(LEGACY_GEMMA3, rope_scaling={"rope_type": "linear"}), "'rope_scaling.factor'"),
    (dict(LEGACY_GEMMA3, rope_local_base_freq=-1.0), "'rope_local_base_freq' must be > 0"),
    (dict(_drop(LEGACY_LLAMA, "rope_scaling"), rope_parameters="default"), "'rope_parameters' must be an object"),
    (
        dict(_drop(LEGACY_LLAMA, "rope_scaling"), rope_parameters={"rope_type": "default"}),
        "'rope_parameters.rope_theta'",
    ),
    (
        dict(
            _drop(LEGACY_LLAMA, "rope_scaling"),
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        ),
        "'rope_parameters.partial_rotary_factor'",
    ),
    (
        dict(LEGACY_GEMMA3, rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6}}),
        "'rope_parameters.full_attention.factor'",
    ),
    (
        dict(LEGACY_GEMMA3, rope_parameters={"full_attention": {"rope_theta": 1e6}, "sliding_attention": 7}),
        "'rope_parameters.sliding_attention' must be an object",
    ),
]


@pytest.mark.parametrize("cfg,needle", BAD, ids=[n for _, n in BAD])
def test_bad_configs_give_one_clear_line(cfg, needle):
    with pytest.raises(ModelConfigError) as e:
        dims_from_hf_config(cfg)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.startswith("model config:")


def test_load_dims_file_errors(tmp_path):
    with pytest.raises(ModelConfigError, match="config.json not found"):
        load_dims(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"config.json is not valid JSON \(.* at line 1"):
        load_dims(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="JSON object"):
        load_dims(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    assert load_dims(tmp_path) == profile_dims("tiny")


def test_unknown_profile():
    with pytest.raises(ModelConfigError, match="unknown model profile 'nope'"):
        profile_config("nope")
