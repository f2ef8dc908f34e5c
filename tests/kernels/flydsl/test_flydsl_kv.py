"""FlyDSL K1's KV cache launch arguments (``monodecode/kernels/flydsl/kv.py``), on the CPU.

K1 addresses K/V of (block, token, KV head) at 32-bit word ``kv_word(block, token, head, strides)``
of the key / value base address, with the strides passed per launch. Checked here for the two
layouts a deployment hands the kernels: the reference's contiguous cache and vLLM 0.33's
interleaved K|V views as ``vllm_plugin.step.kv_views`` builds them, token-major (LBNHC: the
TRITON_ATTN / FLASH_ATTN pairs) and head-major (LBHNC: the AITER pairs). The word arithmetic is
replayed on the tensors' real storage (reads and the new-token write), so a wrong stride, base or
unit fails. Pure Python + torch (no compiler): whether one code object serves both layouts is
checked against the real FlyDSL cache in test_flydsl_precompile.py.
"""

from __future__ import annotations

import pytest
import torch

from monodecode.errors import ConfigError
from monodecode.kernels.flydsl.kv import KV_STRIDE_ARGS, kv_launch_args, kv_word
from monodecode.kernels.flydsl.launch import FlyDSLKernels
from monodecode.model.paged_kv import PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.vllm_plugin.step import kv_views

DIMS = profile_dims("tiny")
KVH, D, BS, BLOCKS = DIMS.num_kv_heads, DIMS.head_dim, 16, 6


def contiguous_cache() -> PagedKVCache:
    kv = PagedKVCache.allocate(DIMS, BLOCKS, BS, num_layers=1)
    for t in kv.key + kv.value:
        t.normal_()
    return kv


def vllm_cache() -> tuple[PagedKVCache, torch.Tensor]:
    """vLLM 0.33's per-layer cache: logical [blocks, kv_heads, block_size, 2*head_dim], token-major
    (VLLM_KV_CACHE_LAYOUT=LBNHC), viewed by the plugin exactly as in serving."""
    raw = torch.randn(BLOCKS, BS, KVH, 2 * D).to(torch.bfloat16)
    return kv_views([raw.permute(0, 2, 1, 3)], KVH, D), raw


def vllm_head_major_cache() -> tuple[PagedKVCache, torch.Tensor]:
    """The AITER pairs' cache (VLLM_KV_CACHE_LAYOUT=LBHNC): logical [blocks, kv_heads, block_size,
    2*head_dim] stored in that order, viewed by the plugin exactly as in serving."""
    raw = torch.randn(BLOCKS, KVH, BS, 2 * D).to(torch.bfloat16)
    return kv_views([raw], KVH, D), raw


LAYOUTS = {
    "contiguous": lambda: contiguous_cache(),
    "vllm": lambda: vllm_cache()[0],
    "vllm_lbhnc": lambda: vllm_head_major_cache()[0],
}


def words_of(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The whole storage under ``t`` as int32 words, and ``t``'s base word in it."""
    storage = t.untyped_storage()
    base = t.data_ptr() - storage.data_ptr()
    assert base % 4 == 0
    return torch.empty(0, dtype=torch.int32).set_(storage), base // 4


def test_vllm_views_get_interleaved_strides():
    kv, raw = vllm_cache()
    a = kv_launch_args(kv.key[0], kv.value[0], KVH, D, BS)
    token = KVH * 2 * D // 2  # words: one token holds K|V of every head
    assert a.key_strides == a.value_strides == (BS * token, token, 2 * D // 2)
    assert a.key_addr == raw.data_ptr() and a.value_addr == raw.data_ptr() + D * 2  # V = K + head_dim
    assert list(a.named()) == list(KV_STRIDE_ARGS) and a.scalars() == (*a.key_strides, *a.value_strides)


def test_head_major_vllm_views_get_head_major_strides():
    kv, raw = vllm_head_major_cache()
    a = kv_launch_args(kv.key[0], kv.value[0], KVH, D, BS)
    token = 2 * D // 2  # words: a token's K|V of one head, the heads' blocks of tokens apart
    assert a.key_strides == a.value_strides == (KVH * BS * token, token, BS * token)
    assert a.key_addr == raw.data_ptr() and a.value_addr == raw.data_ptr() + D * 2


def test_contiguous_cache_gets_plane_strides():
    kv = contiguous_cache()
    a = kv_launch_args(kv.key[0], kv.value[0], KVH, D, BS)
    assert a.key_strides == a.value_strides == (BS * KVH * D // 2, KVH * D // 2, D // 2)
    assert (a.key_addr, a.value_addr) == (kv.key[0].data_ptr(), kv.value[0].data_ptr())
    v_args = kv_launch_args(*(lambda c: (c.key[0], c.value[0]))(vllm_cache()[0]), KVH, D, BS)
    assert a.scalars() != v_args.scalars(), "the two layouts differ only in these launch arguments"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_words_address_what_torch_indexes(layout):
    """Every (block, token, head, dim pair) K1 reads through its words is the element torch sees."""
    kv = LAYOUTS[layout]()
    a = kv_launch_args(kv.key[0], kv.value[0], KVH, D, BS)
    b, t, h, j = torch.meshgrid(
        torch.arange(BLOCKS), torch.arange(BS), torch.arange(KVH), torch.arange(D // 2), indexing="ij"
    )
    for tensor, addr, strides in ((kv.key[0], a.key_addr, a.key_strides), (kv.value[0], a.value_addr, a.value_strides)):
        words, _ = words_of(tensor)
        base = (addr - tensor.untyped_storage().data_ptr()) // 4
        got = words[base + kv_word(b, t, h, strides) + j]
        want = tensor.contiguous().view(torch.int32)  # bf16 pairs (2j, 2j+1) as one word
        assert torch.equal(got, want), layout


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_new_token_write_lands_on_its_slot_only(layout):
    """K1's insert: slot -> (slot // block_size, slot % block_size), words kv_word(...) + pair. In
    the interleaved buffer a K write must leave V (and every other slot) alone."""
    kv = LAYOUTS[layout]()
    a = kv_launch_args(kv.key[0], kv.value[0], KVH, D, BS)
    before_k, before_v = kv.key[0].clone(), kv.value[0].clone()
    slot, g = 3 * BS + 5, KVH - 1
    new_k = torch.randn(D).to(torch.bfloat16)
    words, _ = words_of(kv.key[0])
    base = (a.key_addr - kv.key[0].untyped_storage().data_ptr()) // 4
    words[base + kv_word(slot // BS, slot % BS, g, a.key_strides) + torch.arange(D // 2)] = new_k.view(torch.int32)
    assert torch.equal(kv.key[0][slot // BS, slot % BS, g], new_k)
    changed = (kv.key[0] != before_k).any(-1).nonzero().tolist()
    assert changed in ([], [[slot // BS, slot % BS, g]])  # (a random new value may equal the old one)
    assert torch.equal(kv.value[0], before_v)


def _view(shape, strides, dtype=torch.bfloat16, offset=0, device="cpu"):
    n = offset + sum((s - 1) * st for s, st in zip(shape, strides)) + 1
    return torch.zeros(n, dtype=dtype, device=device).as_strided(shape, strides, offset)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: _view((BLOCKS, BS, KVH, D), (BS * KVH * 2 * D, KVH * 2 * D, 2 * D, 2)), "head-dim stride 2"),
        (lambda: _view((BLOCKS, BS, KVH, D), (BS * KVH * D, KVH * D, D, 1), offset=1), "not 16-byte aligned"),
        (lambda: _view((BLOCKS, BS, KVH, D), (BS * KVH * (D + 4), KVH * (D + 4), D + 4, 1)), "not 16-byte aligned"),
        (lambda: torch.zeros(BLOCKS, BS, KVH, D), "4-byte elements; flydsl K1 reads bf16"),
        (lambda: torch.zeros(BLOCKS, 8, KVH, D, dtype=torch.bfloat16), "[*, 16, "),
        (lambda: torch.zeros(BLOCKS, BS * KVH, D, dtype=torch.bfloat16), "must be 4-D"),
        # a block stride past the i32 launch argument (meta tensor: shape and strides, no memory)
        (
            lambda: torch.empty(0, dtype=torch.bfloat16, device="meta").as_strided(
                (BLOCKS, BS, KVH, D), (2**32, KVH * D, D, 1)
            ),
            "up to 2147483647 (i32 launch arguments)",
        ),
    ],
)
def test_layouts_k1_cannot_address_are_one_line(make, message):
    t = make()
    with pytest.raises(ConfigError) as e:
        kv_launch_args(t, t, KVH, D, BS)
    text = str(e.value)
    assert text.startswith("kv_layout: ") and message in text and "\n" not in text, text


def big_vllm_cache() -> torch.Tensor:
    """A vLLM-layout layer cache of 12 GiB (interleaved K|V, past the 2^31 words an i32 offset
    reaches), as a meta tensor: shapes and strides, no memory."""
    blocks = 3 * 2**31 // (BS * KVH * D) + 7
    raw = torch.empty(blocks, BS, KVH, 2 * D, dtype=torch.bfloat16, device="meta")
    return kv_views([raw.permute(0, 2, 1, 3)], KVH, D)


def test_cache_past_8gib_is_addressed_in_64_bits():
    """A layer cache over 8 GiB is accepted, and K1's offsets (``kv_word``, evaluated here on int32
    operands as the kernel's traced i32 values are) reach its last block exactly: every factor is
    widened before it is multiplied, so nothing wraps at 2^31."""
    kv = big_vllm_cache()
    key = kv.key[0]
    assert key.untyped_storage().nbytes() > 8 * 2**30
    a = kv_launch_args(key, kv.value[0], KVH, D, BS)
    last = key.shape[0] - 1
    blocks = torch.tensor([0, 1, last // 2, last], dtype=torch.int32)
    tokens = torch.tensor([0, BS - 1, 3, BS - 1], dtype=torch.int32)
    heads = torch.tensor([0, KVH - 1, 1, KVH - 1], dtype=torch.int32)
    strides = tuple(torch.tensor(s, dtype=torch.int32) for s in a.key_strides)
    got = kv_word(blocks, tokens, heads, strides)
    want = [kv_word(int(b), int(t), int(h), a.key_strides) for b, t, h in zip(blocks, tokens, heads)]
    assert got.tolist() == want
    assert want[-1] > 2**31 and want[-1] + D // 2 <= key.untyped_storage().nbytes() // 4


def flydsl_kernels_for_layout_check(block_size: int) -> FlyDSLKernels:
    """FlyDSLKernels' binding-time check (``check_kv``) reads only the build request's dims and
    block size and its per-layer argument cache; the rest of a build needs a ROCm device."""
    from monodecode.kernels.base import BuildRequest
    from monodecode.services.platform import Platform

    k = FlyDSLKernels.__new__(FlyDSLKernels)
    k.req = BuildRequest(
        dims=DIMS,
        weight_dtype="bf16",
        tp_size=1,
        widths=(1,),
        block_size=block_size,
        platform=Platform("rocm", "gfx942", "MI300X", 304),
    )
    k.dims, k._kv_cache_args = DIMS, {}
    return k


def test_vllm_binding_runs_the_flydsl_layout_check():
    """``kv_views(..., kernels)`` (the plugin's binding) accepts vLLM's views for FlyDSL, keeping
    the launch arguments, and refuses a layout K1 cannot address as a one-line kv_layout error."""
    from monodecode.vllm_plugin.step import KVLayoutError

    raw = torch.randn(BLOCKS, BS, KVH, 2 * D).to(torch.bfloat16)
    k = flydsl_kernels_for_layout_check(BS)
    kv = kv_views([raw.permute(0, 2, 1, 3)], KVH, D, k)
    assert k._kv_cache_args[0][1] == kv_launch_args(kv.key[0], kv.value[0], KVH, D, BS)
    # built for another block size than vLLM's cache
    with pytest.raises(KVLayoutError) as e:
        kv_views([raw.permute(0, 2, 1, 3)], KVH, D, flydsl_kernels_for_layout_check(2 * BS))
    assert str(e.value).startswith("kv_layout: ") and f"[*, {2 * BS}, " in str(e.value)
    # a cache 8 bytes off K1's 16-byte vectors: vLLM's own view check passes it
    shifted = torch.zeros(raw.numel() + 4, dtype=torch.bfloat16)[4:].view(raw.shape)
    kv_views([shifted.permute(0, 2, 1, 3)], KVH, D)
    with pytest.raises(KVLayoutError) as e:
        kv_views([shifted.permute(0, 2, 1, 3)], KVH, D, flydsl_kernels_for_layout_check(BS))
    assert "not 16-byte aligned" in str(e.value) and "\n" not in str(e.value)
