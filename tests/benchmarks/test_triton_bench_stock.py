"""The benchmark's stock per-op baseline (``monodecode_ops.decode_bench.stock``) computes the same decode
layer as the reference oracle, on a CPU: a baseline that computed something else faster would
make the comparison meaningless.

Tolerances: bf16 as the kernels' (``test_triton_numerics.py``: 1e-2 relative, 3 % of max); the
stock path rounds Gemma's ``1 + w`` to bf16, so its bound is 2e-2. FP8 runs W8A8 like vLLM (e4m3
activations per row), a few percent away from the reference's bf16 activations: 6e-2. The K/V
entries it writes must match the reference's (per-layer bound) and nothing else may change.
"""

from __future__ import annotations

import pytest
import torch

from monodecode.model import reference as R
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights
from monodecode_ops.decode_bench.stock import StockDecode, scaled_mm_works

BLOCK = 16


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _setup(profile: str, weight_dtype: str, layers: int, ctx: list[int]):
    torch.manual_seed(0)
    dims = profile_dims(profile)
    w = random_weights(dims, 3, weight_dtype=weight_dtype, num_layers=layers)
    alloc = BlockAllocator(48, BLOCK, shuffle_seed=4)
    for i, c in enumerate(ctx):
        alloc.append_slots(i, c - 1)
    meta = alloc.decode_metadata(list(range(len(ctx))))
    kv_ref = PagedKVCache.allocate(dims, 48, BLOCK, num_layers=layers)
    for t in kv_ref.key + kv_ref.value:
        t.normal_()
    kv = PagedKVCache([k.clone() for k in kv_ref.key], [v.clone() for v in kv_ref.value], BLOCK)
    return dims, w, meta, kv_ref, kv


# tiny = Gemma 3 style (q/k-norm, post norms, GELU, sliding window 24 exceeded by the contexts)
@pytest.mark.parametrize(
    "profile,weight_dtype,fp8,layers,bound",
    [
        ("tiny", "bf16", "auto", 2, 2e-2),
        ("llama3-1b", "bf16", "auto", 1, 1e-2),
        ("tiny", "fp8", "auto", 2, 6e-2),
        ("tiny", "fp8", "dequant", 2, 2e-2),
    ],
)
def test_stock_layers_match_the_reference(profile, weight_dtype, fp8, layers, bound):
    dims, w, meta, kv_ref, kv = _setup(profile, weight_dtype, layers, [37, 70, 5])
    stock = StockDecode(dims, w, 128, "cpu", fp8=fp8)
    if weight_dtype == "fp8":
        want = "W8A8" if fp8 == "auto" and scaled_mm_works("cpu") is None else "dequantized"
        assert want in stock.fp8_path
    stock.prepare(meta, BLOCK)
    x = torch.randn(3, dims.hidden_size).to(torch.bfloat16)
    s = meta.slot_mapping
    for l in range(layers):
        y_ref = R.decode_layer(dims, l, w.layers[l], x, meta, kv_ref)
        y = stock.forward_layer(l, x, meta, kv)
        assert _rel(y, y_ref) <= bound, f"layer {l}: {_rel(y, y_ref):.2e}"
        for a, b in ((kv.key[l], kv_ref.key[l]), (kv.value[l], kv_ref.value[l])):
            assert _rel(a[s // BLOCK, s % BLOCK], b[s // BLOCK, s % BLOCK]) <= bound
            rest = a.clone()
            rest[s // BLOCK, s % BLOCK] = b[s // BLOCK, s % BLOCK]
            assert torch.equal(rest, b), f"layer {l}: KV entries outside the step's slots changed"
        x = y_ref


def test_stock_writes_through_vllm_interleaved_views():
    dims, w, meta, kv_ref, kv = _setup("tiny", "bf16", 1, [20, 33, 9])
    buf = torch.cat([kv.key[0], kv.value[0]], dim=-1).contiguous()
    d = dims.head_dim
    kv_i = PagedKVCache([buf[..., :d]], [buf[..., d:]], BLOCK)
    stock = StockDecode(dims, w, 64, "cpu")
    stock.prepare(meta, BLOCK)
    x = torch.randn(3, dims.hidden_size).to(torch.bfloat16)
    assert torch.equal(stock.forward_layer(0, x, meta, kv_i), stock.forward_layer(0, x, meta, kv))
    assert torch.equal(buf[..., :d], kv.key[0]) and torch.equal(buf[..., d:], kv.value[0])


def test_gemm_floor_runs_the_layer_gemms():
    dims, w, meta, _, _ = _setup("tiny", "bf16", 1, [5])
    stock = StockDecode(dims, w, 64, "cpu")
    x_h = torch.randn(2, dims.hidden_size).to(torch.bfloat16)
    x_q = torch.randn(2, dims.q_size).to(torch.bfloat16)
    x_i = torch.randn(2, dims.intermediate_size).to(torch.bfloat16)
    y = stock.gemms_only(0, x_h, x_q, x_i)
    assert torch.equal(y, torch.nn.functional.linear(x_i, w.layers[0].down_proj.weight))


@pytest.mark.parametrize(
    "profile,weight_dtype,compiled,bound",
    [
        ("tiny", "bf16", False, 2e-2),
        ("llama3-1b", "bf16", False, 1e-2),
        ("tiny", "fp8", False, 6e-2),
        ("tiny", "bf16", True, 2e-2),
    ],
)
def test_contiguous_stock_layers_match_the_reference(profile, weight_dtype, compiled, bound):
    """Paths (a) and (b) of the benchmark: the contiguous-KV stock step (per-op, or each layer's
    halves torch.compile'd with the KV write inside the first) computes the reference layer and
    writes the reference's K; every row has the same context (the benchmark's setting), longer
    than tiny's sliding window (24), whose layers hold only the window."""
    from monodecode_ops.decode_bench.stock import ContiguousStockDecode

    ctx = 40
    dims, w, meta, kv_ref, kv = _setup(profile, weight_dtype, 2 if profile == "tiny" else 1, [ctx] * 3)
    stock = ContiguousStockDecode(dims, w, ctx, "cpu", compiled=compiled)
    stock.load_cache(kv, meta)
    stock.prepare(meta, BLOCK)
    x = torch.randn(3, dims.hidden_size).to(torch.bfloat16)
    for l in range(len(w.layers)):
        y_ref = R.decode_layer(dims, l, w.layers[l], x, meta, kv_ref)
        y = stock.forward_layer(l, x, meta, kv)
        assert _rel(y, y_ref) <= bound, f"layer {l}: {_rel(y, y_ref):.2e}"
        k_new = stock.key[l][torch.arange(3), :, meta.positions.long() - stock.cache.start[l]]
        s = meta.slot_mapping
        assert _rel(k_new, kv_ref.key[l][s // BLOCK, s % BLOCK]) <= bound
        window = dims.window_for_layer(l)
        assert stock.key[l].shape[2] == (min(ctx, window) if window else ctx)  # sliding layers: the window only
        x = y_ref


@pytest.mark.parametrize("weight_dtype, fp8", [("bf16", "auto"), ("fp8", "dequant")])
def test_model_weights_alias_the_merged_projections(weight_dtype, fp8):
    """The benchmark keeps one copy of the merged QKV and gate/up weights: the model's q/k/v and
    gate/up become row slices of the stock's merged tensors, with the same values (the reference
    layer's output is bit-identical); FP8 weights dequantized to bf16 are not aliased."""
    dims, w, meta, kv_ref, _ = _setup("tiny", weight_dtype, 2, [37, 70, 5])
    x = torch.randn(3, dims.hidden_size).to(torch.bfloat16)
    kv_a = PagedKVCache([k.clone() for k in kv_ref.key], [v.clone() for v in kv_ref.value], BLOCK)
    before = R.decode_layer(dims, 1, w.layers[1], x, meta, kv_a)
    stock = StockDecode(dims, w, 128, "cpu", fp8=fp8)
    freed = stock.alias_model_weights(w)
    lw, L = w.layers[1], stock.layers[1]
    if weight_dtype == "bf16":
        per_layer = sum(t.weight.numel() * 2 for t in (lw.q_proj, lw.k_proj, lw.v_proj, lw.gate_proj, lw.up_proj))
        assert freed == 2 * per_layer
        assert lw.q_proj.weight.data_ptr() == L.qkv.weight.data_ptr()
        assert lw.up_proj.weight.data_ptr() == L.gate_up.weight[dims.intermediate_size :].data_ptr()
    else:
        assert freed == 0 and lw.q_proj.weight.data_ptr() != L.qkv.weight.data_ptr()
    after = R.decode_layer(dims, 1, w.layers[1], x, meta, kv_ref)
    assert torch.equal(before, after)
