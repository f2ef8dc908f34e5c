"""The MFMA GEMV tiles' bookkeeping computes y = W x, checked by emulation on the CPU.

The FlyDSL kernels (``kernels._gemv_mfma``) place every operand with the helpers in
``config`` (``mfma_lane``, ``mfma_k_elem``, ``mfma_weight_row``, ``mfma_part``). This test walks
the same helpers for every wave, K block and lane of a task, applies the 16x16 MFMA's
documented register layout (CDNA3 ``v_mfma_f32_16x16x16_bf16``: A[i][k] in lane i + 16*(k//4),
element k%4; B[k][j] in lane j + 16*(k//4); D[i][j] in lane j + 16*(i//4), element i%4; CDNA4
``16x16x32``: the same with K groups of 8), and checks the epilogue's sums against W @ x for
every stage shape the plan gives at widths 4..16, bf16 and fp8 (16 K elements per lane). It does
not stand in for running on the GPU: it catches index bookkeeping errors, not hardware ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from monodecode.kernels.flydsl.arch import ARCHS, WAVES_PER_WORKGROUP
from monodecode.kernels.flydsl.config import (
    MFMA_ROWS,
    mfma_k_elem,
    mfma_lane,
    mfma_part,
    mfma_weight_row,
    plan_geometry,
)
from monodecode.model.profiles import profile_dims

LANES = 64


def mfma(a_lanes: np.ndarray, b_lanes: np.ndarray, group: int) -> np.ndarray:
    """D (16x16) of one MFMA from per-lane operands ``[64, group]`` (documented layout)."""
    A = np.zeros((MFMA_ROWS, 4 * group))
    B = np.zeros((4 * group, MFMA_ROWS))
    for lane in range(LANES):
        for item in range(group):
            k = (lane // MFMA_ROWS) * group + item
            A[lane % MFMA_ROWS, k] = a_lanes[lane, item]
            B[k, lane % MFMA_ROWS] = b_lanes[lane, item]
    return A @ B


def d_of_lane(D: np.ndarray, lane: int, e: int) -> float:
    return D[4 * (lane // MFMA_ROWS) + e, lane % MFMA_ROWS]


def emulate_task(tile, arch: str, weights: np.ndarray, x: np.ndarray, n0: int) -> np.ndarray:
    """y[p, row, token] of one task, computed the way the kernel lays it out."""
    st, width = tile.stage, tile.width
    tiles, ks_ways = tile.tiles, tile.k_split
    per_wave = tiles * ks_ways // WAVES_PER_WORKGROUP
    group = 8 if arch == "gfx950" else 4  # K elements per lane per MFMA
    nblk = tile.k_pad // tile.kblock
    part = np.zeros(ks_ways * tiles * MFMA_ROWS * width)
    for wave in range(WAVES_PER_WORKGROUP):
        ks, tg = wave % ks_ways, wave // ks_ways
        for j in range(per_wave):
            t = tg * per_wave + j
            acc = np.zeros((MFMA_ROWS, MFMA_ROWS))
            for b in range(ks, nblk, ks_ways):
                a = np.zeros((LANES, tile.vec))
                bx = np.zeros((LANES, tile.vec))
                for lane in range(LANES):
                    rin, kq = mfma_lane(lane)
                    k0 = mfma_k_elem(b, kq, tile.vec)
                    a[lane] = weights[mfma_weight_row(n0, t, rin, tile.pair, st.n), k0 : k0 + tile.vec]
                    bx[lane] = x[min(rin, width - 1), k0 : k0 + tile.vec]  # padded columns read a real row
                for half in range(tile.vec // group):  # 8 bf16: 1 (gfx950) or 2 MFMAs; 16 fp8: 2 or 4
                    sl = slice(half * group, (half + 1) * group)
                    acc += mfma(a[:, sl], bx[:, sl], group)
            for lane in range(LANES):
                rin, kq = mfma_lane(lane)
                if rin < width:
                    for e in range(4):
                        part[mfma_part(ks, t, 4 * kq + e, rin, tiles, width)] = d_of_lane(acc, lane, e)
    out = np.zeros((tile.pair, st.rows, width))
    for rr in range(st.rows):
        for tk in range(width):
            for p in range(tile.pair):
                t = (rr // MFMA_ROWS) * tile.pair + p
                out[p, rr, tk] = sum(part[mfma_part(kk, t, rr % MFMA_ROWS, tk, tiles, width)] for kk in range(ks_ways))
    return out


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("width, weight_dtype", [(2, "bf16"), (3, "fp8"), (8, "fp8"), (13, "bf16"), (16, "fp8")])
def test_mfma_tiles_compute_the_gemv(arch, width, weight_dtype):
    rng = np.random.default_rng(width)
    g = plan_geometry(profile_dims("tiny"), width, ARCHS[arch], weight_dtype)
    shapes = set()
    for name, tile in g.tiles.items():
        assert tile.mfma, name
        st = tile.stage
        key = (st.rows, tile.pair, tile.k_split)
        if key in shapes:
            continue
        shapes.add(key)
        k = tile.k_pad  # the LDS tail past K is zero: emulate on whole blocks
        weights = rng.integers(-3, 4, size=(st.n * tile.pair, k)).astype(np.float64)
        x = rng.integers(-3, 4, size=(width, k)).astype(np.float64)
        n0 = st.rows * (st.tasks // 2)  # an interior task
        got = emulate_task(tile, arch, weights, x, n0)
        for p in range(tile.pair):
            want = weights[p * st.n + n0 : p * st.n + n0 + st.rows] @ x.T
            np.testing.assert_array_equal(got[p], want, err_msg=f"{name} matrix {p}")
    assert {ks for _, _, ks in shapes} >= {1, 2} or {ks for _, _, ks in shapes} >= {4}
