"""Compile the Triton K1/K2 a GPU run needs, in parallel, into Triton's cache.

The launcher compiles kernels one after another; on a fresh GPU machine this script first
compiles the same ``ASTSource``s (same plan, constants and options, so the same cache keys)
with one process per core. Used by ``benchmarks/device_run.sh``.
Usage: ``python benchmarks/warm_cache.py --sm 132 [--cc 90] [--target JSON ...] [--experiments]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def builds(tests_only: bool = False) -> list[tuple[str, str, tuple[int, ...]]]:
    """(profile, weight dtype, widths) of the numerics tests and (unless ``tests_only``) the
    default benchmark."""
    spec = importlib.util.spec_from_file_location(
        "tnum", ROOT / "tests" / "kernels" / "triton" / "test_triton_numerics.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = [(p, d, tuple(ws)) for p, d, ws, _ in mod.GPU_BUILDS]
    return list(dict.fromkeys(out + ([] if tests_only else bench_builds())))


def bench_builds() -> list[tuple[str, str, tuple[int, ...]]]:
    """(profile, weight dtype, widths) of the default benchmark (decode_latency.py)."""
    ws = (1, 2, 4, 8)
    return [(p, "bf16", ws) for p in ("llama3-1b", "llama3-8b", "gemma3-27b")] + [("llama3-8b", "fp8", ws)]


def _one(job) -> tuple[str, float]:
    profile, dtype, widths, width, which, sm, cc, change = job
    import dataclasses

    import triton
    from triton.backends.compiler import GPUTarget

    from monodecode.kernels.triton.config import CUDA, compile_options, plan_for
    from monodecode.kernels.triton.sources import kernel_sources
    from monodecode.model.profiles import profile_dims

    t0 = time.monotonic()
    dims = profile_dims(profile)
    target = dataclasses.replace(CUDA, **change)
    mplan = plan_for(dims, widths, sm, target, fp8=dtype != "bf16")
    src = dict(kernel_sources(dims, dtype, width, 16, mplan, target)).get(which)
    if src is None:  # "ka" of a target without the attention launch
        return f"{profile}/{dtype}/{widths} w={width} {which} (none)", 0.0
    triton.compile(
        src, target=GPUTarget("cuda", cc, 32), options=compile_options(target, width, which, dtype != "bf16")
    )
    return f"{profile}/{dtype}/{widths} w={width} {which} {change or ''}", time.monotonic() - t0


KERNELS = ("k1", "k2", "ka")  # ka: the attention launch, where a target has one


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sm", type=int, required=True, help="multiprocessors (persistent grid size)")
    ap.add_argument("--cc", type=int, default=90)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--target",
        action="append",
        default=[],
        help="also compile the benchmark's builds with this CUDA target change (JSON), e.g. '{\"flatten\": false}'",
    )
    ap.add_argument("--experiments", action="store_true", help="also compile experiments.py's variants")
    ap.add_argument("--tests-only", action="store_true", help="only the GPU tests' builds (no benchmark builds)")
    a = ap.parse_args()
    changes = [{}] + [json.loads(t) for t in a.target]
    jobs = [(p, d, ws, w, k, a.sm, a.cc, {}) for p, d, ws in builds(a.tests_only) for w in ws for k in KERNELS]
    jobs += [
        (p, d, ws, w, k, a.sm, a.cc, ch)
        for ch in changes[1:]
        for p, d, ws in ([] if a.tests_only else bench_builds())
        for w in ws
        for k in KERNELS
    ]
    if a.experiments:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from experiments import VARIANTS

        for v in VARIANTS:
            jobs += [(v.profile, v.dtype, (v.batch,), v.batch, k, a.sm, a.cc, v.change) for k in KERNELS]
    t0 = time.monotonic()
    with ProcessPoolExecutor(a.jobs) as ex:
        for name, dt in ex.map(_one, jobs):
            print(f"compiled {name} in {dt:.1f}s", flush=True)
    print(f"{len(jobs)} kernels in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
