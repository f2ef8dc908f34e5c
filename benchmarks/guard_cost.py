"""Per-step cost of the fail-stop check before logits on the GPU: none, the old blocking check
(.item() + bool(isfinite)), the new guard (device fold + async copy + _assert_async).

Usage on a GPU machine, from the repository root: ``PYTHONPATH=. python benchmarks/guard_cost.py
llama3-1b,llama3-8b OUT.json`` (eager loop of the Triton K1/K2, 100 steps per mode, best of two).
"""

import json
import sys
import time

import torch

from monodecode.kernels.base import BuildRequest
from monodecode.kernels.triton.backend import TritonBackend
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights
from monodecode.runtime.guard import HealthGuard
from monodecode.services.platform import detect_platform

out = {}
for prof in sys.argv[1].split(","):
    dims = profile_dims(prof)
    w = random_weights(dims, 0, device="cuda")
    plat = detect_platform(0)
    for width in (1, 8):
        req = BuildRequest(dims=dims, weight_dtype="bf16", tp_size=1, widths=(width,), block_size=16, platform=plat)
        k = TritonBackend().build(req, w, None, True)
        alloc = BlockAllocator(width * 70 + 1, 16)
        for r in range(width):
            alloc.append_slots(r, 1024)
        kv = PagedKVCache.allocate(dims, width * 70 + 1, 16, device="cuda")
        meta = alloc.decode_metadata(list(range(width)), device="cuda")
        x0 = torch.randn(width, dims.hidden_size, device="cuda").to(torch.bfloat16)
        guard = HealthGuard(k.health_word, lambda c, s: None)

        def step(mode, i):
            x = x0
            for l in range(dims.num_layers):
                x = k.forward_layer(l, x, meta, kv)
            if mode == "blocking":
                assert k.health() == 0 and bool(torch.isfinite(x).all())
            elif mode == "guard":
                guard.check(i, x)
            return x.float().sum()  # stands in for the logits

        res = {}
        for mode in ("none", "blocking", "guard", "none", "blocking", "guard"):
            for i in range(5):
                step(mode, i)
            torch.cuda.synchronize()
            t = time.perf_counter()
            n = 100
            for i in range(n):
                step(mode, i)
            torch.cuda.synchronize()
            res[mode] = min(res.get(mode, 1e9), (time.perf_counter() - t) / n * 1e3)
        guard.drain()
        out[f"{prof} w{width}"] = res
        print(prof, width, {m: f"{v:.4f} ms" for m, v in res.items()}, flush=True)
        k.close()
json.dump(out, open(sys.argv[2], "w"), indent=1)
