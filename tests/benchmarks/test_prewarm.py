"""``decode_latency.py --prewarm-only`` (``monodecode_ops.decode_bench.prewarm``) fills inductor's
cache with exactly the graphs the benchmark then compiles: a worker with one layer per layer kind
compiles tiny's fullgraph stock step, and a second process running the benchmark's own path on
the whole model (four layers, caches from a paged cache) finds both of its graphs (sliding and
global) in the cache, with no miss. Run on the CPU (inductor's C++ backend), in a fresh cache
folder; about 30 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREWARM = """
import sys
from monodecode_ops.decode_bench import harness as H
H.DEVICE = "cpu"
sys.exit(H.main(["--profiles", "tiny", "--fp8-profiles", "", "--contexts", "40", "--batches", "3",
                 "--stock", "fullgraph", "--prewarm-only", "--prewarm-workers", "1"]))
"""
BENCH = """
import json, torch
from torch._dynamo.utils import counters
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights
from monodecode_ops.decode_bench.harness import BLOCK, _stock_paths
from monodecode_ops.decode_bench.stock import ContiguousKV
ctx, rows = 40, 3
dims = profile_dims("tiny")
w = random_weights(dims, seed=1, weight_dtype="bf16", num_layers=dims.num_layers)
paths, _ = _stock_paths(dims, w, ("fullgraph",), ctx, "cpu", False, print)
blocks = rows * (-(-ctx // BLOCK)) + 1
alloc = BlockAllocator(blocks, BLOCK, shuffle_seed=rows)
for r in range(rows):
    alloc.append_slots(r, ctx - 1)
meta = alloc.decode_metadata(list(range(rows)))
kv = PagedKVCache.allocate(dims, blocks, BLOCK, num_layers=dims.num_layers)
step = paths["stock-fullgraph"]
step.cache = ContiguousKV.from_paged(dims, kv, meta, ctx)
step.prepare(meta, BLOCK)
y = torch.randn(rows, dims.hidden_size).to(torch.bfloat16)
for l in range(dims.num_layers):
    y = step.forward_layer(l, y, meta, kv)
print(json.dumps(dict(counters["inductor"])))
"""


def _python(code: str, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_prewarm_fills_the_cache_the_benchmark_reads(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'ops'}",
        PYTHONWARNINGS="ignore",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    out = _python(PREWARM, env)
    assert "compiled tiny bf16 context 40 batch 3: stock-fullgraph in" in out and "(failed" not in out
    assert "prewarm: 1/1 cells compiled" in out
    counts = json.loads(_python(BENCH, env).strip().splitlines()[-1])
    assert counts.get("fxgraph_cache_hit") == 2 and not counts.get("fxgraph_cache_miss"), counts


def fails_first_time(job) -> tuple[str, float, str | None]:
    """A prewarm job (``prewarm.prewarm``'s ``run``) that fails on its first attempt and
    succeeds after, as a cell does that ran out of GPU memory beside other workers; ``job``:
    (its marker file, always fail)."""
    marker, always = job
    first = not Path(marker).exists()
    Path(marker).touch()
    return marker, 0.0, "CUDA out of memory" if first or always else None


def test_cells_that_failed_beside_others_run_again_alone(tmp_path):
    """Run 135's prewarm lost every cell to 16 workers' allocations on one GPU: a failed cell
    runs again in a pool of one, and counts as failed only if it fails there too. Alone from
    the start (one worker) nothing runs twice."""
    from monodecode_ops.decode_bench.prewarm import prewarm

    log: list[str] = []
    jobs = [(str(tmp_path / f"a{i}"), False) for i in range(3)] + [(str(tmp_path / "b"), True)]
    assert prewarm(jobs, 2, log.append, run=fails_first_time) == 1
    assert "4 cells failed beside others: again one at a time" in log
    assert sum("(failed" in line for line in log) == 5  # four at first, then the one that always fails
    alone = [(str(tmp_path / f"c{i}"), False) for i in range(2)]
    log.clear()
    assert prewarm(alone, 1, log.append, run=fails_first_time) == 2
    assert not any("again" in line for line in log)


def test_default_workers_fit_the_gpus_free_memory():
    """One worker a CPU, capped by the free GPU memory at ``WORKER_GPU_BYTES`` each (run 135's 16
    workers on an 80 GB H100 all failed), never 0; on the CPU (no GPU memory) one a CPU."""
    from monodecode_ops.decode_bench.prewarm import WORKER_GPU_BYTES, default_workers

    assert default_workers(16, 79 << 30) == 79 // (WORKER_GPU_BYTES >> 30) < 16
    assert default_workers(2, 79 << 30) == 2
    assert default_workers(16, 1 << 30) == 1
    assert default_workers(16, None) == 16
    assert default_workers(0, None) == 1


WORKER_HOOK = """
import pickle, sys
from torch._inductor.runtime.autotune_cache import AutotuneCache
from monodecode_ops.decode_bench.prewarm import _init_worker
_init_worker()
cache = AutotuneCache("configs")
assert cache.save(object(), 1, found_by_coordesc=True) is None  # the worker saves no tuning
sys.stdout.buffer.write(pickle.dumps(cache.save))
"""
BENCH_LOADS_HOOK = """
import pickle, sys
hook = pickle.loads(sys.stdin.buffer.read())
print(type(hook.__self__).__name__, hook.__name__)
"""


def test_a_warmed_kernels_cache_hook_loads_in_the_benchmark(tmp_path):
    """A compiled Triton kernel keeps its ``AutotuneCache``'s ``save`` as a hook, and inductor's
    FX-graph cache pickles it with the graph: a bound method pickles as its object and its
    function's name. The worker's no-op must carry the name ``save``, or the benchmark's process
    (where ``save`` is inductor's) cannot load a single warmed graph (runs 165-170: 36-63 "fx
    graph cache unable to load compiled graph" a run, "'AutotuneCache' object has no attribute
    '<lambda>'", every graph compiled again). Both ends run as the two processes do."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'ops'}", PYTHONWARNINGS="ignore")
    dumped = subprocess.run([sys.executable, "-c", WORKER_HOOK], capture_output=True, timeout=300, env=env)
    assert dumped.returncode == 0, dumped.stderr.decode()[-3000:]
    loaded = subprocess.run([sys.executable, "-c", BENCH_LOADS_HOOK], input=dumped.stdout, capture_output=True,
                            timeout=300, env=env)  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr.decode()[-3000:]
    assert loaded.stdout.decode().split() == ["AutotuneCache", "save"]
