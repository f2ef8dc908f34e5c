"""Paged KV cache in vLLM's flash layout, the per-step decode metadata, and a block allocator.

Layout: per layer ``key[l]`` / ``value[l]`` of shape ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat *slot* is ``block * block_size + offset``. A decode step hands the
kernels one ``DecodeMetadata``: per row the new token's position, its slot, the sequence's block
table and its length including the new token. A row with slot ``-1`` is padding: it writes
nothing and its output is ignored.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from monodecode.errors import MonodecodeError
from monodecode.model.dims import ModelDims


@dataclass
class PagedKVCache:
    key: list[torch.Tensor]
    value: list[torch.Tensor]
    block_size: int

    @classmethod
    def allocate(
        cls,
        dims: ModelDims,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        num_layers: int | None = None,
    ) -> PagedKVCache:
        """Zero-filled cache for ``num_layers`` (default: all) layers."""
        if num_blocks < 1 or block_size < 1:
            raise MonodecodeError(f"KV cache: num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        n = dims.num_layers if num_layers is None else num_layers
        shape = (num_blocks, block_size, dims.num_kv_heads, dims.head_dim)
        return cls(
            key=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
            value=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
            block_size=block_size,
        )

    @property
    def num_blocks(self) -> int:
        return self.key[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.key[0].dtype

    @property
    def device(self) -> torch.device:
        return self.key[0].device


@dataclass
class DecodeMetadata:
    """One step's rows. ``seq_lens`` counts the context INCLUDING the row's new token."""

    positions: torch.Tensor  # [rows] int64
    slot_mapping: torch.Tensor  # [rows] int64, -1 = padded row
    block_tables: torch.Tensor  # [rows, max_blocks] int32
    seq_lens: torch.Tensor  # [rows] int32

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def to(self, device) -> DecodeMetadata:
        return DecodeMetadata(
            self.positions.to(device),
            self.slot_mapping.to(device),
            self.block_tables.to(device),
            self.seq_lens.to(device),
        )

    def pad_to(self, width: int) -> DecodeMetadata:
        """Append inert rows (position 0, slot -1, empty block table, length 0) up to ``width``."""
        rows = self.num_rows
        if width < rows:
            raise MonodecodeError(f"cannot pad {rows} decode rows down to width {width}")
        extra = width - rows
        if extra == 0:
            return self
        dev = self.positions.device
        return DecodeMetadata(
            positions=torch.cat([self.positions, torch.zeros(extra, dtype=torch.int64, device=dev)]),
            slot_mapping=torch.cat([self.slot_mapping, torch.full((extra,), -1, dtype=torch.int64, device=dev)]),
            block_tables=torch.cat(
                [self.block_tables, torch.zeros(extra, self.max_blocks, dtype=torch.int32, device=dev)]
            ),
            seq_lens=torch.cat([self.seq_lens, torch.zeros(extra, dtype=torch.int32, device=dev)]),
        )


class BlockAllocator:
    """Hands out KV blocks to sequences and builds the metadata of prefill and decode steps.

    ``shuffle_seed`` hands blocks out in a seeded random order instead of ascending order (tests use
    it to show results do not depend on where blocks live).
    """

    def __init__(self, num_blocks: int, block_size: int, shuffle_seed: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise MonodecodeError(f"KV cache: num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        free = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(free)
        self._free = free[::-1]  # pop() from the end hands out free[0] first
        self._tables: dict[object, list[int]] = {}
        self._lens: dict[object, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def seq_len(self, seq_id) -> int:
        return self._lens[seq_id]

    def block_table(self, seq_id) -> list[int]:
        return list(self._tables[seq_id])

    def free(self, seq_id) -> None:
        """Return a sequence's blocks."""
        self._free.extend(reversed(self._tables.pop(seq_id)))
        del self._lens[seq_id]

    def append_slots(self, seq_id, n: int) -> list[int]:
        """Reserve slots for ``n`` more tokens of ``seq_id`` (a new id starts a sequence)."""
        table = self._tables.setdefault(seq_id, [])
        length = self._lens.setdefault(seq_id, 0)
        slots = []
        for t in range(length, length + n):
            if t // self.block_size >= len(table):
                if not self._free:
                    raise MonodecodeError(
                        f"KV cache full: all {self.num_blocks} blocks of {self.block_size} tokens are in use"
                    )
                table.append(self._free.pop())
            slots.append(table[t // self.block_size] * self.block_size + t % self.block_size)
        self._lens[seq_id] = length + n
        return slots

    def _tables_tensor(self, tables: list[list[int]], max_blocks: int | None, device) -> torch.Tensor:
        width = max(len(t) for t in tables)
        if max_blocks is not None:
            if max_blocks < width:
                raise MonodecodeError(f"block table needs {width} blocks, more than max_blocks={max_blocks}")
            width = max_blocks
        out = torch.zeros(len(tables), width, dtype=torch.int32)
        for r, t in enumerate(tables):
            out[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(device)

    def prefill_metadata(self, seq_id, num_tokens: int, max_blocks: int | None = None, device="cpu") -> DecodeMetadata:
        """Rows for ``num_tokens`` new tokens of one sequence (each row sees the tokens before it)."""
        start = self._lens.get(seq_id, 0)
        slots = self.append_slots(seq_id, num_tokens)
        table = self._tables[seq_id]
        positions = torch.arange(start, start + num_tokens, dtype=torch.int64)
        return DecodeMetadata(
            positions=positions.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=self._tables_tensor([table] * num_tokens, max_blocks, device),
            seq_lens=(positions + 1).to(dtype=torch.int32, device=device),
        )

    def decode_metadata(self, seq_ids: list, max_blocks: int | None = None, device="cpu") -> DecodeMetadata:
        """One row per sequence: reserves the slot of each sequence's next token."""
        if len(set(seq_ids)) != len(seq_ids):
            raise MonodecodeError("decode step lists a sequence twice")
        positions, slots, tables = [], [], []
        for sid in seq_ids:
            positions.append(self._lens.get(sid, 0))
            slots.extend(self.append_slots(sid, 1))
            tables.append(self._tables[sid])
        pos = torch.tensor(positions, dtype=torch.int64)
        return DecodeMetadata(
            positions=pos.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=self._tables_tensor(tables, max_blocks, device),
            seq_lens=(pos + 1).to(dtype=torch.int32, device=device),
        )


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, new: torch.Tensor) -> None:
    """Store ``new[rows, kv_heads, head_dim]`` at ``slot_mapping`` in ``cache[blocks, bs, kv_heads, hd]``.

    Rows with slot -1 write nothing. No host sync and fixed shapes (capturable in a CUDA graph):
    a padded row rewrites the slot of the first valid row with that row's own value (or, when no
    row is valid, slot 0 with its current value), so duplicate indices always carry equal values.
    Valid slots of one step must be distinct.
    """
    block_size = cache.shape[1]
    valid = slot_mapping >= 0
    # 1-element index tensors, not 0-d ones: indexing with a 0-d device tensor syncs the host.
    donor = torch.argmax(valid.to(torch.int32)).view(1)  # first valid row, or 0 when none is valid
    donor_valid = valid.index_select(0, donor)
    donor_slot = torch.where(donor_valid, slot_mapping.index_select(0, donor), torch.zeros_like(donor))
    current = cache[donor_slot // block_size, donor_slot % block_size]  # [1, kv_heads, head_dim]
    donor_value = torch.where(donor_valid[:, None, None], new.index_select(0, donor).to(cache.dtype), current)
    index = torch.where(valid, slot_mapping, donor_slot)
    value = torch.where(valid[:, None, None], new.to(cache.dtype), donor_value)
    # (block, offset) indexing writes through any strided view, e.g. vLLM's interleaved K|V cache.
    cache.index_put_((index // block_size, index % block_size), value)


def uncached_slots(meta: DecodeMetadata, num_blocks: int, block_size: int) -> torch.Tensor:
    """``[num_blocks, block_size]`` bool: the slots no row of ``meta`` has cached (each row's
    positions before its new token are cached): its blocks' later slots, the new tokens' slots and
    every block no row holds (vLLM's null block, which a table's padding points at, among them)."""
    cached = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    tables, lens = meta.block_tables.cpu().long(), meta.seq_lens.cpu().long()
    for r in range(tables.shape[0]):
        pos = torch.arange(max(int(lens[r]) - 1, 0))
        cached[tables[r][pos // block_size], pos % block_size] = True
    return ~cached


def poison_uncached(kv: PagedKVCache, meta: DecodeMetadata) -> None:
    """NaN into every slot no row of ``meta`` has cached, in every layer's K and V (any strided
    view): a kernel that lets such a slot into a sum returns NaN, as stale cache contents
    (a finished sequence's, the null block's) would poison a served row."""
    blocks = kv.key[0].shape[0]
    unseen = uncached_slots(meta, blocks, kv.block_size).to(kv.key[0].device)
    for t in (*kv.key, *kv.value):
        t[unseen] = float("nan")
