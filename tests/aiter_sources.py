"""AITER's own Python modules as ground truth, loaded from the ``amd-aiter`` sources that
scripts/toolchains.d/35-aiter.sh unpacks into ``.tools/aiter`` (``make test-deps``).

``import aiter`` cannot run here: the package's ``__init__`` builds and loads HIP extensions and
stops without ROCm. The modules the tests need import only torch and triton, so ``aiter`` is
registered as a bare package over the unpacked directory (its ``__init__`` not run) and they load
from AITER's own files: ``aiter.ops.shuffle`` (``shuffle_weight``, the (16, 16) preshuffle AITER's
GEMMs read) and ``aiter.ops.triton.unified_attention`` (``ROCM_AITER_UNIFIED_ATTN``'s kernel).
What AITER asks of the device (its arch, at import; its CU count) is answered as by an MI300X.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

SOURCES = Path(__file__).resolve().parents[1] / ".tools" / "aiter"
MI300X_ARCH = "gfx942"
MI300X_CUS = 304


def _package() -> None:
    if "aiter" in sys.modules:
        return
    root = SOURCES / "aiter"
    if not (root / "ops" / "shuffle.py").is_file():
        raise RuntimeError(f"AITER's sources are missing at {root}: run bash scripts/toolchains.d/35-aiter.sh .venv")
    pkg = types.ModuleType("aiter")
    pkg.__path__ = [str(root)]
    pkg.__spec__ = importlib.machinery.ModuleSpec("aiter", None, is_package=True)
    pkg.__spec__.submodule_search_locations = pkg.__path__
    sys.modules["aiter"] = pkg


def shuffle_weight():
    """AITER's ``aiter.ops.shuffle.shuffle_weight``."""
    _package()
    from aiter.ops.shuffle import shuffle_weight as fn

    return fn


def unified_attention():
    """AITER's ``aiter.ops.triton.unified_attention.unified_attention`` (Triton), its device
    queries answered as by an MI300X."""
    _package()
    from aiter.ops.triton.utils._triton import arch_info

    arch_info.get_arch = lambda: MI300X_ARCH  # asked at import (the FP8 dtypes of the arch)
    from aiter.ops.triton import unified_attention as module

    module.get_num_sms = lambda: MI300X_CUS
    return module.unified_attention
