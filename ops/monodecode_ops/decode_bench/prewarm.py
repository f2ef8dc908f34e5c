"""Compile the benchmark's compiled stock steps before the run, in parallel processes.

Inductor compiles one graph at a time in the benchmark's process; a default run compiles about
sixty (one per compiled stock path, batch, context and layer kind), most of its device phase.
A compiled layer depends only on shapes and constants, not on weight values or layer count, so
each worker builds a model of one layer per layer kind (sliding, global) with the profile's
dims, the same caches' shapes and RoPE tables, and calls each compiled path once: inductor's
FX-graph cache and Triton's cache on disk then hold every graph, and the benchmark loads them.

Tuning stays in the benchmark: the workers run their kernels on a shared, busy GPU, so they
save no autotuning or coordinate-descent result (``AutotuneCache.save`` is a no-op in them, and
any ``*.best_config`` written during the warm-up is deleted after it); the benchmark's process
tunes each kernel on its first run, on an idle GPU, as it would without the warm-up. A stock that
tunes while it compiles (max-autotune's GEMM choice, ``harness.TUNED_WHILE_COMPILING``) is not
warmed at all: its choices would be the busy GPU's, baked into the cached graph.
"""

from __future__ import annotations

import dataclasses
import os
import time
import types
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from monodecode.errors import exception_line

_MODELS: dict = {}  # per worker: (profile, dtype, max context) -> (dims, weights, paths)
# GPU memory a worker holds (its models, caches and CUDA context): about 7.3 GB each for 1B and 8B
# up to 32k in run 135, where 16 workers on an 80 GB H100 lost every cell to allocation failures
WORKER_GPU_BYTES = 8 << 30


def default_workers(cpus: int, free_gpu_bytes: int | None) -> int:
    """Workers when the command line names none: one a CPU, and no more than the GPU's free
    memory holds at ``WORKER_GPU_BYTES`` each (``free_gpu_bytes`` None: on the CPU)."""
    if free_gpu_bytes is None:
        return max(1, cpus)
    return max(1, min(cpus, free_gpu_bytes // WORKER_GPU_BYTES))


def _init_worker() -> None:
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # the workers are the parallelism
    from torch._inductor.runtime import autotune_cache

    def save(self, *args, **kwargs) -> None:
        """No tuning saved. Named as the method it replaces: a compiled kernel keeps ``save`` as
        a hook, pickled into the FX-graph cache as its object and this function's name, which
        the benchmark's process (where ``save`` is inductor's) resolves by that name."""

    if hasattr(autotune_cache.AutotuneCache, "save"):
        autotune_cache.AutotuneCache.save = save


def one_layer_per_kind(dims):
    """The profile's dims with one decoder layer of each kind, in first-seen order."""
    kinds = tuple(dict.fromkeys(dims.layer_types))
    return dataclasses.replace(dims, num_layers=len(kinds), layer_types=kinds)


def warm_cell(job) -> tuple[str, float, str | None]:
    """Compile (and run once) every compiled stock path of one cell; (what, seconds, error)."""
    profile, dtype, context, rows, backends, stock, max_context, device = job
    t0 = time.monotonic()
    name = f"{profile} {dtype} context {context} batch {rows}: {', '.join(backends)}"
    try:
        import torch

        from monodecode.model.profiles import profile_dims
        from monodecode.model.weights import random_weights
        from monodecode_ops.decode_bench.harness import BLOCK, _stock_paths
        from monodecode_ops.decode_bench.stock import ContiguousKV

        key = (profile, dtype, max_context)
        if key not in _MODELS:
            dims = one_layer_per_kind(profile_dims(profile))
            w = random_weights(dims, seed=1, weight_dtype=dtype, device=device, num_layers=dims.num_layers)
            paths, _ = _stock_paths(dims, w, stock, max_context, device, dtype != "bf16", lambda *_: None)
            _MODELS[key] = (dims, w, paths)
        dims, _, paths = _MODELS[key]
        cache = ContiguousKV.zeros(dims, dims.num_layers, rows, context, device)
        meta = types.SimpleNamespace(positions=torch.full((rows,), context - 1, dtype=torch.int64, device=device))
        x = torch.zeros(rows, dims.hidden_size, dtype=torch.bfloat16, device=device)
        for b in backends:
            torch._dynamo.reset()
            path = paths[b]
            path.cache = cache
            path.prepare(meta, BLOCK)
            for l in range(dims.num_layers):
                path.forward_layer(l, x, meta, None)
            path.cache = None
        if device != "cpu":
            torch.cuda.synchronize()
        return name, time.monotonic() - t0, None
    except Exception as e:  # noqa: BLE001 - a graph that fails here compiles (or fails) in the run itself
        return name, time.monotonic() - t0, exception_line(e, 200)


def jobs(profiles, fp8_profiles, batches, contexts, long_batches, stock, w8a16_batches, device="cuda") -> list:
    """One job per cell that has a compiled stock path, in the benchmark's order."""
    from monodecode_ops.decode_bench.harness import (
        COMPILED,
        STOCK_PATHS,
        TUNED_WHILE_COMPILING,
        cell_plan,
        config_order,
        stock_runs,
    )

    chosen = tuple(s for s in stock if STOCK_PATHS[s] in COMPILED and STOCK_PATHS[s] not in TUNED_WHILE_COMPILING)
    out = []
    for p, dtype in config_order(profiles, fp8_profiles):
        fp8 = dtype != "bf16"
        for context, rows in cell_plan(contexts, batches, long_batches):
            backends = [STOCK_PATHS[s] for s in chosen if stock_runs(STOCK_PATHS[s], fp8, rows, w8a16_batches)]
            if backends:
                out.append((p, dtype, context, rows, backends, chosen, max(contexts), device))
    return out


def prewarm(job_list: list, workers: int, log=print, run=warm_cell) -> int:
    """Run the jobs on ``workers`` processes; returns how many failed. A job that failed beside
    others runs again alone once the pool is gone: each worker holds its own models and caches
    on the GPU, so many at once can run it out of memory (run 135: 16 workers on an 80 GB H100,
    every cell failed with cuBLAS or cuDNN allocation errors). Tuning results written meanwhile
    are deleted (see the module doc). ``run``: the job's function (``warm_cell``)."""
    import multiprocessing

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    start = time.time()
    ctx = multiprocessing.get_context("spawn")  # CUDA in the workers
    try:
        again = _run_pool(job_list, max(1, workers), ctx, run, log)
        if again and workers > 1:
            log(f"{len(again)} cells failed beside others: again one at a time")
            again = _run_pool(again, 1, ctx, run, log)
        failed = len(again)
    finally:
        stale = [p for p in Path(cache_dir()).rglob("*.best_config") if p.stat().st_mtime >= start - 1]
        for p in stale:
            p.unlink(missing_ok=True)
        log(f"{len(job_list)} cells warmed in {time.time() - start:.1f}s; {len(stale)} tuning results discarded")
    return failed


def _run_pool(job_list: list, workers: int, ctx, run, log) -> list:
    """The jobs on a fresh pool of ``workers`` processes; the ones that failed."""
    failed = []
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker) as ex:
        for job, (name, dt, err) in zip(job_list, ex.map(run, job_list)):
            log(f"compiled {name} in {dt:.1f}s" + (f" (failed: {err})" if err else ""))
            if err is not None:
                failed.append(job)
    return failed
