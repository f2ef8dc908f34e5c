"""CDNA facts the FlyDSL kernels are planned against (pure Python; no FlyDSL import).

One workgroup per CU, all resident: the persistent grid is exactly ``compute_units`` wide, so a
node that shows fewer CUs (a CPX/partitioned GPU) is refused instead of deadlocking on mailboxes
that a non-resident workgroup would never fill.
"""

from __future__ import annotations

from dataclasses import dataclass

from monodecode.errors import ConfigError

WAVE_SIZE = 64
WAVES_PER_WORKGROUP = 4  # 256 threads: one wave per SIMD of the CU
WORKGROUP_SIZE = WAVE_SIZE * WAVES_PER_WORKGROUP


@dataclass(frozen=True)
class ArchSpec:
    arch: str
    product: str
    compute_units: int  # full-chip CUs (SPX); the persistent grid size
    lds_bytes: int  # LDS per workgroup
    fp8_kind: str  # weight kind the hardware decodes: "fp8_fnuz" (gfx942) or "fp8" (OCP, gfx950)
    fp8_max: float
    vgprs_per_simd_lane: int = 512  # unified VGPR+AGPR file per lane
    vgpr_granule: int = 8
    max_waves_per_simd: int = 8
    max_sgprs: int = 102
    # Share of LDS the GEMV stages stage normalised activations in; the rest holds
    # per-row partials, attention tiles and the softmax merge.
    x_stage_bytes: int = 0

    def waves_per_simd(self, vgprs: int, agprs: int = 0) -> int:
        """Occupancy limit from registers (gfx90a+ unified file: arch VGPRs rounded to 4, then AGPRs)."""
        total = -(-vgprs // 4) * 4 + agprs
        alloc = max(self.vgpr_granule, -(-total // self.vgpr_granule) * self.vgpr_granule)
        return min(self.max_waves_per_simd, self.vgprs_per_simd_lane // alloc)


ARCHS: dict[str, ArchSpec] = {
    "gfx942": ArchSpec("gfx942", "MI300X/MI325X", 304, 64 * 1024, "fp8_fnuz", 240.0, x_stage_bytes=32 * 1024),
    "gfx950": ArchSpec("gfx950", "MI350X/MI355X", 256, 160 * 1024, "fp8", 448.0, x_stage_bytes=96 * 1024),
}


def arch_spec(arch: str) -> ArchSpec:
    if arch not in ARCHS:
        raise ConfigError(f"flydsl: unsupported GPU arch {arch!r}; supported: {', '.join(ARCHS)}")
    return ARCHS[arch]


def planned_waves_per_simd() -> int:
    """One workgroup of WAVES_PER_WORKGROUP waves per CU, 4 SIMDs per CU."""
    return max(1, WAVES_PER_WORKGROUP // 4)
