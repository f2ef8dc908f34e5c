"""Model dimensions from a Hugging Face ``config.json``: the dense-decoder compute contract.

Everything the kernels, the build keys and the reference decode need is derived here, once,
from the families the kernels target: Llama 3 (``llama``), Qwen3 dense (``qwen3``) and Gemma 3
text (``gemma3_text``, or ``gemma3`` with a ``text_config``). Both the legacy field spellings
(``rope_theta`` / ``rope_scaling`` / ``sliding_window_pattern``) and transformers 5's
(``rope_parameters`` / ``layer_types``) are read. Any problem is a ``ModelConfigError`` whose
message names the field.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from monodecode.errors import ModelConfigError
from monodecode.jsonio import parse_json, read_regular_file

FAMILIES = ("llama", "qwen3", "gemma3")

# model_type -> family; gemma3 (multimodal wrapper) is unwrapped to its text_config first.
_MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}

FULL, SLIDING = "full", "sliding"


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one attention kind (rotate-half / NeoX layout, as in HF)."""

    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position: int = 0

    def inv_freq(self, head_dim: int) -> list[float]:
        """Per-pair inverse frequencies after scaling (what HF's rope init functions return)."""
        base = [1.0 / (self.theta ** (2 * i / head_dim)) for i in range(head_dim // 2)]
        if self.kind == "linear":
            return [f / self.factor for f in base]
        if self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            out = []
            for f in base:
                wavelen = 2 * math.pi / f
                if wavelen < high_wavelen:
                    out.append(f)
                elif wavelen > low_wavelen:
                    out.append(f / self.factor)
                else:
                    smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                        self.high_freq_factor - self.low_freq_factor
                    )
                    out.append((1 - smooth) * f / self.factor + smooth * f)
            return out
        return base


@dataclass(frozen=True)
class ModelDims:
    """Every dimension and numeric convention of a dense decoder that a kernel depends on."""

    family: str  # llama | qwen3 | gemma3
    architecture: str  # e.g. LlamaForCausalLM
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    activation: str  # silu | gelu_tanh
    norm_one_plus: bool  # Gemma: RMSNorm multiplies by (1 + w)
    post_norms: bool  # Gemma: extra norms after attention and after the MLP
    qk_norm: bool  # Qwen3 / Gemma 3: RMSNorm over each q and k head
    attn_scale: float  # softmax scale applied to q.k
    embed_scale: float  # Gemma multiplies embeddings by sqrt(hidden); 1.0 otherwise
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_full: RopeSpec
    rope_sliding: RopeSpec | None
    sliding_window: int | None
    layer_types: tuple[str, ...] = field(default=())  # FULL | SLIDING per layer
    final_logit_softcapping: float | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def rope_for_layer(self, layer: int) -> RopeSpec:
        if self.is_sliding(layer) and self.rope_sliding is not None:
            return self.rope_sliding
        return self.rope_full

    def window_for_layer(self, layer: int) -> int | None:
        """Number of most recent positions a query may attend to, or None for full attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        """Stable sha256 over every field: part of every build key."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def weight_bytes_per_layer(self, bytes_per_weight: float = 2.0) -> float:
        """Bytes of the projection weights one decoder layer streams per decode step."""
        h, i = self.hidden_size, self.intermediate_size
        params = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i
        return params * bytes_per_weight


_INT_LIMIT = 1 << 31  # sizes index int32 device arrays


def _req(cfg: Mapping[str, Any], name: str, kind: type, *, positive: bool = True, where: str = "") -> Any:
    """Field ``name`` of ``cfg``; ``where`` prefixes the name in errors for nested objects."""
    value = cfg.get(name)
    name = f"{where}.{name}" if where else name
    if value is None:
        raise ModelConfigError(f"model config: missing required field '{name}'")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ModelConfigError(
            f"model config: field '{name}' must be {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    if kind is float and not math.isfinite(value):  # NaN <= 0 is False: check finiteness first
        raise ModelConfigError(f"model config: field '{name}' must be a finite number, got {value!r}")
    if kind is int and not -_INT_LIMIT < value < _INT_LIMIT:
        raise ModelConfigError(f"model config: field '{name}' is out of range, got {value!r}")
    if positive and value <= 0:
        raise ModelConfigError(f"model config: field '{name}' must be > 0, got {value!r}")
    return value


def _opt(cfg: Mapping[str, Any], name: str, kind: type, default: Any, *, positive: bool = True) -> Any:
    if cfg.get(name) is None:
        return default
    return _req(cfg, name, kind, positive=positive)


def _rope_from(params: Any, where: str) -> RopeSpec:
    if not isinstance(params, Mapping):
        raise ModelConfigError(f"model config: field '{where}' must be an object, got {params!r}")
    theta = _req(params, "rope_theta", float, where=where)
    partial = params.get("partial_rotary_factor")
    if partial is not None and partial != 1.0:
        raise ModelConfigError(
            f"model config: field '{where}.partial_rotary_factor' is {partial!r}; only full-width RoPE (1.0) is supported"
        )
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=_req(params, "factor", float, where=where))
    if kind == "llama3":
        spec = RopeSpec(
            theta=theta,
            kind="llama3",
            factor=_req(params, "factor", float, where=where),
            low_freq_factor=_req(params, "low_freq_factor", float, where=where),
            high_freq_factor=_req(params, "high_freq_factor", float, where=where),
            original_max_position=_req(params, "original_max_position_embeddings", int, where=where),
        )
        if spec.high_freq_factor <= spec.low_freq_factor:
            raise ModelConfigError(
                f"model config: field '{where}.high_freq_factor' ({spec.high_freq_factor}) must exceed "
                f"low_freq_factor ({spec.low_freq_factor})"
            )
        return spec
    raise ModelConfigError(f"model config: field '{where}.rope_type' is '{kind}'; supported: default, linear, llama3")


def _legacy_rope(cfg: Mapping[str, Any], theta_field: str, default_theta: float, scaling: Any) -> dict:
    params: dict[str, Any] = {"rope_theta": _opt(cfg, theta_field, float, default_theta)}
    if scaling is not None:
        if not isinstance(scaling, Mapping):
            raise ModelConfigError(f"model config: field 'rope_scaling' must be an object, got {scaling!r}")
        params.update(scaling)
    return params


def _ropes(cfg: Mapping[str, Any], family: str) -> tuple[RopeSpec, RopeSpec | None]:
    params = cfg.get("rope_parameters")
    if family == "gemma3":
        if isinstance(params, Mapping) and "full_attention" in params:
            full = _rope_from(params["full_attention"], "rope_parameters.full_attention")
            sliding = _rope_from(
                params.get("sliding_attention", {"rope_theta": 10000.0}), "rope_parameters.sliding_attention"
            )
            return full, sliding
        if isinstance(params, Mapping):  # one flat rope_parameters object: it describes the global layers
            full = _rope_from(params, "rope_parameters")
        else:
            full = _rope_from(_legacy_rope(cfg, "rope_theta", 1_000_000.0, cfg.get("rope_scaling")), "rope_scaling")
        sliding = RopeSpec(theta=_opt(cfg, "rope_local_base_freq", float, 10000.0))
        return full, sliding
    if isinstance(params, Mapping):
        return _rope_from(params, "rope_parameters"), None
    if params is not None:
        raise ModelConfigError(f"model config: field 'rope_parameters' must be an object, got {params!r}")
    return _rope_from(_legacy_rope(cfg, "rope_theta", 10000.0, cfg.get("rope_scaling")), "rope_scaling"), None


def _layer_types(cfg: Mapping[str, Any], family: str, num_layers: int) -> tuple[str, ...]:
    raw = cfg.get("layer_types")
    if raw is not None:
        if not isinstance(raw, list) or len(raw) != num_layers:
            raise ModelConfigError(
                f"model config: field 'layer_types' must be a list of {num_layers} entries (num_hidden_layers)"
            )
        out = []
        for i, t in enumerate(raw):
            if t == "full_attention":
                out.append(FULL)
            elif t == "sliding_attention":
                out.append(SLIDING)
            else:
                raise ModelConfigError(
                    f"model config: field 'layer_types[{i}]' is {t!r}; expected full_attention or sliding_attention"
                )
        return tuple(out)
    if family == "gemma3":
        pattern = _opt(cfg, "sliding_window_pattern", int, 6)
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))
    return tuple(FULL for _ in range(num_layers))


def _unwrap(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """Gemma 3 multimodal checkpoints keep the decoder under ``text_config``."""
    if cfg.get("model_type") == "gemma3":
        text = cfg.get("text_config")
        if not isinstance(text, Mapping):
            raise ModelConfigError("model config: model_type 'gemma3' needs an object field 'text_config'")
        merged = dict(text)
        merged.setdefault("model_type", "gemma3_text")
        merged.setdefault("architectures", cfg.get("architectures"))
        return merged
    return cfg


def dims_from_hf_config(raw: Mapping[str, Any]) -> ModelDims:
    """Derive ``ModelDims`` from a parsed ``config.json``; raise ``ModelConfigError`` on any problem
    (and nothing else, whatever the input)."""
    try:
        return _dims_from_hf_config(raw)
    except ModelConfigError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError, RecursionError) as e:
        raise ModelConfigError(f"model config: unusable values ({type(e).__name__}: {e})") from None


def _dims_from_hf_config(raw: Mapping[str, Any]) -> ModelDims:
    if not isinstance(raw, Mapping):
        raise ModelConfigError("model config: config.json must hold a JSON object")
    cfg = _unwrap(raw)
    model_type = cfg.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ModelConfigError(
            f"model config: unsupported model_type {model_type!r}; supported: llama, qwen3, gemma3_text, gemma3"
        )
    family = _MODEL_TYPES[model_type]
    archs = cfg.get("architectures") or []
    architecture = (
        archs[0]
        if isinstance(archs, list) and archs
        else {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]
    )
    if any(str(a).endswith("MoeForCausalLM") for a in (archs if isinstance(archs, list) else [])):
        raise ModelConfigError(
            f"model config: architecture {architecture!r} is a mixture of experts; only dense decoders are supported"
        )

    hidden = _req(cfg, "hidden_size", int)
    layers = _req(cfg, "num_hidden_layers", int)
    heads = _req(cfg, "num_attention_heads", int)
    kv_heads = _opt(cfg, "num_key_value_heads", int, heads)
    if heads % kv_heads:
        raise ModelConfigError(
            f"model config: field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})"
        )
    if cfg.get("head_dim") is None and hidden % heads:
        raise ModelConfigError(
            f"model config: field 'hidden_size' ({hidden}) is not a multiple of num_attention_heads ({heads}) and no head_dim is given"
        )
    head_dim = _opt(cfg, "head_dim", int, hidden // heads)
    if head_dim % 2:
        raise ModelConfigError(f"model config: field 'head_dim' must be even for RoPE, got {head_dim}")
    intermediate = _req(cfg, "intermediate_size", int)
    vocab = _req(cfg, "vocab_size", int)
    eps = _opt(cfg, "rms_norm_eps", float, 1e-6)

    act_field = "hidden_activation" if family == "gemma3" and cfg.get("hidden_activation") else "hidden_act"
    act_name = cfg.get(act_field, "gelu_pytorch_tanh" if family == "gemma3" else "silu")
    if act_name not in _ACTIVATIONS:
        raise ModelConfigError(
            f"model config: field '{act_field}' is {act_name!r}; supported: {', '.join(sorted(_ACTIVATIONS))}"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ModelConfigError(f"model config: field '{flag}' is true; the kernels have no projection biases")
    if family == "gemma3" and cfg.get("attn_logit_softcapping") is not None:
        raise ModelConfigError(
            "model config: field 'attn_logit_softcapping' is set; attention softcapping is not supported"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError(
            "model config: field 'use_bidirectional_attention' is true; only causal decoders are supported"
        )

    layer_types = _layer_types(cfg, family, layers)
    if family == "qwen3" and not cfg.get("use_sliding_window"):
        layer_types = tuple(FULL for _ in range(layers))
    window = None
    if SLIDING in layer_types:
        window = _req(cfg, "sliding_window", int)

    rope_full, rope_sliding = _ropes(cfg, family)
    if family == "gemma3":
        scale = _opt(cfg, "query_pre_attn_scalar", float, float(head_dim)) ** -0.5
    else:
        scale = head_dim**-0.5
    softcap = cfg.get("final_logit_softcapping")
    if softcap is not None:
        softcap = _req(cfg, "final_logit_softcapping", float)

    return ModelDims(
        family=family,
        architecture=str(architecture),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        rms_norm_eps=eps,
        activation=_ACTIVATIONS[act_name],
        norm_one_plus=family == "gemma3",
        post_norms=family == "gemma3",
        qk_norm=family in ("qwen3", "gemma3"),
        attn_scale=scale,
        embed_scale=math.sqrt(hidden) if family == "gemma3" else 1.0,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
        max_position_embeddings=_opt(cfg, "max_position_embeddings", int, 8192),
        rope_full=rope_full,
        rope_sliding=rope_sliding,
        sliding_window=window,
        layer_types=layer_types,
        final_logit_softcapping=softcap,
    )


def load_dims(model_dir: str | Path) -> ModelDims:
    """Read ``<model_dir>/config.json`` and derive its dims."""
    path = Path(model_dir) / "config.json"
    where = f"model config: {path}"
    try:
        text = read_regular_file(path, where, ModelConfigError)
    except FileNotFoundError:
        raise ModelConfigError(f"model config: {path} not found") from None
    return dims_from_hf_config(parse_json(text, where, ModelConfigError))
