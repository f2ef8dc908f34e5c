"""The MFMA GEMV tiles' bookkeeping computes y = W x, checked by emulation on the CPU.

The FlyDSL kernels (``kernels._gemv_mfma``) place every operand with the helpers in
``config`` (``mfma_lane``, ``mfma_k_elem``, ``mfma_weight_row``, ``mfma_part``). This test walks
the same helpers for every wave, K block and lane of a task, applies the 16x16 MFMA's
documented register layout (CDNA3 ``v_mfma_f32_16x16x16_bf16``: A[i][k] in lane i + 16*(k//4),
element k%4; B[k][j] in lane j + 16*(k//4); D[i][j] in lane j + 16*(i//4), element i%4; CDNA4
``16x16x32``: the same with K groups of 8), and checks the epilogue's sums against W @ x for
every stage shape the plan gives at widths 2..16, bf16 and fp8 (16 K elements per lane), tasks
cut to even waves and stages split along K included (``config.task_origin``). It does not stand
in for running on the GPU: it catches index bookkeeping errors, not hardware ones.
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
    task_origin,
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


def emulate_task(tile, arch: str, weights: np.ndarray, x: np.ndarray, t: int) -> np.ndarray:
    """y[p, row, token] of task ``t``'s own rows, computed the way the kernel lays it out: its
    origin from ``task_origin``, tile rows past its own (even waves) or past N loading its last
    row, K clamped to the weight row, the staged inputs zero from its K slice's end."""
    st, width = tile.stage, tile.width
    tiles, ks_ways = tile.tiles, tile.k_split
    per_wave = tiles * ks_ways // WAVES_PER_WORKGROUP
    group = 8 if arch == "gfx950" else 4  # K elements per lane per MFMA
    nblk = tile.k_pad // tile.kblock
    n0, k0, _ = task_origin(t, st)
    last = min(n0 + st.rows - 1, st.n - 1)
    staged = np.zeros((width, tile.k_pad))  # the LDS: the slice's inputs, zero past its end
    staged[:, : st.k_task] = x[:, k0 : k0 + st.k_task]
    part = np.zeros(ks_ways * tiles * MFMA_ROWS * width)
    for wave in range(WAVES_PER_WORKGROUP):
        ks, tg = wave % ks_ways, wave // ks_ways
        for j in range(per_wave):
            tt = tg * per_wave + j
            acc = np.zeros((MFMA_ROWS, MFMA_ROWS))
            for b in range(ks, nblk, ks_ways):
                a = np.zeros((LANES, tile.vec))
                bx = np.zeros((LANES, tile.vec))
                for lane in range(LANES):
                    rin, kq = mfma_lane(lane)
                    kl = mfma_k_elem(b, kq, tile.vec)
                    kg = min(k0 + kl, st.k - tile.vec)
                    rin = min(rin, last - n0 - (tt // tile.pair) * MFMA_ROWS)
                    a[lane] = weights[mfma_weight_row(n0, tt, rin, tile.pair, st.n), kg : kg + tile.vec]
                    bx[lane] = staged[
                        min(lane % MFMA_ROWS, width - 1), kl : kl + tile.vec
                    ]  # padded columns: a real row
                for half in range(tile.vec // group):  # 8 bf16: 1 (gfx950) or 2 MFMAs; 16 fp8: 2 or 4
                    sl = slice(half * group, (half + 1) * group)
                    acc += mfma(a[:, sl], bx[:, sl], group)
            for lane in range(LANES):
                rin, kq = mfma_lane(lane)
                if rin < width:
                    for e in range(4):
                        part[mfma_part(ks, tt, 4 * kq + e, rin, tiles, width)] = d_of_lane(acc, lane, e)
    own = min(st.rows, st.n - n0)
    out = np.zeros((tile.pair, own, width))
    for rr in range(own):
        for tk in range(width):
            for p in range(tile.pair):
                tt = (rr // MFMA_ROWS) * tile.pair + p
                out[p, rr, tk] = sum(part[mfma_part(kk, tt, rr % MFMA_ROWS, tk, tiles, width)] for kk in range(ks_ways))
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
        key = (st.rows, st.tile, st.k_splits, tile.pair, tile.k_split)
        if key in shapes:
            continue
        shapes.add(key)
        weights = rng.integers(-3, 4, size=(st.n * tile.pair, st.k)).astype(np.float64)
        x = rng.integers(-3, 4, size=(width, st.k)).astype(np.float64)
        # an interior task of the last K slice, and the stage's last task (rows past N)
        for t in sorted({st.tasks - st.row_tiles // 2 - 1, st.tasks - 1}):
            got = emulate_task(tile, arch, weights, x, t)
            n0, k0, _ = task_origin(t, st)
            for p in range(tile.pair):
                rows = weights[p * st.n + n0 : p * st.n + n0 + got.shape[1], k0 : k0 + st.k_task]
                np.testing.assert_array_equal(
                    got[p], rows @ x[:, k0 : k0 + st.k_task].T, err_msg=f"{name} task {t} matrix {p}"
                )
    # the plan's wide knobs are exercised: tasks cut to even waves and stages split along K
    assert any(rows < tile_rows for rows, tile_rows, *_ in shapes) and any(splits > 1 for _, _, splits, *_ in shapes)
    assert {ks for *_, ks in shapes} >= {1, 2} or {ks for *_, ks in shapes} >= {4}
