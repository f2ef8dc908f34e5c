"""The (16, 16) preshuffle map (``monodecode/model/preshuffle.py``) against AITER's own
``shuffle_weight``, loaded from the amd-aiter sources (tests/aiter_sources.py), both ways, for
every dtype AITER's GEMMs preshuffle: bf16 and FP8 e4m3 (OCP and gfx942's FNUZ)."""

from __future__ import annotations

import pytest
import torch
from aiter_sources import shuffle_weight

from monodecode.model.preshuffle import PreshuffleError, shuffled, unshuffled

DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz]
SHAPES = [(16, 32), (48, 64), (32, 160)]
GEN = torch.Generator().manual_seed(0)


def _random_bits(shape, dtype) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (compared as raw bytes, so NaN patterns are fine)."""
    raw = torch.randint(0, 256, (shape[0], shape[1] * dtype.itemsize), dtype=torch.uint8, generator=GEN)
    return raw.view(dtype)


def _where_aiter_puts(shape, dtype) -> torch.Tensor:
    """For each flat index of AITER's shuffled buffer, the flat index of the row-major element
    it holds: positions carried through ``shuffle_weight`` one byte at a time in ``dtype``'s width
    (the shuffle depends on the element size only)."""
    n = shape[0] * shape[1]
    pos = torch.arange(n, dtype=torch.int64)
    out = torch.zeros(n, dtype=torch.int64)
    for byte in range(3):  # positions < 2**24
        digit = ((pos >> (8 * byte)) & 0xFF).to(torch.uint8)
        if dtype.itemsize == 2:
            digit = digit.to(torch.int16)  # one position digit per 2-byte element
        moved = shuffle_weight()(digit.view(dtype).reshape(shape), layout=(16, 16))
        out |= moved.reshape(-1).view(torch.int16 if dtype.itemsize == 2 else torch.uint8).to(torch.int64) << (8 * byte)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_map_is_aiters_shuffle_both_ways(shape, dtype):
    w = _random_bits(shape, dtype)
    by_aiter = shuffle_weight()(w.clone(), layout=(16, 16))
    assert by_aiter.shape == w.shape and by_aiter.dtype == dtype
    assert not torch.equal(by_aiter.view(torch.uint8), w.view(torch.uint8))  # the shuffle moves elements
    assert torch.equal(shuffled(w).view(torch.uint8), by_aiter.view(torch.uint8))
    assert torch.equal(unshuffled(by_aiter).view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_index_map_places_every_element_as_aiter_does(dtype):
    """Element (n, k) of the row-major matrix is at the flat index the module's docstring gives,
    in AITER's shuffled buffer."""
    rows, cols = 32, 96
    pack = 16 // dtype.itemsize
    n, k = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    flat = ((n // 16) * (cols // 32) + k // 32) * 512 + ((k % 32) // pack) * 16 * pack + (n % 16) * pack + k % pack
    by_formula = torch.empty(rows * cols, dtype=torch.int64)
    by_formula[flat.reshape(-1)] = torch.arange(rows * cols)
    assert torch.equal(_where_aiter_puts((rows, cols), dtype), by_formula)


@pytest.mark.parametrize(
    "w, needle",
    [
        (torch.zeros(24, 32, dtype=torch.bfloat16), "N a multiple of 16"),
        (torch.zeros(16, 48, dtype=torch.bfloat16), "K a multiple of 32"),
        (torch.zeros(16, 32, dtype=torch.float32), "1- or 2-byte elements"),
        (torch.zeros(2, 16, 32, dtype=torch.bfloat16), "is 2-D [N, K]"),
    ],
)
def test_a_tensor_the_preshuffle_cannot_describe_is_one_line(w, needle):
    for fn in (shuffled, unshuffled):
        with pytest.raises(PreshuffleError) as e:
            fn(w)
        assert needle in str(e.value) and "\n" not in str(e.value)
