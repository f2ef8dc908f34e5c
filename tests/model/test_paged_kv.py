"""Paged KV cache, decode metadata, allocator, and the paging invariants of the reference decode."""

from __future__ import annotations

import pytest
import torch

from monodecode.errors import MonodecodeError
from monodecode.model import (
    BlockAllocator,
    DecodeMetadata,
    PagedKVCache,
    decode_step,
    dims_from_hf_config,
    prefill,
    random_weights,
)
from monodecode.model.paged_kv import write_kv
from monodecode.model.reference import paged_attention

pytestmark = pytest.mark.usefixtures("torch_one_thread")

# A small Gemma-3-style config: sliding window 5 on layers 0 and 2, GQA 4:2.
SMALL = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 97,
    "query_pre_attn_scalar": 16,
    "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
}


@pytest.fixture(scope="module")
def model():
    dims = dims_from_hf_config(SMALL)
    return dims, random_weights(dims, seed=7)


# ---------------------------------------------------------------------------------------------
# Allocator and metadata


def test_allocator_slots_follow_the_block_table():
    alloc = BlockAllocator(num_blocks=8, block_size=4, shuffle_seed=3)
    slots = alloc.append_slots("a", 10)
    table = alloc.block_table("a")
    assert len(table) == 3 and len(set(table)) == 3
    assert slots == [table[t // 4] * 4 + t % 4 for t in range(10)]
    assert alloc.seq_len("a") == 10 and alloc.num_free_blocks == 5
    # Unshuffled allocators hand out blocks in ascending order.
    plain = BlockAllocator(8, 4)
    assert plain.append_slots(0, 5) == [0, 1, 2, 3, 4] and plain.block_table(0) == [0, 1]


def test_allocator_full_and_free():
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    alloc.append_slots("a", 8)
    with pytest.raises(MonodecodeError, match="KV cache full: all 2 blocks of 4 tokens are in use"):
        alloc.append_slots("b", 1)
    alloc.free("a")
    assert alloc.num_free_blocks == 2 and alloc.append_slots("b", 5) == [0, 1, 2, 3, 4]
    with pytest.raises(MonodecodeError, match="num_blocks"):
        BlockAllocator(0, 16)


def test_prefill_and_decode_metadata():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    pre = alloc.prefill_metadata(0, 6)
    assert pre.positions.tolist() == list(range(6)) and pre.seq_lens.tolist() == list(range(1, 7))
    assert pre.slot_mapping.tolist() == list(range(6)) and pre.block_tables.tolist() == [[0, 1]] * 6
    alloc.append_slots(1, 3)
    meta = alloc.decode_metadata([0, 1], max_blocks=4)
    assert meta.positions.tolist() == [6, 3] and meta.seq_lens.tolist() == [7, 4]
    assert meta.slot_mapping.tolist() == [6, 8 + 3] and meta.block_tables.tolist() == [[0, 1, 0, 0], [2, 0, 0, 0]]
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert meta.positions.dtype == torch.int64 and meta.seq_lens.dtype == torch.int32
    with pytest.raises(MonodecodeError, match="lists a sequence twice"):
        alloc.decode_metadata([0, 0])
    with pytest.raises(MonodecodeError, match="more than max_blocks=1"):
        alloc.decode_metadata([0], max_blocks=1)


def test_pad_to():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    alloc.append_slots(0, 5)
    meta = alloc.decode_metadata([0])
    assert meta.pad_to(1) is meta
    padded = meta.pad_to(4)
    assert padded.num_rows == 4 and padded.max_blocks == meta.max_blocks
    assert padded.slot_mapping.tolist() == [5, -1, -1, -1] and padded.seq_lens.tolist() == [6, 0, 0, 0]
    assert padded.positions.tolist() == [5, 0, 0, 0] and padded.block_tables[1:].eq(0).all()
    with pytest.raises(MonodecodeError, match="cannot pad 4 decode rows down to width 2"):
        padded.pad_to(2)


# ---------------------------------------------------------------------------------------------
# Cache writes


def _cache(num_blocks=3, bs=4, heads=2, hd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, bs, heads, hd, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("slots", [[-1, 5, -1, 0], [0, -1], [-1, -1, -1], [11, -1, 3], [-1, 0]])
def test_write_kv_padded_rows_write_nothing(slots):
    cache = _cache()
    before = cache.clone()
    new = torch.randn(len(slots), 2, 8).to(torch.bfloat16)
    write_kv(cache, torch.tensor(slots), new)
    expected = before.view(-1, 2, 8).clone()
    for row, slot in enumerate(slots):
        if slot >= 0:
            expected[slot] = new[row]
    assert torch.equal(cache.view(-1, 2, 8), expected)


# ---------------------------------------------------------------------------------------------
# Paging invariants of the whole decode


def _decode(weights, dims, alloc, prompts, steps, block_size, num_blocks, pad_to=None, act=torch.bfloat16):
    kv = PagedKVCache.allocate(dims, num_blocks, block_size, dtype=act)
    logits = [[prefill(weights, p, kv, alloc, seq_id=i)] for i, p in enumerate(prompts)]
    for _ in range(steps):
        ids = [int(l[-1].argmax()) for l in logits]
        meta = alloc.decode_metadata(list(range(len(prompts))), max_blocks=num_blocks)
        if pad_to:
            meta = meta.pad_to(pad_to)
            ids += [0] * (pad_to - len(prompts))
        out = decode_step(weights, torch.tensor(ids), meta, kv)
        for i in range(len(prompts)):
            logits[i].append(out[i])
    return [torch.stack(l) for l in logits], kv, alloc


PROMPTS = ([3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26])


@pytest.mark.parametrize("block_size", [2, 8])
def test_shuffled_block_table_gives_identical_outputs(model, block_size):
    dims, weights = model
    n = 16
    plain, kv_a, alloc_a = _decode(weights, dims, BlockAllocator(n, block_size), PROMPTS, 9, block_size, n)
    shuffled, kv_b, alloc_b = _decode(
        weights, dims, BlockAllocator(n, block_size, shuffle_seed=11), PROMPTS, 9, block_size, n
    )
    assert alloc_a.block_table(0) != alloc_b.block_table(0)
    for a, b in zip(plain, shuffled):
        assert torch.equal(a, b)
    # The same token's K/V sits at the same place of each sequence's pages in both caches.
    for seq in (0, 1):
        for t in range(alloc_a.seq_len(seq) - 1):
            sa = alloc_a.block_table(seq)[t // block_size], t % block_size
            sb = alloc_b.block_table(seq)[t // block_size], t % block_size
            for layer in range(dims.num_layers):
                assert torch.equal(kv_a.key[layer][sa], kv_b.key[layer][sb])
                assert torch.equal(kv_a.value[layer][sa], kv_b.value[layer][sb])


def test_padded_rows_are_inert(model):
    dims, weights = model
    plain, kv_a, _ = _decode(weights, dims, BlockAllocator(12, 4), PROMPTS, 6, 4, 12)
    padded, kv_b, _ = _decode(weights, dims, BlockAllocator(12, 4), PROMPTS, 6, 4, 12, pad_to=5)
    for a, b in zip(plain, padded):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    for layer in range(dims.num_layers):
        assert torch.equal(kv_a.key[layer], kv_b.key[layer]) and torch.equal(kv_a.value[layer], kv_b.value[layer])


def test_padded_row_with_garbage_metadata_writes_nothing(model):
    """Slot -1 alone makes a row inert, even if its block table and length point at live blocks."""
    dims, weights = model
    alloc = BlockAllocator(8, 4)
    kv = PagedKVCache.allocate(dims, 8, 4)
    prefill(weights, PROMPTS[0], kv, alloc, seq_id=0)
    meta = alloc.decode_metadata([0], max_blocks=3)
    snapshot = [t.clone() for t in kv.key + kv.value]
    garbage = DecodeMetadata(
        positions=torch.cat([meta.positions, torch.tensor([2])]),
        slot_mapping=torch.cat([meta.slot_mapping, torch.tensor([-1])]),
        block_tables=torch.cat([meta.block_tables, meta.block_tables]),
        seq_lens=torch.cat([meta.seq_lens, torch.tensor([3], dtype=torch.int32)]),
    )
    out = decode_step(weights, torch.tensor([7, 50]), garbage, kv)
    slot = int(meta.slot_mapping[0])
    for before, after in zip(snapshot, kv.key + kv.value):
        changed = (before.view(-1, *before.shape[2:]) != after.view(-1, *after.shape[2:])).flatten(1).any(1)
        assert changed.nonzero().flatten().tolist() in ([slot], [])
    assert torch.isfinite(out).all()


def test_prefill_equals_token_by_token_decode(model):
    """A prompt prefilled at once and the same prompt decoded one token at a time agree (fp32)."""
    dims, weights = model
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    kv = PagedKVCache.allocate(dims, 6, 2, dtype=torch.float32)
    whole = prefill(weights, prompt, kv, BlockAllocator(6, 2))
    kv2 = PagedKVCache.allocate(dims, 6, 2, dtype=torch.float32)
    alloc = BlockAllocator(6, 2, shuffle_seed=1)
    prefill(weights, prompt[:1], kv2, alloc)
    for tok in prompt[1:]:
        step = decode_step(weights, torch.tensor([tok]), alloc.decode_metadata([0]), kv2)[0]
    assert torch.allclose(whole, step, atol=1e-5, rtol=0)


def test_batched_sequences_do_not_interfere(model):
    dims, weights = model
    together, _, _ = _decode(weights, dims, BlockAllocator(12, 4), PROMPTS, 5, 4, 12, act=torch.float32)
    for i, p in enumerate(PROMPTS):
        alone, _, _ = _decode(weights, dims, BlockAllocator(12, 4), [p], 5, 4, 12, act=torch.float32)
        assert torch.allclose(together[i], alone[0], atol=1e-5, rtol=0)


def _three_rows(seed: int):
    """Three rows over a 10-block cache of 4 positions (2 KV heads, 6 query heads, head_dim 8),
    their tables padded with block 0, which no row owns: (key, value, meta, q)."""
    g = torch.Generator().manual_seed(seed)
    bs, kv_heads, heads, hd = 4, 2, 6, 8
    key = torch.randn(10, bs, kv_heads, hd, generator=g)
    value = torch.randn(10, bs, kv_heads, hd, generator=g)
    tables = torch.tensor([[7, 2, 9, 0], [4, 1, 0, 0], [3, 5, 6, 8]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 5, 16], dtype=torch.int32)
    meta = DecodeMetadata(seq_lens.long() - 1, torch.tensor([1, 2, 3]), tables, seq_lens)
    return key, value, meta, torch.randn(3, heads, hd, generator=g)


@pytest.mark.parametrize("window", [None, 1, 3, 7])
def test_paged_attention_matches_dense_loop(window):
    """Attention through block tables equals a plain loop over each sequence's visible tokens."""
    key, value, meta, q = _three_rows(window or 0)
    bs, kv_heads, heads = key.shape[1], key.shape[2], q.shape[1]
    tables, seq_lens, positions = meta.block_tables, meta.seq_lens, meta.positions
    out = paged_attention(q, key, value, meta, scale=0.3, window=window)
    for r in range(3):
        p = int(positions[r])
        visible = [t for t in range(int(seq_lens[r])) if window is None or t > p - window]
        ks = torch.stack([key[tables[r, t // bs], t % bs] for t in visible])  # [n, kv_heads, hd]
        vs = torch.stack([value[tables[r, t // bs], t % bs] for t in visible])
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            w = torch.softmax((ks[:, kvh] @ q[r, h]) * 0.3, dim=0)
            assert torch.allclose(out[r, h], w @ vs[:, kvh], atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_never_sums_a_slot_it_does_not_see(window):
    """NaN or inf in every slot no row sees (the blocks' later slots, block 0 behind the tables'
    padding, the positions a window leaves out) changes nothing: the output is bit for bit the
    clean cache's. (A stale slot's V times its zero probability is NaN if it is summed.)"""
    key, value, meta, q = _three_rows(5)
    bs = key.shape[1]
    seen = torch.zeros(key.shape[:2], dtype=torch.bool)
    for r in range(3):
        p = int(meta.positions[r])
        for t in range(int(meta.seq_lens[r])):
            if window is None or t > p - window:
                seen[meta.block_tables[r, t // bs], t % bs] = True
    assert not seen[0].any()  # block 0 is the tables' padding only
    k2, v2 = key.clone(), value.clone()
    k2[~seen], v2[~seen] = float("nan"), float("inf")
    out = paged_attention(q, key, value, meta, scale=0.3, window=window)
    assert torch.equal(paged_attention(q, k2, v2, meta, scale=0.3, window=window), out)


def test_allocate_validates():
    dims = dims_from_hf_config(SMALL)
    kv = PagedKVCache.allocate(dims, 5, 16)
    assert len(kv.key) == 3 and kv.key[0].shape == (5, 16, 2, 16) and kv.dtype == torch.bfloat16
    assert kv.num_blocks == 5 and kv.block_size == 16
    with pytest.raises(MonodecodeError, match="block_size"):
        PagedKVCache.allocate(dims, 5, 0)


@pytest.mark.parametrize("slots", [[5, -1, 17, 2], [-1, -1, -1, -1], [0, 31, -1, 8]])
def test_write_kv_through_vllm_style_interleaved_view(slots):
    """vLLM 0.33 keeps K|V interleaved per head: K and V are strided views of one tensor.

    Writing through those views must equal writing into a contiguous cache, and V's half of
    each slot must stay untouched by the K write (and vice versa).
    """
    blocks, block_size, heads, dim = 4, 8, 2, 16
    gen = torch.Generator().manual_seed(7)
    both = torch.randn(blocks, block_size, heads, 2 * dim, generator=gen)
    key_view, value_view = both[..., :dim], both[..., dim:]
    assert not key_view.is_contiguous()
    plain = key_view.clone()
    value_before = value_view.clone()
    new = torch.randn(len(slots), heads, dim, generator=gen)
    slot_mapping = torch.tensor(slots)
    write_kv(key_view, slot_mapping, new)
    write_kv(plain, slot_mapping, new)
    assert torch.equal(key_view, plain)
    assert torch.equal(value_view, value_before)
    for row, slot in enumerate(slots):
        if slot >= 0:
            assert torch.equal(key_view[slot // block_size, slot % block_size], new[row])
