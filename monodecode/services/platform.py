"""What accelerator this process runs on: kind, arch, compute units, partition mode, driver.

Order of evidence: torch first (it is what the kernels will actually launch on), then the AMD
KFD topology in sysfs (``/sys/class/kfd/kfd/topology/nodes/*/properties``: present on every
node with the amdgpu driver even when torch is a CPU build, e.g. the ops CLI on a fresh node),
then ``amd-smi`` when it is on PATH, else the CPU. Nothing here raises on an odd machine: a fact
that cannot be read stays ``None`` and the caller decides whether that matters.
"""

from __future__ import annotations

import json
import os
import platform as _pyplatform
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_AMD_ARCHS = ("gfx942", "gfx950")

# CDNA2/3/4 have 4 SIMDs per CU; KFD reports SIMDs, not CUs (unless it has simd_per_cu).
_DEFAULT_SIMD_PER_CU = 4


@dataclass(frozen=True)
class Platform:
    kind: str  # rocm | cuda | cpu
    arch: str  # gfx942 | gfx950 | sm_90 | ... | cpu
    name: str
    compute_units: int  # CUs (AMD) / SMs (NVIDIA) / logical CPUs
    partition_mode: str | None = None  # AMD compute partition: SPX, DPX, QPX, CPX
    driver: str | None = None
    device_index: int = 0
    source: str = "cpu"  # where the facts came from: torch | kfd | amd-smi | cpu
    torch_usable: bool = False  # torch can launch on this device (a GPU kernel can run here)

    @property
    def label(self) -> str:
        """Short human name: "rocm gfx942", "cuda sm_90", or just "cpu"."""
        return self.kind if self.arch == self.kind else f"{self.kind} {self.arch}"

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("rocm", "cuda")

    @property
    def is_supported_amd(self) -> bool:
        return self.kind == "rocm" and self.arch in SUPPORTED_AMD_ARCHS

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.device_index}" if self.is_gpu and self.torch_usable else "cpu"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KfdGpu:
    """One GPU node of the KFD topology (CPU nodes, with simd_count 0, are skipped)."""

    node: int
    arch: str
    compute_units: int
    gpu_id: int | None = None
    drm_render_minor: int | None = None
    name: str | None = None
    partition_mode: str | None = None
    properties: dict[str, int] = field(default_factory=dict, repr=False)


def gfx_name(target_version: int) -> str:
    """KFD ``gfx_target_version`` (e.g. 90402) -> LLVM target name (``gfx942``).

    The encoding is major*10000 + minor*100 + stepping; minor and stepping print as hex digits
    (90010 -> gfx90a).
    """
    major, minor, step = target_version // 10000, (target_version // 100) % 100, target_version % 100
    return f"gfx{major}{minor:x}{step:x}"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _parse_properties(text: str) -> dict[str, int]:
    props: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                props[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return props


def list_kfd_gpus(sysfs_root: str | Path = "/") -> list[KfdGpu]:
    """GPU nodes of the KFD topology, in node order; empty when there is no amdgpu driver."""
    root = Path(sysfs_root)
    nodes_dir = root / "sys/class/kfd/kfd/topology/nodes"
    if not nodes_dir.is_dir():
        return []
    gpus: list[KfdGpu] = []
    for node_dir in sorted(nodes_dir.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 1 << 30):
        text = _read_text(node_dir / "properties")
        if not text:
            continue
        props = _parse_properties(text)
        simds = props.get("simd_count", 0)
        target = props.get("gfx_target_version", 0)
        if simds <= 0 or target <= 0:
            continue  # a CPU node
        per_cu = props.get("simd_per_cu") or _DEFAULT_SIMD_PER_CU
        minor = props.get("drm_render_minor")
        partition = None
        product = None
        if minor is not None:
            dev = root / f"sys/class/drm/renderD{minor}/device"
            partition = _read_text(dev / "current_compute_partition")
            product = _read_text(dev / "product_name")
        gpu_id = _read_text(node_dir / "gpu_id")
        gpus.append(
            KfdGpu(
                node=int(node_dir.name),
                arch=gfx_name(target),
                compute_units=simds // per_cu,
                gpu_id=int(gpu_id) if gpu_id and gpu_id.isdigit() else None,
                drm_render_minor=minor,
                name=product or _read_text(node_dir / "name") or None,
                partition_mode=partition.upper() if partition else None,
                properties=props,
            )
        )
    return gpus


def amdgpu_driver_version(sysfs_root: str | Path = "/") -> str | None:
    """The amdgpu module version (DKMS builds export it); else the kernel release."""
    version = _read_text(Path(sysfs_root) / "sys/module/amdgpu/version")
    if version:
        return f"amdgpu {version}"
    if (Path(sysfs_root) / "sys/module/amdgpu").is_dir():
        return f"amdgpu (in-tree, kernel {_pyplatform.release()})"
    return None


def _amd_smi_gpus(timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Best effort: ``amd-smi static --asic --json``; its JSON layout varies between releases."""
    exe = shutil.which("amd-smi")
    if not exe:
        return []
    try:
        out = subprocess.run(
            [exe, "static", "--asic", "--json"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
        data = json.loads(out.stdout) if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError):
        return []
    if isinstance(data, dict):
        data = data.get("gpu_data") or data.get("gpus") or [data]
    gpus = []
    for entry in data if isinstance(data, list) else []:
        asic = entry.get("asic", entry) if isinstance(entry, dict) else {}
        if not isinstance(asic, dict):
            continue
        arch = str(asic.get("target_graphics_version") or "").lower()
        cus = asic.get("num_compute_units")
        gpus.append(
            {
                "arch": arch if arch.startswith("gfx") else None,
                "compute_units": int(cus) if isinstance(cus, (int, str)) and str(cus).isdigit() else None,
                "name": asic.get("market_name"),
            }
        )
    return gpus


def _from_torch(device: int | None) -> Platform | None:
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        index = torch.cuda.current_device() if device is None else int(device)
        props = torch.cuda.get_device_properties(index)
    except Exception:  # a broken driver must not crash discovery; the caller sees "cpu"
        return None
    if getattr(torch.version, "hip", None):
        arch = str(getattr(props, "gcnArchName", "") or "").split(":")[0] or "unknown"
        kfd = [g for g in list_kfd_gpus() if g.arch == arch]
        gpu = kfd[index] if index < len(kfd) else (kfd[0] if kfd else None)
        return Platform(
            kind="rocm",
            arch=arch,
            name=props.name,
            compute_units=int(props.multi_processor_count),
            partition_mode=gpu.partition_mode if gpu else None,
            driver=amdgpu_driver_version() or f"hip {torch.version.hip}",
            device_index=index,
            source="torch",
            torch_usable=True,
        )
    return Platform(
        kind="cuda",
        arch=f"sm_{props.major}{props.minor}",
        name=props.name,
        compute_units=int(props.multi_processor_count),
        partition_mode=None,
        driver=f"cuda {torch.version.cuda}" if torch.version.cuda else None,
        device_index=index,
        source="torch",
        torch_usable=True,
    )


def detect_platform(device: int | None = None, sysfs_root: str | Path = "/") -> Platform:
    """The platform of ``device`` (default: the current/first one), never raising."""
    if str(sysfs_root) == "/":
        found = _from_torch(device)
        if found is not None:
            return found
    index = 0 if device is None else int(device)
    kfd = list_kfd_gpus(sysfs_root)
    if kfd:
        gpu = kfd[min(index, len(kfd) - 1)]
        return Platform(
            kind="rocm",
            arch=gpu.arch,
            name=gpu.name or gpu.arch,
            compute_units=gpu.compute_units,
            partition_mode=gpu.partition_mode,
            driver=amdgpu_driver_version(sysfs_root),
            device_index=index,
            source="kfd",
            torch_usable=False,
        )
    if str(sysfs_root) == "/":
        smi = _amd_smi_gpus()
        if smi and smi[min(index, len(smi) - 1)].get("arch"):
            gpu = smi[min(index, len(smi) - 1)]
            return Platform(
                kind="rocm",
                arch=gpu["arch"],
                name=gpu.get("name") or gpu["arch"],
                compute_units=gpu.get("compute_units") or 0,
                device_index=index,
                source="amd-smi",
                torch_usable=False,
            )
    return Platform(
        kind="cpu",
        arch="cpu",
        name=_pyplatform.processor() or _pyplatform.machine() or "cpu",
        compute_units=os.cpu_count() or 1,
        source="cpu",
    )
