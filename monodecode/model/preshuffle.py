"""AITER's (16, 16) weight preshuffle as an index map, both ways.

AITER's GEMMs on MI300X / MI355X (vLLM's ``Aiter*`` scaled-mm kernels with ``VLLM_ROCM_USE_AITER=1``)
read a weight ``W[N, K]`` (N output channels, K inputs) rearranged so that each 16-row x 32-column
tile is one contiguous run, laid out for the matrix cores' operand loads. With ``pack = 16 bytes /
element size`` (8 for bf16, 16 for fp8), element ``(n, k)`` sits at flat index

    ((n // 16) * (K // 32) + k // 32) * 512 + ((k % 32) // pack) * 16 * pack + (n % 16) * pack + k % pack

of a buffer that keeps the shape ``[N, K]``: the tiles of one 16-row band in K order, inside a
tile the 16-byte vectors of the 16 rows for each vector column in turn. The map is derived from
AITER's ``aiter.ops.shuffle.shuffle_weight(x, layout=(16, 16))`` and tested against it both ways
(tests/model/test_preshuffle.py). Pure torch; ``unshuffled`` is the row-major copy the kernels
read, ``shuffled`` its inverse.
"""

from __future__ import annotations

import torch

from monodecode.errors import MonodecodeError

TILE_ROWS = 16  # rows of one tile (AITER's layout[0])
TILE_COLS = 32  # columns of one tile (2 * AITER's layout[1])
VECTOR_BYTES = 16  # one operand load per row and vector column


class PreshuffleError(MonodecodeError):
    """A tensor that the (16, 16) preshuffle cannot describe."""


def _pack(w: torch.Tensor) -> int:
    if w.dim() != 2:
        raise PreshuffleError(f"a preshuffled weight is 2-D [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    size = w.element_size()
    if size not in (1, 2) or n % TILE_ROWS or k % TILE_COLS:
        raise PreshuffleError(
            f"weight {tuple(w.shape)} of {w.dtype} is not a (16, 16) preshuffle: it needs 1- or 2-byte "
            f"elements, N a multiple of {TILE_ROWS} and K a multiple of {TILE_COLS}"
        )
    return VECTOR_BYTES // size


def unshuffled(w: torch.Tensor) -> torch.Tensor:
    """The row-major ``[N, K]`` matrix of a (16, 16)-preshuffled ``w`` (a new contiguous tensor)."""
    pack = _pack(w)
    n, k = w.shape
    tiles = w.contiguous().view(n // TILE_ROWS, k // TILE_COLS, TILE_COLS // pack, TILE_ROWS, pack)
    return tiles.permute(0, 3, 1, 2, 4).reshape(n, k)


def shuffled(w: torch.Tensor) -> torch.Tensor:
    """The (16, 16) preshuffle of a row-major ``[N, K]`` ``w`` (``unshuffled``'s inverse)."""
    pack = _pack(w)
    n, k = w.shape
    rows = w.contiguous().view(n // TILE_ROWS, TILE_ROWS, k // TILE_COLS, TILE_COLS // pack, pack)
    return rows.permute(0, 2, 3, 1, 4).reshape(n, k)
