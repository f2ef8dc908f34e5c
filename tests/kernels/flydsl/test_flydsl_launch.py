"""What a FlyDSL K1/K2 launch is handed, built on the CPU from the backend's own launch path.

``FlyDSLKernels`` lays out the packed weights, RoPE tables and scratch buffer on CPU tensors the
same way as on a ROCm device; its ``k1_call`` / ``k2_call`` build the launch (addresses, scalars,
stream) the launchers are called with. That launch is then packed by FlyDSL's own host-dispatch
code against the real launcher signatures, so the test sees the values the HIP launch would get.
Only the stream object stands in: this CPU build of torch has no CUDA/HIP stream to give, so
``args.current_stream`` is replaced by an object with a ``cuda_stream`` handle (what FlyDSL reads
from a torch stream).
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("flydsl", reason="the flydsl extra is not installed")

from monodecode.kernels.base import BuildRequest
from monodecode.kernels.flydsl import args as launch_args
from monodecode.kernels.flydsl.arch import arch_spec
from monodecode.kernels.flydsl.config import plan_geometry
from monodecode.kernels.flydsl.launch import FlyDSLKernels
from monodecode.kernels.flydsl.offline import Specialisation, launchers
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights
from monodecode.services.platform import Platform

DIMS = profile_dims("tiny")
BS, WIDTH = 16, 2
STREAM = SimpleNamespace(cuda_stream=0x7F3A_5000)  # vLLM's forward stream, as a HIP handle


def build(dims) -> FlyDSLKernels:
    """The backend for ``dims`` at widths 1 and WIDTH on an MI300X, laid out on CPU tensors."""
    req = BuildRequest(
        dims=dims,
        weight_dtype="bf16",
        tp_size=1,
        widths=(1, WIDTH),
        block_size=BS,
        platform=Platform("rocm", "gfx942", "AMD Instinct MI300X", 304),
    )
    return FlyDSLKernels(req, random_weights(dims, seed=3, num_layers=dims.num_layers))


@pytest.fixture(scope="module")
def kernels() -> FlyDSLKernels:
    return build(DIMS)


@pytest.fixture
def on_vllm_stream(monkeypatch):
    monkeypatch.setattr(launch_args, "current_stream", lambda: STREAM)


def step_inputs():
    kv = PagedKVCache.allocate(DIMS, 8, BS, num_layers=DIMS.num_layers)
    alloc = BlockAllocator(8, BS)
    meta = alloc.decode_metadata(["a", "b"])
    x = torch.randn(WIDTH, DIMS.hidden_size).to(torch.bfloat16)
    return x, meta, kv


def abi_values(launcher, call: launch_args.LaunchCall) -> dict[str, int | float | None]:
    """The C values FlyDSL's host dispatch packs for ``call.launch(launcher)``, by parameter name."""
    from flydsl.compiler.jit_function import _build_call_spec

    jf = launcher
    jf._ensure_sig()
    given_args, given_kwargs = call.launch(lambda *a, **k: (a, k))  # exactly what launch() passes
    bound = jf._sig.bind(*given_args, **given_kwargs)
    bound.apply_defaults()
    jf._resolve_arguments(bound.arguments)
    values = tuple(bound.arguments.values())
    names = list(inspect.signature(jf.func).parameters)
    out: dict[str, int | float | None] = {}
    for i, ctype, fill in _build_call_spec(jf._sig, values):
        slot = ctype()
        if fill is not None:
            fill(values[i], slot)
        out[names[i] if i >= 0 else "<auto stream>"] = slot.value
    return out


def test_k1_and_k2_launch_on_the_current_stream(kernels, on_vllm_stream):
    x, meta, kv = step_inputs()
    k1, k2 = launchers(Specialisation("gfx942", DIMS, WIDTH, "bf16", BS))
    call1, out1, made = kernels.k1_call(0, x, meta, kv, WIDTH)
    call2, _ = kernels.k2_call(0, x, out1, WIDTH)
    for launcher, call in ((k1, call1), (k2, call2)):
        assert call.stream is STREAM
        packed = abi_values(launcher, call)
        assert "<auto stream>" not in packed, "FlyDSL appended its NULL stream"
        assert packed["stream"] == STREAM.cuda_stream, f"{call.kernel} launches on stream {packed['stream']}"


def test_launch_arguments_are_the_step_tensors(kernels, on_vllm_stream):
    """Every pointer and scalar the launch gets is the address / value of what the step hands
    it, in the launcher's order and element types (the cache key depends on those types)."""
    x, meta, kv = step_inputs()
    k1, k2 = launchers(Specialisation("gfx942", DIMS, WIDTH, "bf16", BS))
    call, out, made = kernels.k1_call(1, x, meta, kv, WIDTH, stall=1)
    packed = abi_values(k1, call)
    lw = kernels._layers[1]
    cache = kernels._kv_args(1, kv.key[1], kv.value[1])
    want = {
        "x": x.data_ptr(),
        "w_qkv": lw.qkv[0].data_ptr(),
        "key_cache": kv.key[1].data_ptr(),
        "value_cache": kv.value[1].data_ptr(),
        "block_tables": made[0].data_ptr(),
        "out_attn": out.data_ptr(),
        "mbox": kernels._segment[WIDTH],
        "health": kernels._health_addr,
        "bt_stride": meta.block_tables.shape[1],
        "layer": 1,
        "stall": 1,
        **cache.named(),
    }
    assert {k: packed[k] for k in want} == want
    assert [n for n, _ in launch_args.K1_ARGS] == [n for n, _, _ in call.pointers]
    assert list(packed)[: len(launch_args.K1_ARGS) + len(launch_args.K1_SCALARS)] == [
        *(n for n, _ in launch_args.K1_ARGS),
        *launch_args.K1_SCALARS,
    ]
    call2, out2 = kernels.k2_call(1, x, out, WIDTH, nan_fault=1)
    packed2 = abi_values(k2, call2)
    assert (packed2["attn"], packed2["out"], packed2["nan_fault"], packed2["rank"]) == (
        out.data_ptr(),
        out2.data_ptr(),
        1,
        0,
    )
    # the width's split-K arrival counters: int64, zeroed once at build (tiny has post norms: one
    # unused word), the same tensor every launch (graph replay)
    arrive = kernels._arrive[WIDTH]
    assert packed2["arrive"] == arrive.data_ptr() != kernels._arrive[1].data_ptr()
    assert arrive.dtype == torch.int64 and arrive.tolist() == [0]
    assert ctypes.sizeof(ctypes.c_void_p) == 8  # addresses above compare as 64-bit values


def test_merged_widths_get_their_arrival_counters(on_vllm_stream):
    """A Llama-style model (the tiny profile without Gemma's post norms) whose width-2 K2 splits
    o_proj and down along K and merges them (``Geometry.o_merge`` / ``d_merge``): the backend
    allocates one zeroed int64 counter per merged row tile for that width, and every layer's K2
    launch is handed the same tensor (the counters are monotonic across layers and steps)."""
    dims = dataclasses.replace(DIMS, post_norms=False)
    kernels = build(dims)
    geom = plan_geometry(dims, WIDTH, arch_spec("gfx942"), "bf16")
    assert geom.o_merge and geom.d_merge and geom.arrive_counters > 0
    arrive = kernels._arrive[WIDTH]
    assert arrive.dtype == torch.int64 and arrive.tolist() == [0] * geom.arrive_counters
    x = torch.randn(WIDTH, dims.hidden_size).to(torch.bfloat16)
    attn = torch.empty(WIDTH, dims.q_size, dtype=torch.bfloat16)
    for layer in range(dims.num_layers):
        call, _ = kernels.k2_call(layer, x, attn, WIDTH)
        assert {n: a for n, _, a in call.pointers}["arrive"] == arrive.data_ptr(), layer
