"""The dense-decoder compute contract: dims from HF configs, the reference decode, the tiny model."""

from monodecode.model.dims import FAMILIES, ModelDims, RopeSpec, dims_from_hf_config, load_dims

__all__ = ["FAMILIES", "ModelDims", "RopeSpec", "dims_from_hf_config", "load_dims"]
