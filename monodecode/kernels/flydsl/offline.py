"""Compile K1/K2 specialisations ahead of time (CPU is enough) into a FlyDSL disk cache.

A *specialisation* is (arch, dims, width, weight dtype, block size). Compiling one writes FlyDSL's
own cache entry (``<cache>/<launcher>/<key>.pkl``: the lowered module with the code object), which
is what the runtime later loads with ``FLYDSL_RUNTIME_RUN_ONLY=1`` (trace, hit, never lower), and
returns the raw code object (hsaco) for the ISA budget checks.

Some compiler failures abort the interpreter, so callers compile through ``compile_in_subprocess``
(``python -m monodecode.kernels.flydsl.offline``), which turns any crash into one error line.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from monodecode.errors import ArtifactError
from monodecode.kernels.flydsl.arch import arch_spec
from monodecode.kernels.flydsl.args import K1_ARGS, K1_SCALARS, K2_ARGS, K2_SCALARS, pointer
from monodecode.kernels.flydsl.config import Geometry, plan_geometry
from monodecode.kernels.flydsl.toolchain import arch_env
from monodecode.model.dims import ModelDims, dims_from_hf_config

KERNELS = ("k1", "k2")


@dataclass(frozen=True)
class Specialisation:
    arch: str
    dims: ModelDims
    width: int
    weight_dtype: str
    block_size: int
    tp_size: int = 1

    def geometry(self) -> Geometry:
        """The shared plan of this width on the arch's grid (``config.plan_geometry``)."""
        return plan_geometry(self.dims, self.width, arch_spec(self.arch), self.weight_dtype, self.tp_size)


def launchers(spec: Specialisation):
    """``(launch_k1, launch_k2)`` of ``spec`` (imports FlyDSL)."""
    from monodecode.kernels.flydsl.k1 import make_k1
    from monodecode.kernels.flydsl.k2 import make_k2

    geom = spec.geometry()
    return make_k1(spec.dims, geom, spec.block_size), make_k2(spec.dims, geom)


def _cache_entry(launcher, cache_dir: Path) -> Path:
    from flydsl.compiler.jit_function import _disk_cache_key

    key, _ = launcher._last_compiled
    return cache_dir / launcher.func.__name__ / f"{_disk_cache_key(key)}.pkl"


def code_object(pkl: Path) -> bytes:
    """The hsaco inside a FlyDSL cache entry (the ``gpu.binary`` op of the lowered module)."""
    from flydsl._mlir import ir
    from flydsl._mlir.dialects import gpu
    from flydsl.compiler.jit_function import _create_mlir_context

    art = pickle.loads(pkl.read_bytes())
    with _create_mlir_context():
        module = ir.Module.parse(art._ir_text)
        for op in module.body.operations:
            if op.operation.name == "gpu.binary":
                for obj in op.attributes["objects"]:
                    return bytes(gpu.ObjectAttr(obj).object)
    raise ArtifactError(f"flydsl: no code object in {pkl}")


def compile_specialisation(spec: Specialisation, cache_dir: Path) -> dict[str, dict]:
    """Compile K1 and K2 of ``spec`` into ``cache_dir``; write ``<kernel>.hsaco`` beside the cache.

    Returns ``{kernel: {"cache_file": relative path, "hsaco": relative path}}``.
    """
    cache_dir = Path(cache_dir)
    out: dict[str, dict] = {}
    with arch_env(spec.arch, cache_dir, compile_only=True):
        import flydsl.compiler as flyc

        k1, k2 = launchers(spec)
        for name, fn, args, scalars in (("k1", k1, K1_ARGS, K1_SCALARS), ("k2", k2, K2_ARGS, K2_SCALARS)):
            flyc.compile(fn, *[pointer(kind, None) for _, kind in args], *([0] * len(scalars)))
            entry = _cache_entry(fn, cache_dir)
            if not entry.exists():
                raise ArtifactError(f"flydsl: compiling {name} wrote no cache entry {entry}")
            hsaco_dir = cache_dir / "hsaco" / spec.arch
            hsaco_dir.mkdir(parents=True, exist_ok=True)
            tp = f"_tp{spec.tp_size}" if spec.tp_size > 1 else ""
            hsaco = hsaco_dir / f"{name}_w{spec.width}{tp}_{spec.weight_dtype}_{entry.stem[:16]}.hsaco"
            hsaco.write_bytes(code_object(entry))
            out[name] = {"cache_file": str(entry.relative_to(cache_dir)), "hsaco": str(hsaco.relative_to(cache_dir))}
    return out


def compile_in_subprocess(
    arch: str,
    dims: ModelDims,
    widths: list[int],
    weight_dtype: str,
    block_size: int,
    cache_dir: Path,
    timeout_s: float = 1800,
    tp_size: int = 1,
) -> dict[int, dict[str, dict]]:
    """Compile every width in a child interpreter; a crash or compiler error is one ArtifactError line."""
    req = {
        "arch": arch,
        "dims": dims.to_dict(),
        "config": None,
        "widths": widths,
        "tp_size": tp_size,
        "weight_dtype": weight_dtype,
        "block_size": block_size,
        "cache_dir": str(cache_dir),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "monodecode.kernels.flydsl.offline"],
        input=json.dumps(req),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise ArtifactError(f"flydsl: compiling {arch} widths {widths} failed: {last}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {int(w): v for w, v in result.items()}


def _dims_from_dict(raw: dict) -> ModelDims:
    from monodecode.model.dims import RopeSpec

    raw = dict(raw)
    raw["rope_full"] = RopeSpec(**raw["rope_full"])
    raw["rope_sliding"] = RopeSpec(**raw["rope_sliding"]) if raw.get("rope_sliding") else None
    raw["layer_types"] = tuple(raw["layer_types"])
    return ModelDims(**raw)


def _main() -> int:
    req = json.loads(sys.stdin.read())
    dims = _dims_from_dict(req["dims"]) if req.get("dims") else dims_from_hf_config(req["config"])
    out = {}
    for w in req["widths"]:
        spec = Specialisation(
            req["arch"], dims, int(w), req["weight_dtype"], int(req["block_size"]), int(req.get("tp_size", 1))
        )
        out[str(w)] = compile_specialisation(spec, Path(req["cache_dir"]))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_main())
    except Exception as e:  # the parent prints the last stderr line
        msg = " ".join(str(e).split())[:400]
        print(f"{type(e).__name__}: {msg}", file=sys.stderr)
        sys.exit(1)
