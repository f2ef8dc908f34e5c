"""The Triton backend run the way vLLM runs a decode step: the forward on a side stream, a FULL
CUDA graph of the whole step captured on that stream, then replayed with new inputs copied into
its static buffers. The replayed outputs must equal the same step run eagerly (bit for bit: same
kernels, same inputs) and stay within the stack tolerance of the reference; the KV entries the
step writes must match too, and the health word stays 0.

Marked ``gpu``: skipped with a printed reason where torch sees no CUDA/ROCm GPU.
"""

from __future__ import annotations

import pytest
import torch

from monodecode.kernels.base import BuildRequest
from monodecode.kernels.health import decode_health
from monodecode.model import reference as R
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights

pytestmark = pytest.mark.gpu

BLOCK, LAYERS, ROWS = 16, 3, 3
STACK_REL_FRO = 5e-2  # the whole-stack bound of test_triton_numerics.py


def _gpu() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm GPU visible to torch: the Triton kernels run on a GPU (H200 runs these)")
    return torch.device("cuda")


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_full_graph_on_a_side_stream_replays_like_eager_and_reference():
    dev = _gpu()
    from monodecode.kernels.triton.backend import TritonBackend
    from monodecode.services.platform import detect_platform

    dims = profile_dims("llama3-8b")
    weights = random_weights(dims, seed=5, device=dev, num_layers=LAYERS)
    req = BuildRequest(
        dims=dims,
        weight_dtype="bf16",
        tp_size=1,
        widths=(1, 4),
        block_size=BLOCK,
        platform=detect_platform(),
        wait_timeout_s=2.0,
    )
    tk = TritonBackend().build(req, weights, None, allow_jit=True)
    alloc = BlockAllocator(3 * 70, BLOCK, shuffle_seed=3)
    for r, c in enumerate((40, 700, 1025)):
        alloc.append_slots(r, c - 1)
    meta = alloc.decode_metadata(list(range(ROWS)), device=dev)
    kv_ref = PagedKVCache.allocate(dims, 3 * 70, BLOCK, device=dev, num_layers=LAYERS)
    for t in kv_ref.key + kv_ref.value:
        t.normal_()
    kv_eager = PagedKVCache([k.clone() for k in kv_ref.key], [v.clone() for v in kv_ref.value], BLOCK)
    kv_graph = PagedKVCache([k.clone() for k in kv_ref.key], [v.clone() for v in kv_ref.value], BLOCK)
    static_x = torch.empty(ROWS, dims.hidden_size, dtype=torch.bfloat16, device=dev)

    def forward(x, kv):
        return R.run_layers(weights, x, meta, kv, layer_fn=tk.forward_layer)  # rows padded to width 4 in-graph

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on the capture stream, as vLLM does
        static_x.normal_()
        forward(static_x, kv_graph)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_out = forward(static_x, kv_graph)
    torch.cuda.current_stream().wait_stream(side)

    s = meta.slot_mapping
    for step in range(3):
        x = torch.randn(ROWS, dims.hidden_size, device=dev).to(torch.bfloat16)
        static_x.copy_(x)
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
            graph.replay()
        torch.cuda.current_stream().wait_stream(side)
        replayed = static_out.clone()
        eager = forward(x, kv_eager)
        ref = R.run_layers(weights, x, meta, kv_ref)
        torch.cuda.synchronize()
        assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16)), f"step {step}: replay != eager"
        assert _rel(replayed, ref) <= STACK_REL_FRO, f"step {step}: {_rel(replayed, ref):.2e} vs reference"
        for l in range(LAYERS):
            assert torch.equal(kv_graph.key[l][s // BLOCK, s % BLOCK], kv_eager.key[l][s // BLOCK, s % BLOCK])
            assert torch.equal(kv_graph.value[l][s // BLOCK, s % BLOCK], kv_eager.value[l][s // BLOCK, s % BLOCK])
    assert tk.health() == 0, decode_health(tk.health())
    tk.close()
