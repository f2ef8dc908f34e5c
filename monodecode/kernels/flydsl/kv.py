"""How K1 addresses the paged KV cache: base addresses and strides are launch arguments.

K1 reads and writes K (V) of (block ``b``, token ``t`` of the block, KV head ``g``) at 32-bit word
``b * block + t * token + g * head`` of the key (value) pointer, an offset computed in 64 bits (a
layer's cache may span more than the 2^31 words, 8 GiB, an i32 offset reaches); a word holds two
bf16 head dims, and the head dims are contiguous. The three strides of each tensor are kernel arguments, never
constants of the code object, so one baked artifact serves every layout a deployment hands it:

* the reference's own cache (``PagedKVCache.allocate``): contiguous planes
  ``[blocks, block_size, kv_heads, head_dim]`` (token stride ``kv_heads * head_dim`` elements);
* vLLM 0.33's views (``vllm_plugin.step.kv_views``): K|V interleaved per head, token-major, so
  token stride ``kv_heads * 2 * head_dim``, head stride ``2 * head_dim`` and V = K + head_dim.

Pure Python (tensors are only asked for shape, strides, element size and address), so the
launch arguments are checked on a CPU machine. A layout K1 cannot address is one ``kv_layout``
error line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from monodecode.errors import ConfigError

# K1's scalar launch arguments for the cache strides, in signature order (32-bit words).
KV_STRIDE_ARGS = (
    "k_block_stride",
    "k_token_stride",
    "k_head_stride",
    "v_block_stride",
    "v_token_stride",
    "v_head_stride",
)
WORD_ELEMS = 2  # bf16 head dims per 32-bit word
VECTOR_BYTES = 16  # K is read 16 bytes per load (global_load_dwordx4)
MAX_STRIDE_WORDS = 2**31 - 1  # the stride arguments are i32; the offsets they make are i64


def _wide(v):
    """``v`` as a 64-bit integer of its own kind: a Python int as is, a torch tensor as int64, a
    traced FlyDSL value as ``Int64``."""
    if isinstance(v, int):
        return v
    torch = sys.modules.get("torch")  # a tensor implies torch is loaded; never import it here
    if torch is not None and isinstance(v, torch.Tensor):
        return v.to(torch.int64)
    import flydsl.expr as fx

    return fx.Int64(v)


def kv_word(block, token, head, strides):
    """Word offset of (block, token, KV head) for strides ``(block, token, head)`` in words, in 64
    bits: every factor is widened before it is multiplied.

    The kernels evaluate it on traced i32 values, the tests on Python ints and torch tensors."""
    sb, st, sh = strides
    return _wide(block) * _wide(sb) + _wide(token) * _wide(st) + _wide(head) * _wide(sh)


@dataclass(frozen=True)
class KVLaunchArgs:
    """What K1 gets for one layer's cache: the two base addresses and six word strides."""

    key_addr: int
    value_addr: int
    key_strides: tuple[int, int, int]  # (block, token, head), 32-bit words
    value_strides: tuple[int, int, int]

    def scalars(self) -> tuple[int, ...]:
        """The stride arguments in ``KV_STRIDE_ARGS`` order."""
        return (*self.key_strides, *self.value_strides)

    def named(self) -> dict[str, int]:
        return dict(zip(KV_STRIDE_ARGS, self.scalars()))


def _word_strides(name: str, t: Any, shape: tuple[int, ...]) -> tuple[int, int, int]:
    if tuple(t.shape) != shape:
        raise ConfigError(
            f"kv_layout: the {name} cache has shape {tuple(t.shape)}; flydsl K1 was built for "
            f"[blocks, block_size, kv_heads, head_dim] = [*, {shape[1]}, {shape[2]}, {shape[3]}]"
        )
    if t.element_size() != 2:
        raise ConfigError(f"kv_layout: the {name} cache has {t.element_size()}-byte elements; flydsl K1 reads bf16")
    strides = tuple(int(s) for s in t.stride())
    if strides[3] != 1:
        raise ConfigError(
            f"kv_layout: the {name} cache has head-dim stride {strides[3]}; flydsl K1 reads the "
            "head dims of a token contiguously (stride 1)"
        )
    elems = VECTOR_BYTES // 2
    if any(s < 0 or s % elems for s in strides[:3]) or t.data_ptr() % VECTOR_BYTES:
        raise ConfigError(
            f"kv_layout: the {name} cache (strides {strides}, address {t.data_ptr():#x}) is not "
            f"{VECTOR_BYTES}-byte aligned per token and head; flydsl K1 loads K/V in "
            f"{VECTOR_BYTES}-byte vectors"
        )
    words = tuple(s // WORD_ELEMS for s in strides[:3])
    if max(words) > MAX_STRIDE_WORDS:
        raise ConfigError(
            f"kv_layout: the {name} cache has strides {words} in 32-bit words; flydsl K1 takes strides "
            f"up to {MAX_STRIDE_WORDS} (i32 launch arguments)"
        )
    return words  # type: ignore[return-value]


def kv_launch_args(key: Any, value: Any, num_kv_heads: int, head_dim: int, block_size: int) -> KVLaunchArgs:
    """K1's cache arguments for one layer's key / value tensors (``ConfigError`` ``kv_layout: ...``
    when K1 cannot address them)."""
    if key.dim() != 4 or value.dim() != 4:
        raise ConfigError(
            f"kv_layout: key / value caches must be 4-D [blocks, block_size, kv_heads, head_dim], "
            f"got {tuple(key.shape)} / {tuple(value.shape)}"
        )
    shape = (int(key.shape[0]), block_size, num_kv_heads, head_dim)
    return KVLaunchArgs(
        key_addr=key.data_ptr(),
        value_addr=value.data_ptr(),
        key_strides=_word_strides("key", key, shape),
        value_strides=_word_strides("value", value, shape),
    )
