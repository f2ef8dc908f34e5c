"""The dense-decoder compute contract: dims from HF configs, the reference decode, the tiny model."""

from monodecode.model.dims import FAMILIES, ModelDims, RopeSpec, dims_from_hf_config, load_dims
from monodecode.model.paged_kv import BlockAllocator, DecodeMetadata, PagedKVCache
from monodecode.model.reference import (
    decode_layer,
    decode_step,
    embed,
    final_logits,
    greedy_decode,
    k1_reference,
    k2_reference,
    prefill,
)
from monodecode.model.tiny import ensure_tiny_model
from monodecode.model.weights import (
    WEIGHT_DTYPES,
    LayerWeights,
    Linear,
    ModelWeights,
    load_weights,
    quantize_fp8,
    random_weights,
)

__all__ = [
    "FAMILIES",
    "ModelDims",
    "RopeSpec",
    "dims_from_hf_config",
    "load_dims",
    "BlockAllocator",
    "DecodeMetadata",
    "PagedKVCache",
    "decode_layer",
    "decode_step",
    "embed",
    "final_logits",
    "greedy_decode",
    "k1_reference",
    "k2_reference",
    "prefill",
    "ensure_tiny_model",
    "WEIGHT_DTYPES",
    "LayerWeights",
    "Linear",
    "ModelWeights",
    "load_weights",
    "quantize_fp8",
    "random_weights",
]
