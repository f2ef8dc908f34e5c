"""Decoder weights for the reference decode and the kernel backends.

A projection is a ``Linear``: a BF16 weight, or an FP8 e4m3 weight (OCP ``float8_e4m3fn``, or the
FNUZ variant ``float8_e4m3fnuz`` that gfx942 uses) with one fp32 scale per output channel, so
``W[o, i] ~= q[o, i] * scale[o]``. Checkpoints are read from Hugging Face safetensors (BF16/FP16/
FP32 tensors); the FP8 variants quantize them per output channel at load time. Norm weights are
kept as the raw checkpoint tensors: Gemma's ``(1 + w)`` is applied by the math, not baked in.
Only the decoder-layer projections are quantized; the embedding and LM head stay BF16 (the final
norm, LM head and sampling stay in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from monodecode.errors import ModelConfigError
from monodecode.jsonio import read_json_file
from monodecode.model.dims import ModelDims, load_dims

WEIGHT_DTYPES = ("bf16", "fp8", "fp8_fnuz")

# each of WEIGHT_DTYPES as torch stores it
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_fnuz": torch.float8_e4m3fnuz}
_KIND_OF_DTYPE = {dtype: kind for kind, dtype in TORCH_DTYPES.items()}


class Linear:
    """A bias-free projection ``y = x @ W.T`` with a BF16 or per-output-channel-scaled FP8 weight."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None):
        if weight.dim() != 2:
            raise ValueError(f"Linear weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        kind = _KIND_OF_DTYPE.get(weight.dtype)
        if kind is None:
            raise ValueError(f"Linear weight dtype {weight.dtype} is not bf16, float8_e4m3fn or float8_e4m3fnuz")
        if kind == "bf16":
            if scale is not None:
                raise ValueError("a bf16 Linear takes no scale")
        else:
            if scale is None or scale.shape != (weight.shape[0],) or scale.dtype != torch.float32:
                raise ValueError("an FP8 Linear needs an fp32 scale of shape [out]")
        self.weight = weight
        self.scale = scale
        self.kind = kind

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def dequant(self) -> torch.Tensor:
        """The effective weight as fp32 ``[out, in]``."""
        w = self.weight.float()
        return w if self.scale is None else w * self.scale[:, None]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x @ W.T`` accumulated in fp32, rounded once to ``out_dtype`` (default ``x.dtype``)."""
        out_dtype = out_dtype or x.dtype
        if self.kind == "bf16" and x.dtype == torch.bfloat16 and out_dtype == torch.bfloat16:
            # bf16 GEMM: fp32 accumulation inside, one rounding of the output (what HF / vLLM run).
            return torch.nn.functional.linear(x, self.weight)
        y = torch.nn.functional.linear(x.float(), self.weight.float())
        if self.scale is not None:
            # FP8: accumulate x * q in fp32, then apply the per-output-channel scale (what a kernel does).
            y = y * self.scale
        return y.to(out_dtype)

    def to(self, device) -> Linear:
        return Linear(self.weight.to(device), None if self.scale is None else self.scale.to(device))

    def __repr__(self) -> str:
        return f"Linear({self.kind}, out={self.out_features}, in={self.in_features})"


def quantize_fp8(w: torch.Tensor, fnuz: bool = False) -> Linear:
    """Quantize ``w[out, in]`` to FP8 e4m3 with a per-output-channel absmax scale."""
    dtype = torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn
    fmax = torch.finfo(dtype).max  # 448 (OCP) or 240 (FNUZ)
    w32 = w.float()
    absmax = w32.abs().amax(dim=1)
    # An all-zero row gets scale 1 (any scale reproduces it exactly).
    scale = torch.where(absmax > 0, absmax / fmax, torch.ones_like(absmax))
    q = (w32 / scale[:, None]).clamp(-fmax, fmax).to(dtype)
    return Linear(q, scale.to(torch.float32).contiguous())


def _make_linear(w: torch.Tensor, weight_dtype: str) -> Linear:
    if weight_dtype == "bf16":
        return Linear(w.to(torch.bfloat16).contiguous())
    return quantize_fp8(w, fnuz=weight_dtype == "fp8_fnuz")


@dataclass
class LayerWeights:
    """One decoder layer. Norm weights are raw checkpoint tensors (bf16)."""

    attn_norm: torch.Tensor
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Linear
    attn_post_norm: torch.Tensor | None  # Gemma only
    mlp_norm: torch.Tensor  # pre-MLP norm (Llama/Qwen3: post_attention_layernorm; Gemma: pre_feedforward_layernorm)
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear
    mlp_post_norm: torch.Tensor | None  # Gemma only


@dataclass
class ModelWeights:
    dims: ModelDims
    embed: torch.Tensor  # [vocab, hidden] bf16
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear

    @property
    def weight_dtype(self) -> str:
        return self.layers[0].q_proj.kind if self.layers else "bf16"

    @property
    def device(self) -> torch.device:
        return self.embed.device


def _check_weight_dtype(weight_dtype: str) -> None:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ModelConfigError(f"weight dtype {weight_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")


# ---------------------------------------------------------------------------------------------
# Loading Hugging Face safetensors checkpoints


INDEX = "model.safetensors.index.json"


def _shard_path(model_dir: Path, name: object, index: Path) -> Path:
    """A shard the index names: a relative path that stays inside the model directory."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise ModelConfigError(f"model weights: {index} names a shard {str(name)[:80]!r} that is not a file name")
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise ModelConfigError(f"model weights: {index} names the shard {name[:80]!r}, outside {model_dir}")
    return model_dir / rel


def _safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX
    try:
        doc = read_json_file(index, f"model weights: {index}", ModelConfigError)
    except FileNotFoundError:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelConfigError(f"model weights: no *.safetensors files in {model_dir}") from None
        return files
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelConfigError(f"model weights: {index} is not a valid safetensors index (no 'weight_map' object)")
    shards = [_shard_path(model_dir, name, index) for name in weight_map.values()]
    return sorted(set(shards))


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensor_files(model_dir):
        if not path.exists():
            raise ModelConfigError(f"model weights: {path} is listed in the index but missing")
        if not path.is_file():  # a FIFO would block the read forever, a directory fails obscurely
            raise ModelConfigError(f"model weights: {path} is not a regular file")
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError) as e:
            raise ModelConfigError(f"model weights: cannot read {path}: {str(e).splitlines()[0]}") from None
    return tensors


# Prefixes of the decoder in HF checkpoints: plain causal LMs, and Gemma 3 multimodal wrappers.
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


def _decoder_prefix(names) -> str:
    for prefix in _PREFIXES:
        if f"{prefix}embed_tokens.weight" in names:
            return prefix
    raise ModelConfigError("model weights: no embed_tokens.weight tensor (expected e.g. 'model.embed_tokens.weight')")


def load_weights(
    model_dir: str | Path,
    dims: ModelDims | None = None,
    weight_dtype: str = "bf16",
    device: str | torch.device = "cpu",
) -> ModelWeights:
    """Load an HF safetensors checkpoint; ``fp8``/``fp8_fnuz`` quantize the layer projections."""
    _check_weight_dtype(weight_dtype)
    model_dir = Path(model_dir)
    dims = dims or load_dims(model_dir)
    raw = _read_tensors(model_dir)
    prefix = _decoder_prefix(raw)

    def get(name: str, shape: tuple[int, ...], full: str | None = None) -> torch.Tensor:
        key = full or prefix + name
        t = raw.get(key)
        if t is None:
            raise ModelConfigError(f"model weights: missing tensor '{key}'")
        if tuple(t.shape) != shape:
            raise ModelConfigError(f"model weights: tensor '{key}' has shape {tuple(t.shape)}, config implies {shape}")
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ModelConfigError(
                f"model weights: tensor '{key}' has dtype {t.dtype}; give a bf16/fp16/fp32 checkpoint"
            )
        return t

    d = dims
    h, q, kv, i = d.hidden_size, d.q_size, d.kv_size, d.intermediate_size

    def lin(name: str, shape: tuple[int, int]) -> Linear:
        return _make_linear(get(name, shape), weight_dtype).to(device)

    def norm(name: str, size: int) -> torch.Tensor:
        return get(name, (size,)).to(device=device, dtype=torch.bfloat16)

    layers = []
    for l in range(d.num_layers):
        p = f"layers.{l}."
        if d.post_norms:
            mlp_norm_name = p + "pre_feedforward_layernorm.weight"
        else:
            mlp_norm_name = p + "post_attention_layernorm.weight"
        layers.append(
            LayerWeights(
                attn_norm=norm(p + "input_layernorm.weight", h),
                q_proj=lin(p + "self_attn.q_proj.weight", (q, h)),
                k_proj=lin(p + "self_attn.k_proj.weight", (kv, h)),
                v_proj=lin(p + "self_attn.v_proj.weight", (kv, h)),
                q_norm=norm(p + "self_attn.q_norm.weight", d.head_dim) if d.qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight", d.head_dim) if d.qk_norm else None,
                o_proj=lin(p + "self_attn.o_proj.weight", (h, q)),
                attn_post_norm=norm(p + "post_attention_layernorm.weight", h) if d.post_norms else None,
                mlp_norm=norm(mlp_norm_name, h),
                gate_proj=lin(p + "mlp.gate_proj.weight", (i, h)),
                up_proj=lin(p + "mlp.up_proj.weight", (i, h)),
                down_proj=lin(p + "mlp.down_proj.weight", (h, i)),
                mlp_post_norm=norm(p + "post_feedforward_layernorm.weight", h) if d.post_norms else None,
            )
        )
    embed = get("embed_tokens.weight", (d.vocab_size, h)).to(device=device, dtype=torch.bfloat16).contiguous()
    if d.tie_word_embeddings:
        lm_head = Linear(embed)
    else:
        # Plain causal LMs keep lm_head at the top level; Gemma 3 multimodal wrappers nest it.
        head_key = next((k for k in ("lm_head.weight", "language_model.lm_head.weight") if k in raw), "lm_head.weight")
        head = get("", (d.vocab_size, h), full=head_key)
        lm_head = Linear(head.to(device=device, dtype=torch.bfloat16).contiguous())
    return ModelWeights(dims=d, embed=embed, layers=layers, final_norm=norm("norm.weight", h), lm_head=lm_head)


# ---------------------------------------------------------------------------------------------
# Random weights (benchmarks, tests, the tiny model)


def random_weights(
    dims: ModelDims,
    seed: int,
    weight_dtype: str = "bf16",
    device: str | torch.device = "cpu",
    num_layers: int | None = None,
) -> ModelWeights:
    """Seeded random weights with HF-like scales (projections ~ N(0, 1/in)).

    ``num_layers`` builds only the first N layers (benchmarks of big dims that time one layer).
    Generated on ``device`` with a generator seeded by ``seed`` (fast for big dims on a GPU), so the
    values are reproducible per device type, not across device types.
    """
    _check_weight_dtype(weight_dtype)
    d = dims
    n = d.num_layers if num_layers is None else num_layers
    g = torch.Generator(device=device).manual_seed(seed)
    h, q, kv, i = d.hidden_size, d.q_size, d.kv_size, d.intermediate_size

    def mat(out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=g, device=device) * (gain / inp**0.5)

    def lin(out: int, inp: int, gain: float = 1.0) -> Linear:
        return _make_linear(mat(out, inp, gain), weight_dtype)

    def norm(size: int) -> torch.Tensor:
        # Around the identity of each norm style: w ~ 0 for (1 + w), w ~ 1 otherwise.
        base = 0.0 if d.norm_one_plus else 1.0
        return (base + 0.1 * torch.randn(size, generator=g, device=device)).to(torch.bfloat16)

    layers = [
        LayerWeights(
            attn_norm=norm(h),
            q_proj=lin(q, h),
            k_proj=lin(kv, h),
            v_proj=lin(kv, h),
            q_norm=norm(d.head_dim) if d.qk_norm else None,
            k_norm=norm(d.head_dim) if d.qk_norm else None,
            o_proj=lin(h, q),
            attn_post_norm=norm(h) if d.post_norms else None,
            mlp_norm=norm(h),
            gate_proj=lin(i, h),
            up_proj=lin(i, h),
            down_proj=lin(h, i),
            mlp_post_norm=norm(h) if d.post_norms else None,
        )
        for _ in range(n)
    ]
    embed = (torch.randn(d.vocab_size, h, generator=g, device=device) * 0.02).to(torch.bfloat16)
    lm_head = Linear(embed) if d.tie_word_embeddings else Linear(mat(d.vocab_size, h).to(torch.bfloat16))
    return ModelWeights(dims=d, embed=embed, layers=layers, final_norm=norm(h), lm_head=lm_head)
