"""The whole-layer fullgraph stock step (``monodecode_ops.decode_bench.fullgraph``) computes the
reference decode layer, compiled by inductor on the CPU: a stock bar that computed less (or
something else) would make the comparison with the kernels meaningless.

Tolerance: the kernels' per-layer bound (``test_triton_numerics.py``: 1e-2 relative), because the
step does the reference's math (Gemma's ``1 + w`` in fp32, the same rounding points); FP8 runs
W8A16 on the same e4m3 weights and scales as the reference, so the same bound. The K/V it writes
must be the reference's, and no other cache entry may change.

Cost: four inductor compiles of tiny dims on the CPU (about 10-30 s in all on two cores).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from monodecode.model import reference as R
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights
from monodecode_ops.decode_bench.fullgraph import FullgraphStockDecode

BLOCK, CTX, ROWS = 16, 40, 3
REL_FRO = 1e-2


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _llama_tiny():
    """tiny's sizes with Llama's layer: no q/k-norm, no post norms, plain ``w`` norms, SiLU, full attention."""
    d = profile_dims("tiny")
    return dataclasses.replace(
        d,
        norm_one_plus=False,
        post_norms=False,
        qk_norm=False,
        activation="silu",
        layer_types=("full",) * d.num_layers,
        sliding_window=None,
        rope_sliding=None,
    )


@pytest.mark.parametrize(
    "dims_of, weight_dtype, layers, tuning",
    [
        (lambda: profile_dims("tiny"), "bf16", 4, False),  # Gemma 3 style: 3 sliding layers, 1 global
        (lambda: profile_dims("tiny"), "fp8", 4, True),  # W8A16, compiled with coordinate descent tuning
        (_llama_tiny, "bf16", 1, False),
    ],
    ids=["gemma-bf16", "gemma-fp8-w8a16-cdt", "llama-bf16"],
)
def test_fullgraph_layers_match_the_reference(dims_of, weight_dtype, layers, tuning):
    torch.manual_seed(0)
    torch._dynamo.reset()
    dims = dims_of()
    w = random_weights(dims, 3, weight_dtype=weight_dtype, num_layers=layers)
    alloc = BlockAllocator(ROWS * 3 + 1, BLOCK, shuffle_seed=4)
    for r in range(ROWS):
        alloc.append_slots(r, CTX - 1)
    meta = alloc.decode_metadata(list(range(ROWS)))
    kv_ref = PagedKVCache.allocate(dims, ROWS * 3 + 1, BLOCK, num_layers=layers)
    for t in kv_ref.key + kv_ref.value:
        t.normal_()
    step = FullgraphStockDecode(dims, w, CTX, "cpu", tuning=tuning)
    if weight_dtype == "fp8":
        assert "W8A16" in step.fp8_path and step.layers[0].qkv.weight.dtype == w.layers[0].q_proj.weight.dtype
    step.load_cache(kv_ref, meta)
    before = [(k.clone(), v.clone()) for k, v in zip(step.cache.key, step.cache.value)]
    step.prepare(meta, BLOCK)
    x = torch.randn(ROWS, dims.hidden_size).to(torch.bfloat16)
    torch._dynamo.utils.counters.clear()
    s = meta.slot_mapping
    at = (torch.arange(ROWS), slice(None), meta.positions)
    for l in range(layers):
        y = step.forward_layer(l, x, meta, None)
        y_ref = R.decode_layer(dims, l, w.layers[l], x, meta, kv_ref)
        assert _rel(y, y_ref) <= REL_FRO, f"layer {l}: {_rel(y, y_ref):.2e}"
        lo = step.cache.start[l]
        window = dims.window_for_layer(l)
        assert step.cache.key[l].shape[2] == (min(CTX, window) if window else CTX)
        pos = (at[0], at[1], at[2] - lo)
        for new, old, ref in (
            (step.cache.key[l], before[l][0], kv_ref.key[l]),
            (step.cache.value[l], before[l][1], kv_ref.value[l]),
        ):
            assert _rel(new[pos], ref[s // BLOCK, s % BLOCK]) <= REL_FRO, f"layer {l}: the K/V written"
            rest = new.clone()
            rest[pos] = old[pos]
            assert torch.equal(rest, old), f"layer {l}: cache entries outside the step's positions changed"
        x = y_ref
    # one compile per distinct cache shape (sliding / global), not one per layer
    kinds = len({step.cache.key[l].shape for l in range(layers)})
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == kinds


def test_the_wide_search_stock_differs_only_in_real_inductor_options():
    """``stock-fullgraph-cdt-wide`` is the cdt stock with coordinate descent's wider search: its
    options are the cdt stock's plus ``WIDE_SEARCH``, each one inductor has (``config.patch``
    refuses a name it lacks, as ``torch.compile`` does), and no search is asked where there is no
    tuning."""
    import torch._inductor.config as inductor_config

    from monodecode_ops.decode_bench.fullgraph import FULLGRAPH_STOCKS, WIDE_SEARCH, inductor_options

    wide = inductor_options(**FULLGRAPH_STOCKS["stock-fullgraph-cdt-wide"])
    cdt = inductor_options(**FULLGRAPH_STOCKS["stock-fullgraph-cdt"])
    assert cdt == {"coordinate_descent_tuning": True} and wide == cdt | WIDE_SEARCH
    with inductor_config.patch(wide):
        assert inductor_config.coordinate_descent_search_radius == 2
        assert inductor_config.coordinate_descent_check_all_directions
    assert inductor_options(wide_search=True) is None
