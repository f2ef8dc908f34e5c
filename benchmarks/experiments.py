"""Launch-configuration experiments for the Triton K1/K2 on one GPU (what moves the step time).

Times one decode step (all layers, CUDA graph) of a profile at batch 1 for variants of the
launch configuration: programs per SM (the persistent grid), GEMV pipelining depth and K chunk.
Prints one line per variant. Usage: ``python benchmarks/experiments.py llama3-8b llama3-1b``.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import torch

from monodecode.kernels.base import BuildRequest
from monodecode.kernels.triton import config as C
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights
from monodecode.runtime.platform import detect_platform

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import decode_latency as D  # noqa: E402

VARIANTS = {
    "BK 256 (before)": (1, {"bk_narrow": 256}),
    "base (1/SM, 6 stages, BK 512)": (1, {}),
    "BK 1024": (1, {"bk_narrow": 1024}),
    "BK 512, 8 stages": (1, {"bk_narrow": 512, "narrow_stages": 8}),
    "BK 1024, 16 warps": (1, {"bk_narrow": 1024, "num_warps": 16}),
    "BK 512, 2 programs/SM": (2, {}),
}


def _compile(job):
    profile, per_sm, change, sm = job
    import triton
    from triton.backends.compiler import GPUTarget

    from monodecode.kernels.plan import plan_model
    from monodecode.kernels.triton.launch import compile_options
    from monodecode.kernels.triton.offline import kernel_sources

    target = dataclasses.replace(C.CUDA, **change)
    dims = profile_dims(profile)
    for _, src in kernel_sources(dims, "bf16", 1, 16, plan_model(dims, 1, [1], sm * per_sm), target):
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=compile_options(target))
    return job


def main(profiles: list[str]) -> None:
    from concurrent.futures import ProcessPoolExecutor

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    import multiprocessing

    with ProcessPoolExecutor(16, mp_context=multiprocessing.get_context("spawn")) as ex:  # compile all variants first
        list(ex.map(_compile, [(p, per, ch, sm) for p in profiles for per, ch in VARIANTS.values()]))
    dev = torch.device("cuda")
    base_target = C.CUDA
    plat = detect_platform()
    for profile in profiles:
        dims = profile_dims(profile)
        w = random_weights(dims, 1, device=dev)
        ctx, rows = 1024, 1
        blocks = -(-ctx // 16) + 1
        alloc = BlockAllocator(blocks, 16)
        alloc.append_slots(0, ctx - 1)
        meta = alloc.decode_metadata([0], device=dev)
        kv = PagedKVCache.allocate(dims, blocks, 16, device=dev)
        x = torch.randn(rows, dims.hidden_size, device=dev).to(torch.bfloat16)
        roof = (D.weight_bytes(w) + D.kv_bytes(dims, dims.num_layers, ctx, rows)) / D.read_bandwidth(dev, gib=2.0)
        for name, (per_sm, change) in VARIANTS.items():
            C.CUDA = dataclasses.replace(base_target, **change)
            p = dataclasses.replace(plat, compute_units=plat.compute_units * per_sm)
            req = BuildRequest(dims=dims, weight_dtype="bf16", tp_size=1, widths=(1,), block_size=16, platform=p,
                               wait_timeout_s=2.0)
            from monodecode.kernels.triton.backend import TritonBackend
            from monodecode.kernels.triton.launch import _Meta

            try:
                tk = TritonBackend().build(req, w, None, allow_jit=True)
                m = _Meta(meta, dev)
                attn = torch.randn(rows, dims.q_size, device=dev).to(torch.bfloat16)
                out = {}

                def step():
                    y = x
                    for l in range(dims.num_layers):
                        y = tk.forward_layer(l, y, m, kv)
                    return y

                for part, fn in (
                    ("step", step),
                    ("k1", lambda: [tk._launch_k1(l, x, m, kv, rows) for l in range(dims.num_layers)]),
                    ("k2", lambda: [tk._launch_k2(l, x, attn, rows) for l in range(dims.num_layers)]),
                ):
                    g, _ = D._capture(fn)
                    out[part] = statistics.median(D._time_graph(g, 15)) * 1e3
                    del g
                print(f"{profile} b1 {name:32} step {out['step']:.3f} ms ({roof * 1e3 / out['step']:.1%} of roofline)"
                      f"  K1 {out['k1']:.3f}  K2 {out['k2']:.3f}  health {tk.health()}", flush=True)
                tk.close()
            except Exception as e:  # a variant that cannot launch (e.g. not co-resident) is reported
                print(f"{profile} b1 {name:32} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        C.CUDA = base_target
        del w, kv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["llama3-8b", "llama3-1b"])
