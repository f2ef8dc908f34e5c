"""AITER-preshuffled weights, read by the plugin (``vllm_plugin.weights``) as vLLM left them.

Each layer goes through vLLM's own ``process_weights_after_loading`` of its AITER FP8 scaled-mm
kernel, which calls AITER's own ``shuffle_weight`` (loaded from the amd-aiter sources:
tests/aiter_sources.py), starting from what vLLM's ``Fp8LinearMethod`` hands the kernel (the
``[N, K]`` storage as its ``[K, N]`` view). The kernel objects are made without ``__init__``:
their constructors ask for a tuned AITER configuration on a ROCm GPU. The plugin's ``Linear``
must dequantize to the checkpoint's matrix exactly, with a row-major copy counted where AITER
shuffled. A kernel whose layout is not known, or a shuffled buffer that is not one matrix, is
a ``weight_layout`` refusal.
"""

from __future__ import annotations

import pytest
import torch
import vllm_testlib  # noqa: F401  (VLLM_TARGET_DEVICE=cpu before vLLM is imported)
from aiter_sources import shuffle_weight

from monodecode.vllm_plugin.weights import WeightCopies, WeightLayoutError, _linear, preshuffled

N, K = 96, 64  # out, in: a fused projection's shape class (N, K multiples of 16 and 32)
NAME = "model.layers.0.self_attn.qkv_proj"


def _kernel(name: str):
    from vllm.model_executor.kernels.linear.scaled_mm import aiter

    cls = getattr(aiter, name)
    kernel = cls.__new__(cls)
    kernel.layer_param_names = ["weight", "weight_scale", "input_scale", "input_scale_ub"]
    return kernel


def _fp8_layer(kernel, dtype, per_channel: bool):
    """A linear layer as vLLM's Fp8LinearMethod leaves it for its kernel, then processed by it:
    returns the layer and the checkpoint's (quantized matrix, scales)."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(N, K, generator=gen) * 40).clamp(-200, 200).to(dtype)
    scale = torch.rand(N if per_channel else 1, 1, generator=gen) + 0.5
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(q.clone().t(), requires_grad=False)  # [K, N] view of [N, K]
    layer.weight_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
    layer.input_scale = None
    method = Fp8LinearMethod.__new__(Fp8LinearMethod)
    method.fp8_linear = kernel
    layer.quant_method = method
    shuffle_weight()  # vLLM's rocm_aiter_ops.shuffle_weight imports aiter.ops.shuffle: AITER's own
    kernel.process_weights_after_loading(layer)
    return layer, q, scale.reshape(-1).expand(N)


@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize(
    "kernel, shuffles",
    [
        ("AiterPreshuffledPerTokenFp8ScaledMMLinearKernel", True),
        ("AiterHipbMMPerTokenFp8ScaledMMLinearKernel", True),  # the shuffle, as its transposed view
        ("AiterPerTokenFp8ScaledMMLinearKernel", False),  # the matrix, transposed back
    ],
)
def test_each_aiter_fp8_kernels_weight_is_read_as_the_checkpoint(kernel, shuffles, dtype, per_channel):
    layer, q, scale = _fp8_layer(_kernel(kernel), dtype, per_channel)
    assert preshuffled(layer) == shuffles
    if shuffles:  # vLLM's parameter is not the matrix: read row-major it would be misread
        held = layer.weight if layer.weight.shape == (N, K) else layer.weight.t()
        assert not torch.equal(held.view(torch.uint8), q.view(torch.uint8))
    copies = WeightCopies()
    lin = _linear(layer, NAME, N, K, copies)
    assert lin.weight.shape == (N, K)
    assert torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(lin.scale, scale.float())
    assert (copies.names, copies.bytes) == (([NAME], N * K) if shuffles else ([], 0))


def test_a_bf16_weight_marked_preshuffled_is_undone_too():
    """vLLM's marker for a kernel that shuffled the layer's weight (``aiter_bpreshuffled``, set by
    AITER's block-scaled kernel): a BF16 matrix shuffled by AITER is read as the matrix."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    w = torch.randn(N, K).to(torch.bfloat16)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(shuffle_weight()(w.clone(), layout=(16, 16)), requires_grad=False)
    layer.quant_method = UnquantizedLinearMethod()
    layer.aiter_bpreshuffled = True
    copies = WeightCopies()
    assert torch.equal(_linear(layer, NAME, N, K, copies).weight, w) and copies.bytes == 2 * N * K
    del layer.aiter_bpreshuffled  # the same bytes without the marker: read as stored (the stock check's job)
    assert not torch.equal(_linear(layer, NAME, N, K).weight, w)


def test_an_aiter_kernel_of_unknown_layout_is_refused_naming_it():
    layer, _, _ = _fp8_layer(_kernel("AiterPerTokenFp8ScaledMMLinearKernel"), torch.float8_e4m3fnuz, True)

    class AiterNewShuffledKernel:  # a kernel a later vLLM may add
        pass

    layer.quant_method.fp8_linear = AiterNewShuffledKernel()
    with pytest.raises(WeightLayoutError) as e:
        _linear(layer, NAME, N, K)
    why = str(e.value)
    assert why.startswith(f"{NAME}: vLLM's AiterNewShuffledKernel FP8 kernel holds the weight in a layout") and (
        "AiterPreshuffledPerTokenFp8ScaledMMLinearKernel" in why and "\n" not in why
    )


def test_a_shuffled_buffer_that_is_not_one_matrix_is_refused():
    layer, _, _ = _fp8_layer(_kernel("AiterPreshuffledPerTokenFp8ScaledMMLinearKernel"), torch.float8_e4m3fn, True)
    wide = torch.zeros(N, 2 * K, dtype=torch.float8_e4m3fn)
    layer.weight = torch.nn.Parameter(wide[:, :K], requires_grad=False)  # a padded row stride
    with pytest.raises(WeightLayoutError, match=r"preshuffled the weight, and its buffer \(96, 64\) / \(128, 1\)"):
        _linear(layer, NAME, N, K)
