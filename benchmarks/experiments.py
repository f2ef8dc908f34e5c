"""Launch-configuration experiments for the Triton K1/K2 on one GPU (what moves the step time).

Times one decode step (all layers, CUDA graph, context 1024) per variant of the CUDA launch
target (``kernels/triton/config.py``): the configuration before a change against the current
default, and candidate settings for the wide (batch 8) path. One line per variant: step, K1-only
and K2-only times, fraction of the roofline, relative error of the step against the reference
oracle (whole stack: the numerics tests' bound is 5e-2), health. Kernels are compiled in parallel first
(``warm_cache.py --experiments`` compiles the same set).

Usage: ``python benchmarks/experiments.py [NAME_SUBSTRING ...]`` (default: every variant).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from dataclasses import dataclass, field

import torch

sys.path[:0] = [__file__.rsplit("/", 2)[0] or ".", (__file__.rsplit("/", 2)[0] or ".") + "/ops"]


@dataclass(frozen=True)
class Variant:
    name: str
    profile: str
    dtype: str
    batch: int
    change: dict = field(default_factory=dict)  # fields of config.CUDA to replace


BEFORE = {"flatten": False, "fp8_split": 1, "fp8_narrow_stages": 0}  # the configuration of the last run
VARIANTS = [
    Variant("before (task loops not flattened)", "llama3-8b", "bf16", 1, BEFORE),
    Variant("default", "llama3-8b", "bf16", 1),
    Variant("before (task loops not flattened)", "llama3-1b", "bf16", 1, BEFORE),
    Variant("default", "llama3-1b", "bf16", 1),
    Variant("before (not flattened, 1 FP8 chunk)", "llama3-8b", "fp8", 1, BEFORE),
    Variant("flattened, 1 FP8 chunk per iteration", "llama3-8b", "fp8", 1, {"fp8_split": 1, "fp8_narrow_stages": 0}),
    Variant("default", "llama3-8b", "fp8", 1),
    Variant("default", "llama3-8b", "bf16", 8),
    Variant("not flattened", "llama3-8b", "bf16", 8, {"flatten": False}),
    Variant("BK 64", "llama3-8b", "bf16", 8, {"bk_wide": 64}),
    Variant("3 stages", "llama3-8b", "bf16", 8, {"gemv_stages": 3}),
    Variant("BK 256, 2 stages", "llama3-8b", "bf16", 8, {"bk_wide": 256, "gemv_stages": 2}),
]


def _compile(job):
    profile, dtype, batch, change, sm = job
    import triton
    from triton.backends.compiler import GPUTarget

    from monodecode.kernels.triton import config as C
    from monodecode.kernels.triton.config import compile_options, plan_for
    from monodecode.kernels.triton.sources import kernel_sources
    from monodecode.model.profiles import profile_dims

    target = dataclasses.replace(C.CUDA, **change)
    dims = profile_dims(profile)
    mplan = plan_for(dims, [batch], sm, target, fp8=dtype != "bf16")
    for name, src in kernel_sources(dims, dtype, batch, 16, mplan, target):
        triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options=compile_options(target, batch, name, dtype != "bf16")
        )
    return profile


def main(selectors: list[str]) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from monodecode.kernels.base import BuildRequest
    from monodecode.kernels.triton import config as C
    from monodecode.kernels.triton.backend import TritonBackend
    from monodecode.kernels.triton.launch import _Meta
    from monodecode.model import reference as R
    from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
    from monodecode.model.profiles import profile_dims
    from monodecode.model.weights import random_weights
    from monodecode.services.platform import detect_platform
    from monodecode_ops.decode_bench import harness as D

    chosen = [
        v
        for v in VARIANTS
        if not selectors or any(s in f"{v.profile} {v.dtype} b{v.batch} {v.name}" for s in selectors)
    ]
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    with ProcessPoolExecutor(16, mp_context=multiprocessing.get_context("spawn")) as ex:
        list(ex.map(_compile, [(v.profile, v.dtype, v.batch, v.change, sm) for v in chosen]))
    dev = torch.device("cuda")
    base_target = C.CUDA
    plat = detect_platform()
    bw = D.read_bandwidth(dev, gib=2.0)
    print(f"# read bandwidth {bw / 1e9:.0f} GB/s; base target {base_target}", flush=True)
    loaded = None
    for v in chosen:
        if loaded is None or loaded[0] != (v.profile, v.dtype):
            loaded = None
            torch.cuda.empty_cache()
            dims = profile_dims(v.profile)
            loaded = ((v.profile, v.dtype), dims, random_weights(dims, 1, weight_dtype=v.dtype, device=dev))
        _, dims, w = loaded
        ctx, rows = 1024, v.batch
        blocks = rows * (-(-ctx // 16)) + 1
        alloc = BlockAllocator(blocks, 16, shuffle_seed=rows)
        for r in range(rows):
            alloc.append_slots(r, ctx - 1)
        meta = alloc.decode_metadata(list(range(rows)), device=dev)
        kv = PagedKVCache.allocate(dims, blocks, 16, device=dev)
        x = torch.randn(rows, dims.hidden_size, device=dev).to(torch.bfloat16)
        roof = (D.weight_bytes(w) + D.kv_bytes(dims, dims.num_layers, ctx, rows)) / bw
        ref = R.run_layers(w, x, meta, kv)  # the oracle's step on the same cache (correctness of each variant)
        label = f"{v.profile} {v.dtype} b{v.batch} {v.name:38}"
        C.CUDA = dataclasses.replace(base_target, **v.change)
        try:
            req = BuildRequest(
                dims=dims,
                weight_dtype=v.dtype,
                tp_size=1,
                widths=(rows,),
                block_size=16,
                platform=plat,
                wait_timeout_s=2.0,
            )
            tk = TritonBackend().build(req, w, None, allow_jit=True)
            m = _Meta(meta, dev)
            attn = torch.randn(rows, dims.q_size, device=dev).to(torch.bfloat16)
            out = {}

            def step():
                y = x
                for l in range(dims.num_layers):
                    y = tk.forward_layer(l, y, m, kv)
                return y

            y = step()
            rel = float((y.float() - ref.float()).norm() / ref.float().norm())
            for part, fn in (
                ("step", step),
                ("k1", lambda: [tk._launch_k1(l, x, m, kv, rows) for l in range(dims.num_layers)]),
                ("k2", lambda: [tk._launch_k2(l, x, attn, rows) for l in range(dims.num_layers)]),
            ):
                g, _ = D._capture(fn)
                out[part] = statistics.median(D._time_graph(g, 15)) * 1e3
                del g
            print(
                f"{label} step {out['step']:.3f} ms ({roof * 1e3 / out['step']:.1%} of roofline)"
                f"  K1 {out['k1']:.3f}  K2 {out['k2']:.3f}  rel err {rel:.1e}  health {tk.health()}",
                flush=True,
            )
            tk.close()
        except Exception as e:  # a variant that cannot launch (e.g. not co-resident) is reported
            print(f"{label} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        finally:
            C.CUDA = base_target
        del kv
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
