"""vLLM's CPU attention KV cache (``CPU_ATTN``), addressed through the backend's own packing.

``CPU_ATTN`` declares one layout, LBHNC: per layer a ``[blocks, kv_heads, block_size, 2 * head_dim]``
cache whose (block, head) slab holds the block's K region (``block_size * head_dim`` elements)
followed by its V region. Inside a region the order depends on the instruction set vLLM's metadata
builder chose for the layer (``_get_attn_isa``, stored as ``layer.isa``), as written by the C++
``reshape_and_cache`` of csrc/cpu/cpu_attn_{vec,amx}.hpp:

- ``vec`` and ``vec16`` (which inherits vec's writer, csrc/cpu/cpu_attn_vec16.hpp): K column-major
  (``[head_dim, block_size]``), V row-major (``[block_size, head_dim]``);
- ``amx`` (bf16 AMX tiles): K in groups of 16 tokens, each group ``[head_dim / 2, 16, 2]`` (pairs
  of head dims per token); V in groups of 16 head dims, each ``[block_size / 2, 16, 2]`` (pairs
  of tokens per head dim).

Each region is a strided view ``(tA, tB, dA, dB)`` with token ``t = a * |tB| + b`` and head dim
``d = a * |dB| + b`` (``BlockInterior``). Other instruction sets (``neon``, ``vsx``, ``vxe``,
``rvv``) have packings not verified here and are refused (``cpu_isa``).

The kernels read plain ``[blocks, block_size, kv_heads, head_dim]`` K/V, so a mono step on CPU
stages, per layer, the blocks its rows read (``StagedKV``: one gather, the same bytes the
attention reads anyway), runs the layer on the staged copy with block tables and slots renumbered
into it, and writes the rows the kernels stored back into vLLM's cache through the same views.
The staged copy lives for one layer of one step; nothing persists beside vLLM's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from monodecode.model.paged_kv import DecodeMetadata, PagedKVCache

# AMX tile geometry of vLLM's bf16 AMX attention (64-byte tile rows: 16 x 4-byte pairs)
_AMX_TOKENS_PER_K_GROUP = 16
_AMX_DIMS_PER_V_GROUP = 16
_PAIR = 2


class CpuKVError(ValueError):
    """vLLM's CPU KV cache is packed in a way mono decode cannot address (a refusal reason)."""


@dataclass(frozen=True)
class BlockInterior:
    """Element strides of one region (K or V) of a (block, head) slab, as a 4-D view
    ``(tA, tB, dA, dB)``: token ``a * sizes[1] + b``, head dim ``a * sizes[3] + b``."""

    sizes: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]


def block_interiors(
    isa: str, block_size: int, head_dim: int, dtype: torch.dtype
) -> tuple[BlockInterior, BlockInterior]:
    """(K, V) block interiors of ``CPU_ATTN``'s cache for ``isa``; ``CpuKVError`` when not addressable."""
    if isa in ("vec", "vec16"):  # vec16 (16-token tiles) inherits vec's reshape_and_cache
        key = BlockInterior((block_size, 1, head_dim, 1), (1, 1, block_size, 1))
        value = BlockInterior((block_size, 1, head_dim, 1), (head_dim, 1, 1, 1))
        return key, value
    if isa == "amx":
        if dtype != torch.bfloat16 or block_size % _AMX_TOKENS_PER_K_GROUP or head_dim % _AMX_DIMS_PER_V_GROUP:
            raise CpuKVError(
                f"cpu_isa: vLLM's AMX KV packing for {dtype}, block size {block_size}, head dim {head_dim} "
                "is not the bf16 tile layout mono decode reads"
            )
        g, p = _AMX_TOKENS_PER_K_GROUP, _PAIR
        key = BlockInterior((block_size // g, g, head_dim // p, p), (g * head_dim, p, g * p, 1))
        gd = _AMX_DIMS_PER_V_GROUP
        value = BlockInterior((block_size // p, p, head_dim // gd, gd), (gd * p, 1, block_size * gd, p))
        return key, value
    raise CpuKVError(
        f"cpu_isa: vLLM's CPU attention runs the {isa!r} instruction set, whose KV packing mono decode "
        "does not address (supported: amx, vec, vec16)"
    )


def region_view(kv: torch.Tensor, interior: BlockInterior, region: int) -> torch.Tensor:
    """``[blocks, tA, tB, kv_heads, dA, dB]`` view of region ``region`` (0 = K, 1 = V) of one
    layer's ``[blocks, kv_heads, block_size, 2 * head_dim]`` CPU cache (no copy)."""
    blocks, heads, block_size, content = kv.shape
    if kv.stride(3) != 1 or kv.stride(2) != content:
        raise CpuKVError(
            f"kv_layout: vLLM's CPU KV cache has strides {tuple(kv.stride())}; its kernels (and mono decode) "
            "read each (block, head) slab contiguously"
        )
    head_dim = content // 2
    view = kv.as_strided(
        (blocks, heads, *interior.sizes),
        (kv.stride(0), kv.stride(1), *interior.strides),
        kv.storage_offset() + region * block_size * head_dim,
    )
    return view.permute(0, 2, 3, 1, 4, 5)


@dataclass
class LayerKV:
    """One layer's K and V region views and its block size."""

    key: torch.Tensor
    value: torch.Tensor
    block_size: int

    @classmethod
    def of(cls, kv: torch.Tensor, isa: str) -> LayerKV:
        blocks, heads, block_size, content = kv.shape
        k_in, v_in = block_interiors(isa, block_size, content // 2, kv.dtype)
        return cls(region_view(kv, k_in, 0), region_view(kv, v_in, 1), block_size)

    def gather(self, view: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """``[len(blocks), block_size, kv_heads, head_dim]`` plain copy of ``blocks``."""
        g = view.index_select(0, blocks)
        n, ta, tb, h, da, db = g.shape
        return g.reshape(n, ta * tb, h, da * db)

    def scatter(self, view: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows[r, kv_heads, head_dim]`` at ``slots[r]`` (all >= 0) through ``view``."""
        tb, da, db = view.shape[2], view.shape[4], view.shape[5]
        block, offset = slots // self.block_size, slots % self.block_size
        view.index_put_((block, offset // tb, offset % tb), rows.reshape(rows.shape[0], rows.shape[1], da, db))


class StagedKV:
    """One mono step on vLLM's CPU cache: per layer, the blocks the step reads in the kernels'
    plain layout, with the step's metadata renumbered into them."""

    def __init__(self, layers: list[LayerKV], metas: list[DecodeMetadata]):
        self.layers = layers
        self.metas: list[DecodeMetadata] = []
        self._blocks: list[torch.Tensor] = []
        self._slots: list[torch.Tensor] = []  # vLLM slots of the rows that write (slot >= 0)
        self._local_slots: list[torch.Tensor] = []
        renumbered: dict[int, tuple] = {}
        for layer, meta in enumerate(metas):
            if id(meta) not in renumbered:  # one per KV-cache group
                renumbered[id(meta)] = self._renumber(meta, layers[layer].block_size)
            blocks, local_meta, slots, local_slots = renumbered[id(meta)]
            self._blocks.append(blocks)
            self.metas.append(local_meta)
            self._slots.append(slots)
            self._local_slots.append(local_slots)

    @staticmethod
    def _renumber(meta: DecodeMetadata, block_size: int):
        valid = meta.slot_mapping >= 0
        slot_blocks = torch.div(meta.slot_mapping[valid], block_size, rounding_mode="floor")
        used = torch.cat([meta.block_tables.reshape(-1).to(torch.int64), slot_blocks])
        blocks, inverse = torch.unique(used, return_inverse=True)
        n_table = meta.block_tables.numel()
        tables = inverse[:n_table].reshape(meta.block_tables.shape).to(torch.int32)
        local_slots = inverse[n_table:] * block_size + meta.slot_mapping[valid] % block_size
        slot_mapping = torch.full_like(meta.slot_mapping, -1)
        slot_mapping[valid] = local_slots
        local = DecodeMetadata(meta.positions, slot_mapping, tables, meta.seq_lens)
        return blocks, local, meta.slot_mapping[valid], local_slots

    def stage(self, layer: int, num_layers: int) -> PagedKVCache:
        """Layer ``layer``'s staged K/V, at index ``layer`` of a cache the kernels index by layer."""
        src, blocks = self.layers[layer], self._blocks[layer]
        key, value = src.gather(src.key, blocks), src.gather(src.value, blocks)
        return PagedKVCache(key=[key] * num_layers, value=[value] * num_layers, block_size=src.block_size)

    def commit(self, layer: int, staged: PagedKVCache) -> None:
        """Write the rows the kernels stored in ``staged`` back into vLLM's cache."""
        src, local = self.layers[layer], self._local_slots[layer]
        if local.numel() == 0:
            return
        bs = src.block_size
        k = staged.key[layer][local // bs, local % bs]
        v = staged.value[layer][local // bs, local % bs]
        src.scatter(src.key, self._slots[layer], k)
        src.scatter(src.value, self._slots[layer], v)
