"""Which kernel backends exist and which to prefer on a platform.

Backends register lazily by import path so importing this module never imports Triton or
FlyDSL (they are heavy, and absent from some images). A backend's module is imported only when
it is asked for; an import failure becomes that backend's unavailability reason.

Preference (``backends_for``): flydsl on gfx942/gfx950, then triton on CUDA/ROCm GPUs, then the
reference, which runs everywhere. Opt-in backends (``OPT_IN``: triton-step) run only when a
deployment names them; ``backend: auto`` never picks one.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from monodecode.errors import exception_line
from monodecode.kernels.base import KernelBackend
from monodecode.services.platform import Platform

# name -> "module:Class"; the order is the preference order.
_LAZY: dict[str, str] = {
    "flydsl": "monodecode.kernels.flydsl.backend:FlyDSLBackend",
    "triton": "monodecode.kernels.triton.backend:TritonBackend",
    "triton-step": "monodecode.kernels.triton.step_backend:TritonStepBackend",
    "reference": "monodecode.kernels.reference_backend:ReferenceBackend",
}
_LOADED: dict[str, type[KernelBackend]] = {}
_IMPORT_ERRORS: dict[str, str] = {}

BACKEND_NAMES = tuple(_LAZY)
# Backends that run only when named (``backend: <name>``), never chosen by ``backend: auto``: the
# step launch stays opt-in until it beats the two-launch triton kernels in every benchmark cell.
OPT_IN: frozenset[str] = frozenset({"triton-step"})


def register_backend(cls: type[KernelBackend]) -> type[KernelBackend]:
    """Register a backend class (usable as a decorator). Re-registering a name replaces it."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} has no backend name")
    _LOADED[name] = cls
    _IMPORT_ERRORS.pop(name, None)
    if name not in _LAZY:
        _LAZY[name] = f"{cls.__module__}:{cls.__qualname__}"
    return cls


def register_lazy(name: str, target: str) -> None:
    """Register ``name`` as ``"module:Class"``, imported on first use."""
    if ":" not in target:
        raise ValueError(f"lazy backend target must be 'module:Class', got {target!r}")
    _LAZY[name] = target
    _LOADED.pop(name, None)
    _IMPORT_ERRORS.pop(name, None)


def known_backends() -> tuple[str, ...]:
    return tuple(_LAZY)


def _load(name: str) -> type[KernelBackend] | None:
    if name in _LOADED:
        return _LOADED[name]
    if name in _IMPORT_ERRORS:
        return None
    module_name, _, attr = _LAZY[name].partition(":")
    try:
        module = importlib.import_module(module_name)
        cls = getattr(module, attr)
    except Exception as e:  # ImportError, or a toolchain that fails at import time
        _IMPORT_ERRORS[name] = f"cannot import {module_name}: {exception_line(e)}"
        return None
    _LOADED[name] = cls
    return cls


def get_backend(name: str) -> type[KernelBackend]:
    """The backend class called ``name``; ValueError naming the reason when it cannot load."""
    if name not in _LAZY:
        raise ValueError(f"unknown kernel backend {name!r}; known: {', '.join(_LAZY)}")
    cls = _load(name)
    if cls is None:
        raise ValueError(f"kernel backend {name!r} is unavailable: {_IMPORT_ERRORS[name]}")
    return cls


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str | None  # why not, when unavailable
    opt_in: bool = False  # runs only when named: ``backend: auto`` passes it over (``OPT_IN``)


def _platform_order(platform: Platform) -> list[str]:
    order = []
    if platform.is_supported_amd:
        order.append("flydsl")
    if platform.is_gpu or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        order.append("triton")  # on a CPU: Triton's interpreter runs the real kernels (verify)
    order.append("reference")
    return order + [
        n for n in _LAZY if n not in order and n not in ("flydsl", "triton", "reference") and n not in OPT_IN
    ]


def backend_status(platform: Platform) -> list[BackendStatus]:
    """Every known backend with whether it can run on ``platform`` and why not (preference order
    first, then the opt-in ones, then the rest). An opt-in backend is available wherever it can
    run, and marked ``opt_in``: only a deployment that names it uses it."""
    preferred = _platform_order(platform)
    opt_in = [n for n in _LAZY if n in OPT_IN]
    out = []
    for name in preferred + opt_in + [n for n in _LAZY if n not in preferred and n not in OPT_IN]:
        cls = _load(name)
        if cls is None:
            out.append(BackendStatus(name, False, _IMPORT_ERRORS[name], name in OPT_IN))
            continue
        try:
            why = cls.unavailable_reason(platform)  # each backend says why not in its own words
        except Exception as e:  # a probe that crashes means "not usable here"
            why = f"availability probe failed: {type(e).__name__}: {e}"
        if why is None and name not in preferred and name not in OPT_IN:
            why = f"{name} is not used on {platform.label}"
        out.append(BackendStatus(name, why is None, why, name in OPT_IN))
    return out


def backends_for(platform: Platform) -> list[type[KernelBackend]]:
    """Backend classes ``backend: auto`` may use on ``platform``, most preferred first (reference
    last); opt-in backends are left out (they run only when named)."""
    return [get_backend(s.name) for s in backend_status(platform) if s.available and not s.opt_in]
