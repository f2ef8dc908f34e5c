"""The Triton K1/K2 compile for AMD CDNA3 (gfx942) and CDNA4 (gfx950) on a CPU machine.

``triton.compile(ASTSource(...), target=GPUTarget("hip", arch, 64))`` lowers the same sources,
constants and argument order the GPU launcher uses (``kernels/triton/offline.py``). From the
code object's AMDGPU metadata we assert: no VGPR spills and no scratch (private segment) memory,
LDS (static + Triton's dynamic allocation) within the arch's limit (64 KiB gfx942, 160 KiB
gfx950), and registers that leave room for at least one resident workgroup per CU at the planned
block size (4 wave64 waves = 256 lanes, one wave per SIMD). SGPR spills go to VGPR lanes (no
memory traffic) and are recorded, not forbidden. The figures are printed as a table and compared
with ``tests/kernels/golden/triton_amd_budgets.json``: a change that worsens any of them fails here and
shows in review (regenerate with ``MONODECODE_UPDATE_GOLDEN=1``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is installed by the project's 'triton' extra (make test)")

from monodecode.kernels.triton.config import HIP  # noqa: E402
from monodecode.kernels.triton.offline import LDS_LIMIT, compile_width  # noqa: E402
from monodecode.model.profiles import profile_dims  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "triton_amd_budgets.json"
# (profile, weight dtype per arch, widths): the tiny model in bf16 and an 8B class in FP8
CASES = [
    ("tiny", {"gfx942": "bf16", "gfx950": "bf16"}, (1, 8)),
    ("llama3-8b", {"gfx942": "fp8_fnuz", "gfx950": "fp8"}, (1, 8)),
]
ARCHS = ("gfx942", "gfx950")
FIELDS = ("regs", "sgprs", "spills", "vector_spills", "scratch_bytes", "lds_bytes", "workgroups_per_cu")


@pytest.fixture(scope="module")
def figures() -> dict:
    out = {}
    for arch in ARCHS:
        for profile, dtypes, widths in CASES:
            for w in widths:
                for r in compile_width(
                    profile_dims(profile),
                    dtypes[arch],
                    w,
                    arch,
                    HIP,
                    block_size=16,
                    num_programs=304 if arch == "gfx942" else 256,
                ):
                    out[f"{arch}/{profile}/{dtypes[arch]}/w{w}/{r.kernel}"] = r.to_dict()
    print("\nTriton K1/K2 on AMD (compile only, wave64, num_warps=%d)" % HIP.num_warps)
    print(
        f"{'kernel':44} {'vgpr+agpr':>9} {'sgpr':>5} {'sgpr spill':>10} {'scratch':>7} {'LDS':>7} {'limit':>7} {'WG/CU':>5}"
    )
    for key, r in out.items():
        print(
            f"{key:44} {r['regs']:>9} {r['sgprs']:>5} {r['spills']:>10} {r['scratch_bytes']:>7} "
            f"{r['lds_bytes']:>7} {r['lds_limit']:>7} {r['workgroups_per_cu']:>5}"
        )
    return out


def test_no_memory_spills_lds_within_limit_and_resident(figures):
    for key, r in figures.items():
        arch = key.split("/")[0]
        assert r["scratch_bytes"] == 0, f"{key}: {r['scratch_bytes']} bytes of scratch (spilled registers)"
        assert r["lds_bytes"] <= LDS_LIMIT[arch], f"{key}: LDS {r['lds_bytes']} > {LDS_LIMIT[arch]}"
        assert r["regs"] <= 512, f"{key}: {r['regs']} VGPRs+AGPRs per lane exceed a SIMD's 512"
        assert r["workgroups_per_cu"] >= 1, f"{key}: no workgroup fits on a CU"


def test_no_vgpr_spills(figures):
    for key, r in figures.items():
        assert r["vector_spills"] == 0, f"{key}: {r['vector_spills']} VGPR spills"


def test_figures_not_worse_than_golden(figures):
    if os.environ.get("MONODECODE_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        tmp = GOLDEN.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: {f: v[f] for f in FIELDS} for k, v in figures.items()}, indent=1, sort_keys=True))
        tmp.replace(GOLDEN)
    golden = json.loads(GOLDEN.read_text())
    assert set(golden) == set(figures), f"kernel set changed: {sorted(set(golden) ^ set(figures))}"
    for key, g in golden.items():
        r = figures[key]
        for f in ("regs", "sgprs", "spills", "vector_spills", "scratch_bytes", "lds_bytes"):
            assert r[f] <= g[f], f"{key}: {f} grew from {g[f]} to {r[f]} (update the golden file if intended)"
        assert r["workgroups_per_cu"] >= g["workgroups_per_cu"], f"{key}: fewer resident workgroups per CU"
