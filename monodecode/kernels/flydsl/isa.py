"""Resource figures of a compiled code object and the budgets a persistent kernel must meet.

Figures come from the hsaco's AMDGPU metadata note (``llvm-readelf --notes``): registers, spills,
scratch, static LDS, workgroup size, target. A persistent megakernel must have: no VGPR/SGPR
spills, no scratch (``private_segment_fixed_size == 0``, no dynamic stack), static LDS within the
arch's per-workgroup limit, registers that still allow the planned waves per SIMD, and a grid no
wider than the CUs (so every workgroup is resident and mailbox waits cannot deadlock).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from monodecode.errors import ArtifactError
from monodecode.kernels.flydsl.arch import WORKGROUP_SIZE, ArchSpec, planned_waves_per_simd
from monodecode.kernels.flydsl.toolchain import readelf

_FIELDS = {
    ".name": "name",
    ".vgpr_count": "vgprs",
    ".agpr_count": "agprs",
    ".sgpr_count": "sgprs",
    ".vgpr_spill_count": "vgpr_spills",
    ".sgpr_spill_count": "sgpr_spills",
    ".group_segment_fixed_size": "lds_bytes",
    ".private_segment_fixed_size": "scratch_bytes",
    ".max_flat_workgroup_size": "workgroup_size",
    ".wavefront_size": "wave_size",
    ".uses_dynamic_stack": "dynamic_stack",
}


@dataclass(frozen=True)
class KernelResources:
    name: str
    target: str
    vgprs: int
    agprs: int
    sgprs: int
    vgpr_spills: int
    sgpr_spills: int
    lds_bytes: int
    scratch_bytes: int
    workgroup_size: int
    wave_size: int
    dynamic_stack: bool

    def to_dict(self) -> dict:
        return asdict(self)


def read_resources(hsaco: Path) -> KernelResources:
    """Parse the metadata note of a single-kernel code object."""
    proc = subprocess.run([readelf(), "--notes", str(hsaco)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ArtifactError(f"flydsl: llvm-readelf failed on {hsaco}: {proc.stderr.strip()[:200]}")
    return parse_notes(proc.stdout, str(hsaco))


def parse_notes(text: str, where: str = "code object") -> KernelResources:
    vals: dict[str, object] = {}
    for line in text.splitlines():
        m = re.match(r"^\s*-?\s*(\.[a-z_]+):\s+(\S+)\s*$", line)
        if m and m.group(1) in _FIELDS and _FIELDS[m.group(1)] not in vals:
            vals[_FIELDS[m.group(1)]] = m.group(2)
    target = re.search(r"amdhsa\.target:\s+(\S+)", text)
    missing = [f for f in _FIELDS.values() if f not in vals]
    if missing or not target:
        raise ArtifactError(f"flydsl: {where} metadata lacks {', '.join(missing) or 'amdhsa.target'}")
    ints = {k: int(v) for k, v in vals.items() if k not in ("name", "dynamic_stack")}
    return KernelResources(
        name=str(vals["name"]), target=target.group(1), dynamic_stack=vals["dynamic_stack"] == "true", **ints
    )


def budget_violations(res: KernelResources, spec: ArchSpec, grid: int) -> list[str]:
    """Every way ``res`` breaks the persistent-kernel budget on ``spec`` (empty = fits)."""
    out = []
    if not res.target.endswith(spec.arch):
        out.append(f"compiled for {res.target}, expected {spec.arch}")
    if res.vgpr_spills or res.sgpr_spills:
        out.append(f"register spills (vgpr {res.vgpr_spills}, sgpr {res.sgpr_spills})")
    if res.scratch_bytes or res.dynamic_stack:
        out.append(f"scratch memory ({res.scratch_bytes} bytes, dynamic stack {res.dynamic_stack})")
    if res.lds_bytes > spec.lds_bytes:
        out.append(f"static LDS {res.lds_bytes} B > {spec.lds_bytes} B")
    waves = spec.waves_per_simd(res.vgprs, res.agprs)
    if waves < planned_waves_per_simd():
        out.append(
            f"{res.vgprs}+{res.agprs} VGPR/AGPR allow {waves} waves per SIMD, planned {planned_waves_per_simd()}"
        )
    if res.sgprs > spec.max_sgprs:
        out.append(f"{res.sgprs} SGPRs > {spec.max_sgprs}")
    if res.wave_size != 64:
        out.append(f"wave size {res.wave_size}, expected 64")
    if res.workgroup_size < WORKGROUP_SIZE:
        out.append(f"max workgroup size {res.workgroup_size} < {WORKGROUP_SIZE}")
    if grid > spec.compute_units:
        out.append(f"grid {grid} > {spec.compute_units} CUs")
    return out


def figures(res: KernelResources, spec: ArchSpec, grid: int) -> dict:
    """The row printed per kernel and arch, and stored in the golden file."""
    return {
        "vgprs": res.vgprs,
        "agprs": res.agprs,
        "sgprs": res.sgprs,
        "spills": res.vgpr_spills + res.sgpr_spills,
        "scratch": res.scratch_bytes,
        "lds": res.lds_bytes,
        "lds_limit": spec.lds_bytes,
        "waves_per_simd": spec.waves_per_simd(res.vgprs, res.agprs),
        "grid": grid,
        "cus": spec.compute_units,
    }
