"""The runner's ``ModelWeights`` as views of the weights vLLM loaded (no copies, but of preshuffled ones).

vLLM fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` and holds this TP rank's
shard of each; the views below split the fused tensors back into the reference's projections.
Called after vLLM's ``process_weights_after_loading`` so FP8 weights are in their final form
(e4m3fn, or e4m3fnuz on gfx942) with per-tensor or per-output-channel scales. Anything else is a
``WeightLayoutError`` naming the tensor (a refusal reason, never a silent misread).

With ``VLLM_ROCM_USE_AITER=1`` some of AITER's GEMMs read their weight (16, 16)-preshuffled
(``monodecode.model.preshuffle``): vLLM's ``AiterPreshuffledPerTokenFp8ScaledMMLinearKernel`` and
``AiterHipbMMPerTokenFp8ScaledMMLinearKernel`` shuffle ``weight`` in place of the matrix (the latter
keeps it as a transposed view), and any kernel that sets ``aiter_bpreshuffled`` on the layer (the
block-scaled one on gfx1250) did the same. The kernels read row-major weights, so those layers
get a row-major copy undone from the shuffle (``WeightCopies`` counts its bytes; the plugin reports
them at start-up). Where the shuffled buffer is not one contiguous ``[N, K]`` matrix, or an AITER
kernel not listed here holds the weight, the layer is refused: its layout is not known.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from monodecode.errors import MonodecodeError
from monodecode.model.dims import ModelDims
from monodecode.model.preshuffle import PreshuffleError, unshuffled
from monodecode.model.weights import LayerWeights, Linear, ModelWeights

_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


# Linear methods whose ``layer.weight`` is the checkpoint's matrix (row-major or its transpose)
_PLAIN_METHODS = ("UnquantizedLinearMethod", "Fp8LinearMethod")
# vLLM's AITER scaled-mm kernels by what they leave in ``layer.weight``: the (16, 16) preshuffle
# of the [N, K] matrix (HipbMM: as its transposed view), or the matrix itself (its transpose;
# the block-scaled kernel shuffles only where it sets ``aiter_bpreshuffled``)
_AITER_PRESHUFFLING = ("AiterPreshuffledPerTokenFp8ScaledMMLinearKernel", "AiterHipbMMPerTokenFp8ScaledMMLinearKernel")
_AITER_PLAIN = ("AiterPerTokenFp8ScaledMMLinearKernel", "AiterFp8BlockScaledMMKernel")


class WeightLayoutError(MonodecodeError):
    """vLLM holds a weight in a form the kernels cannot read."""


@dataclass
class WeightCopies:
    """The row-major copies made of preshuffled weights: layer names and bytes (one TP rank)."""

    names: list[str] = field(default_factory=list)
    bytes: int = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        self.names.append(name)
        self.bytes += t.numel() * t.element_size()


def _kernel_name(module: Any) -> str:
    kernel = getattr(getattr(module, "quant_method", None), "fp8_linear", None)
    return type(kernel).__name__ if kernel is not None else ""


def preshuffled(module: Any) -> bool:
    """True when vLLM's linear kernel holds ``module.weight`` (16, 16)-preshuffled (AITER)."""
    return bool(getattr(module, "aiter_bpreshuffled", False)) or _kernel_name(module) in _AITER_PRESHUFFLING


def repack_reason(module: Any, name: str) -> str | None:
    """Why ``module.weight`` is not a matrix the kernels can read (None when it is: plain, or
    AITER-preshuffled, which ``_linear`` undoes): vLLM's CPU backend packs it for oneDNN / AMX and
    leaves an empty ``weight``; an AITER kernel whose layout is not known here; a quantization
    method other than unquantized / FP8 keeps its own packing."""
    method = getattr(module, "quant_method", None)
    method_name = type(method).__name__ if method is not None else "none"
    if method is not None and method_name not in _PLAIN_METHODS:
        return f"{name}: quantization method {method_name} keeps its own weight packing"
    kernel_name = _kernel_name(module)
    known = kernel_name in _AITER_PRESHUFFLING or kernel_name in _AITER_PLAIN
    if not known and (kernel_name.startswith("Aiter") or "huffle" in kernel_name):
        return (
            f"{name}: vLLM's {kernel_name} FP8 kernel holds the weight in a layout mono decode does not know "
            f"(known AITER kernels: {', '.join(_AITER_PRESHUFFLING + _AITER_PLAIN)})"
        )
    w = getattr(module, "weight", None)
    if w is None or w.dim() != 2 or w.numel() == 0 or w.is_meta:
        shape = None if w is None else tuple(w.shape)
        return f"{name}: weight {shape} was repacked by vLLM's linear backend (the kernels read the loaded matrix)"
    return None


def _row_major(module: Any, name: str, w: torch.Tensor, copies: WeightCopies | None) -> torch.Tensor:
    """The [N, K] matrix of a preshuffled ``w`` (already oriented [N, K]), as a row-major copy."""
    if not w.is_contiguous():
        raise WeightLayoutError(
            f"{name}: vLLM's {_kernel_name(module) or 'AITER'} kernel preshuffled the weight, and its buffer "
            f"{tuple(w.shape)} / {tuple(w.stride())} is not one contiguous [N, K] matrix"
        )
    try:
        plain = unshuffled(w.detach())
    except PreshuffleError as e:
        raise WeightLayoutError(f"{name}: {e}") from None
    if copies is not None:
        copies.add(name, plain)
    return plain


def _linear(module: Any, name: str, out_features: int, in_features: int, copies: WeightCopies | None = None) -> Linear:
    why = repack_reason(module, name)
    if why:
        raise WeightLayoutError(why)
    w = module.weight
    shuffle = preshuffled(module)
    if w.dtype in _FP8:
        if w.stride(-1) != 1 and w.stride(0) == 1:
            w = w.t()  # vLLM's FP8 GEMMs keep [in, out] views of the [out, in] storage
        elif tuple(w.shape) == (in_features, out_features) and in_features != out_features:
            w = w.t()  # a materialized [in, out]
        if tuple(w.shape) != (out_features, in_features):
            raise WeightLayoutError(f"{name}: FP8 weight shape {tuple(w.shape)} is not [{out_features}, {in_features}]")
        if shuffle:
            w = _row_major(module, name, w, copies)
        scale = getattr(module, "weight_scale", None)
        if scale is None:
            raise WeightLayoutError(f"{name}: FP8 weight without weight_scale")
        scale = scale.detach().float().reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(out_features)
        if scale.numel() != out_features:
            raise WeightLayoutError(
                f"{name}: FP8 scale has {scale.numel()} entries; only per-tensor or per-output-channel scales are supported"
            )
        if getattr(module, "input_scale", None) is not None:
            raise WeightLayoutError(f"{name}: static FP8 activation scales are not supported")
        return Linear(w, scale.contiguous())
    if w.dtype != torch.bfloat16:
        raise WeightLayoutError(f"{name}: weight dtype {w.dtype} is not bfloat16 or FP8")
    if tuple(w.shape) != (out_features, in_features):
        raise WeightLayoutError(f"{name}: weight shape {tuple(w.shape)} is not [{out_features}, {in_features}]")
    if shuffle:
        w = _row_major(module, name, w, copies)
    return Linear(w)


def _split_rows(lin: Linear, sizes: list[int]) -> list[Linear]:
    out, start = [], 0
    for n in sizes:
        w = lin.weight[start : start + n]
        s = None if lin.scale is None else lin.scale[start : start + n]
        out.append(Linear(w, s))
        start += n
    return out


def _norm(module: Any) -> torch.Tensor:
    return module.weight.detach()


def _layer_weights(dims: ModelDims, layer: Any, index: int, copies: WeightCopies | None) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    hidden = dims.hidden_size
    q_size, kv_size = int(attn.q_size), int(attn.kv_size)
    where = f"model.layers.{index}"
    qkv = _linear(attn.qkv_proj, f"{where}.self_attn.qkv_proj", q_size + 2 * kv_size, hidden, copies)
    q, k, v = _split_rows(qkv, [q_size, kv_size, kv_size])
    o = _linear(attn.o_proj, f"{where}.self_attn.o_proj", hidden, q_size, copies)
    inter = int(mlp.gate_up_proj.output_size_per_partition) // 2
    gate_up = _linear(mlp.gate_up_proj, f"{where}.mlp.gate_up_proj", 2 * inter, hidden, copies)
    gate, up = _split_rows(gate_up, [inter, inter])
    down = _linear(mlp.down_proj, f"{where}.mlp.down_proj", hidden, inter, copies)
    gemma = dims.family == "gemma3"
    return LayerWeights(
        attn_norm=_norm(layer.input_layernorm),
        q_proj=q,
        k_proj=k,
        v_proj=v,
        q_norm=_norm(attn.q_norm) if dims.qk_norm else None,
        k_norm=_norm(attn.k_norm) if dims.qk_norm else None,
        o_proj=o,
        attn_post_norm=_norm(layer.post_attention_layernorm) if gemma else None,
        mlp_norm=_norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
        gate_proj=gate,
        up_proj=up,
        down_proj=down,
        mlp_post_norm=_norm(layer.post_feedforward_layernorm) if gemma else None,
    )


def model_weights_from_vllm(model: Any, dims: ModelDims, copies: WeightCopies | None = None) -> ModelWeights:
    """``ModelWeights`` viewing ``model`` (a vLLM *ForCausalLM of a supported family); the row-major
    copies made of preshuffled weights are counted in ``copies``."""
    backbone = model.model
    layers = list(backbone.layers)[backbone.start_layer : backbone.end_layer]
    if len(layers) != dims.num_layers:
        raise WeightLayoutError(f"model holds {len(layers)} decoder layers, the config says {dims.num_layers}")
    embed = backbone.embed_tokens.weight.detach()[: dims.vocab_size]
    lm_head = getattr(model, "lm_head", None)
    head_w = lm_head.weight.detach()[: dims.vocab_size] if lm_head is not None and hasattr(lm_head, "weight") else embed
    return ModelWeights(
        dims=dims,
        embed=embed,
        layers=[_layer_weights(dims, layer, i, copies) for i, layer in enumerate(layers)],
        final_norm=_norm(backbone.norm),
        lm_head=Linear(head_w) if head_w.dtype == torch.bfloat16 else Linear(head_w.to(torch.bfloat16)),
    )
