"""Where the FlyDSL compiler finds ld.lld and ROCm's device bitcode, and the per-arch environment.

``ROCM_PATH`` must name a root with ``llvm/bin/ld.lld`` and ``amdgcn/bitcode/*.bc``:

1. ``$ROCM_PATH`` when set (images set it to the runtime base's ``/opt/rocm``);
2. ``/opt/rocm`` when it has that layout (a ROCm node or image);
3. ``<repo>/.tools/rocm`` laid out by ``scripts/toolchains.d/20-flydsl.sh`` from Debian's
   lld-19 and rocm-device-libs (CPU machines and CI).

FlyDSL hashes the bitcode into its cache key, so artifacts baked against one ROCm's bitcode are
only found by a runtime using the same bitcode: images precompile inside the runtime base.
Both ``ARCH`` (the compiler's target) and ``FLYDSL_GPU_ARCH`` (what kernel helpers branch on)
are set; unset, FlyDSL silently falls back to gfx942.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from monodecode.errors import ConfigError

_REPO_TOOLS = Path(__file__).resolve().parents[3] / ".tools" / "rocm"


def _has_layout(root: Path) -> bool:
    return (root / "llvm" / "bin" / "ld.lld").exists() and (root / "amdgcn" / "bitcode").is_dir()


def rocm_path() -> Path:
    env = os.environ.get("ROCM_PATH")
    if env:
        root = Path(env)
        if not _has_layout(root):
            raise ConfigError(f"flydsl: ROCM_PATH={env} lacks llvm/bin/ld.lld or amdgcn/bitcode")
        return root
    for root in (Path("/opt/rocm"), _REPO_TOOLS):
        if _has_layout(root):
            return root
    raise ConfigError(
        "flydsl: no ROCm toolchain root (llvm/bin/ld.lld + amdgcn/bitcode); set ROCM_PATH or run "
        "scripts/toolchains.d/20-flydsl.sh"
    )


def readelf() -> str:
    """llvm-readelf able to print AMDGPU metadata notes."""
    for cand in (
        rocm_path() / "llvm" / "bin" / "llvm-readelf",
        Path("/usr/lib/llvm-19/bin/llvm-readelf"),
        Path("/usr/bin/llvm-readelf"),
    ):
        if cand.exists():
            return str(cand)
    raise ConfigError("flydsl: llvm-readelf not found (Debian package llvm-19)")


def flydsl_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("flydsl")
    except PackageNotFoundError:
        return None


@contextlib.contextmanager
def arch_env(
    arch: str, cache_dir: Path | None = None, *, compile_only: bool = False, run_only: bool = False
) -> Iterator[None]:
    """Set the FlyDSL environment for one arch (restored afterwards)."""
    want = {"ARCH": arch, "FLYDSL_GPU_ARCH": arch, "ROCM_PATH": str(rocm_path())}
    if cache_dir is not None:
        want["FLYDSL_RUNTIME_CACHE_DIR"] = str(cache_dir)
    want["COMPILE_ONLY"] = "1" if compile_only else ""
    want["FLYDSL_RUNTIME_RUN_ONLY"] = "1" if run_only else ""
    saved = {k: os.environ.get(k) for k in want}
    try:
        for k, v in want.items():
            if v:
                os.environ[k] = v
            else:
                os.environ.pop(k, None)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
