"""Ahead-of-time artifacts of the FlyDSL backend: bake (precompile) and load (runtime).

FlyDSL 0.5 loads a compiled kernel only from its own disk cache, so that cache *is* the artifact:
precompile compiles every width of K1/K2 into a fresh cache directory (in a subprocess), and
records each cache entry plus the raw code objects (for ``inspect`` and the ISA budgets) in the
``ArtifactStore`` manifest under the build key. At startup the runtime looks the key up (sha256
of every file verified), writes the cache entries into a private writable directory (FlyDSL opens
``<key>.lock`` read-write) from bytes hashed as they are read, and runs with
``FLYDSL_RUNTIME_RUN_ONLY=1``: the kernels are traced, found, never lowered; a miss is an error,
not a compile.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from monodecode.errors import ArtifactError
from monodecode.kernels import plan as plan_module
from monodecode.kernels.flydsl.arch import arch_spec
from monodecode.kernels.flydsl.isa import budget_violations, figures, read_resources
from monodecode.kernels.flydsl.offline import Specialisation, compile_in_subprocess
from monodecode.kernels.flydsl.toolchain import flydsl_version
from monodecode.model.dims import ModelDims
from monodecode.services.artifacts import ArtifactEntry, ArtifactStore
from monodecode.services.buildkey import build_key, source_digest

BACKEND = "flydsl"
SOURCE_DIR = Path(__file__).resolve().parent


def compiler_version() -> str:
    return f"flydsl-{flydsl_version() or 'missing'}"


def flydsl_build_key(
    arch: str, dims: ModelDims, weight_dtype: str, widths, block_size: int, tp_size: int = 1, kv_dtype: str = "bf16"
) -> str:
    """The kernels bake the shared plan's tables and offsets, so its source is part of the digest
    (as for the Triton backend): a plan change never loads a stale artifact."""
    digest = source_digest(SOURCE_DIR, extra_files=[Path(plan_module.__file__)])
    return build_key(
        BACKEND, arch, dims, weight_dtype, kv_dtype, tp_size, list(widths), block_size, digest, compiler_version()
    )


def precompile(
    store: ArtifactStore,
    arch: str,
    dims: ModelDims,
    widths: list[int],
    weight_dtype: str = "bf16",
    block_size: int = 16,
    profile: str | None = None,
    tp_size: int = 1,
) -> tuple[ArtifactEntry, list[dict]]:
    """Compile every width for ``arch`` and add one manifest entry; returns it and the ISA table.

    Refuses (ArtifactError) when a kernel breaks its ISA budget: such a kernel must not ship.
    """
    spec = arch_spec(arch)
    widths = sorted(set(int(w) for w in widths))
    for w in widths:  # geometry errors (bad dtype, dims) are one line, before any compile
        Specialisation(arch, dims, w, weight_dtype, block_size, tp_size).geometry()
    key = flydsl_build_key(arch, dims, weight_dtype, widths, block_size, tp_size)
    prefix = f"flydsl/{arch}/{key[:16]}"
    with tempfile.TemporaryDirectory(prefix="flydsl-bake-") as tmp:
        cache = Path(tmp) / "cache"
        compiled = compile_in_subprocess(arch, dims, widths, weight_dtype, block_size, cache, tp_size=tp_size)
        files: dict[str, Path] = {}
        table, layout = [], {}
        for w, kernels in sorted(compiled.items()):
            layout[str(w)] = {}
            for name, rec in sorted(kernels.items()):
                res = read_resources(cache / rec["hsaco"])
                bad = budget_violations(res, spec, spec.compute_units)
                if bad:
                    raise ArtifactError(f"flydsl: {arch} {name} width {w} breaks its ISA budget: {'; '.join(bad)}")
                table.append({"arch": arch, "kernel": name, "width": w, **figures(res, spec, spec.compute_units)})
                files[f"{prefix}/cache/{rec['cache_file']}"] = cache / rec["cache_file"]
                files[f"{prefix}/{rec['hsaco']}"] = cache / rec["hsaco"]
                layout[str(w)][name] = {
                    "cache_file": f"{prefix}/cache/{rec['cache_file']}",
                    "hsaco": f"{prefix}/{rec['hsaco']}",
                    "resources": res.to_dict(),
                }
        entry = store.add(
            build_key=key,
            backend=BACKEND,
            arch=arch,
            dims_digest=dims.digest(),
            widths=widths,
            files=files,
            compiler={"name": "flydsl", "version": flydsl_version() or "missing"},
            profile=profile,
            extra={
                "weight_dtype": weight_dtype,
                "block_size": block_size,
                "tp_size": tp_size,
                "kernels": layout,
                "cache_root": f"{prefix}/cache",
            },
        )
    return entry, table


def stage_run_cache(entry: ArtifactEntry, run_dir: Path, store: ArtifactStore) -> Path:
    """Write an entry's FlyDSL cache files into a writable run-only cache directory.

    Each file is read once and hashed against the manifest (``ArtifactStore.read_verified``), and
    those very bytes are written: a file swapped after ``lookup`` verified it is refused
    (ArtifactError), never unpickled. Every file is verified before the first one is written, so
    a refusal stages nothing."""
    cache_root = entry.extra.get("cache_root")
    if not isinstance(cache_root, str):
        raise ArtifactError(f"artifact {entry.build_key[:12]}: manifest extra lacks 'cache_root'")
    run_dir = Path(run_dir)
    staged = {
        f.path[len(cache_root) + 1 :]: store.read_verified(entry, f.path)
        for f in entry.files
        if f.path.startswith(cache_root + "/")
    }
    for rel, data in staged.items():
        dst = run_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
    return run_dir


def check_run_only(
    arch: str,
    dims: ModelDims,
    widths: list[int],
    weight_dtype: str,
    block_size: int,
    cache_dir: Path,
    tp_size: int = 1,
    k1_scalars: list[dict[str, int]] | None = None,
) -> list[dict[int, dict[str, str]]]:
    """Prove (in a subprocess) that every width traces to a cache hit with run-only set.

    This is exactly the runtime's load path up to the first launch; on a CPU machine the launch
    itself is skipped (COMPILE_ONLY). A miss raises ArtifactError naming the kernel.
    ``k1_scalars``: sets of K1 scalar arguments (by name, e.g. a cache's KV strides) to trace
    with, one pass each (default: one pass with zeros). Returns, per pass, the cache file each
    width's K1 and K2 hit (``{width: {"k1": "launch_k1/<key>.pkl", ...}}``).
    """
    req = {
        "arch": arch,
        "dims": dims.to_dict(),
        "widths": widths,
        "weight_dtype": weight_dtype,
        "block_size": block_size,
        "cache_dir": str(cache_dir),
        "tp_size": tp_size,
        "k1_scalars": k1_scalars or [{}],
    }
    proc = subprocess.run(
        [sys.executable, "-m", "monodecode.kernels.flydsl.bake"],
        input=json.dumps(req),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise ArtifactError(f"flydsl: run-only load failed: {lines[-1] if lines else proc.returncode}")
    passes = json.loads(proc.stdout.strip().splitlines()[-1])
    return [{int(w): hits for w, hits in p.items()} for p in passes]


def _run_only_main() -> int:
    import flydsl.compiler as flyc

    from monodecode.kernels.flydsl.args import K1_ARGS, K1_SCALARS, K2_ARGS, K2_SCALARS, pointer
    from monodecode.kernels.flydsl.offline import _cache_entry, _dims_from_dict, launchers
    from monodecode.kernels.flydsl.toolchain import arch_env

    req = json.loads(sys.stdin.read())
    dims = _dims_from_dict(req["dims"])
    cache_dir = Path(req["cache_dir"])
    passes = []
    for given in req["k1_scalars"]:
        unknown = set(given) - set(K1_SCALARS)
        if unknown:
            raise ValueError(f"unknown K1 scalar arguments {sorted(unknown)}; K1 takes {K1_SCALARS}")
        hits: dict[str, dict[str, str]] = {}
        for w in req["widths"]:
            spec = Specialisation(
                req["arch"], dims, int(w), req["weight_dtype"], int(req["block_size"]), int(req.get("tp_size", 1))
            )
            with arch_env(spec.arch, cache_dir, compile_only=True, run_only=True):
                k1, k2 = launchers(spec)
                hits[str(w)] = {}
                for name, fn, args, scalars, values in (
                    ("k1", k1, K1_ARGS, K1_SCALARS, given),
                    ("k2", k2, K2_ARGS, K2_SCALARS, {}),
                ):
                    flyc.compile(
                        fn, *[pointer(kind, None) for _, kind in args], *[int(values.get(s, 0)) for s in scalars]
                    )
                    hits[str(w)][name] = str(_cache_entry(fn, cache_dir).relative_to(cache_dir))
        passes.append(hits)
    print(json.dumps(passes))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_run_only_main())
    except Exception as e:
        print(f"{type(e).__name__}: {' '.join(str(e).split())[:400]}", file=sys.stderr)
        sys.exit(1)
