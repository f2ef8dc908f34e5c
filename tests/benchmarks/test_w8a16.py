"""The split-K W8A16 GEMM of the FP8 stock bar (``monodecode_ops.decode_bench.w8a16``).

Under Triton's CPU interpreter (a subprocess: the interpreter is chosen before Triton compiles
anything): its result is ``x @ (w * s).T`` for row counts 1-8, shapes that no tile or slice
divides, and several slices; and the fullgraph stock step built on it (one tiny Gemma-style FP8
layer, compiled by inductor on the CPU) matches the reference layer within the kernels' 1e-2.
For sm_90 it compiles to matrix instructions fed by asynchronous copies (the launch specializes
the divisible sizes and pointers, as the GPU launch does). Cost: about 30 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
CHILD = r"""
import json, torch
from monodecode.kernels.triton.interpret import enable
enable()
from monodecode_ops.decode_bench.w8a16 import split_for, w8a16_linear, _programs
g = torch.Generator().manual_seed(0)
out = {"gemm": []}
for m, n, k in ((1, 200, 1000), (3, 64, 512), (8, 130, 4096)):
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / 4).to(torch.float8_e4m3fn)
    s = torch.rand(1, n, generator=g) + 0.5
    ref = (x.float() @ w.float().t()) * s
    y = w8a16_linear(x, w, s)
    out["gemm"].append([m, n, k, split_for(n, k, _programs(x.device))[0], float((y.float() - ref).norm() / ref.norm())])

from monodecode.model import reference as R
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights
from monodecode_ops.decode_bench.fullgraph import FullgraphStockDecode
torch.manual_seed(0)
dims = profile_dims("tiny")
w = random_weights(dims, 3, weight_dtype="fp8", num_layers=1)
alloc = BlockAllocator(16, 16, shuffle_seed=4)
for r in range(3):
    alloc.append_slots(r, 39)
meta = alloc.decode_metadata([0, 1, 2])
kv = PagedKVCache.allocate(dims, 16, 16, num_layers=1)
for t in kv.key + kv.value:
    t.normal_()
step = FullgraphStockDecode(dims, w, 40, "cpu", splitk=True)
step.load_cache(kv, meta)
step.prepare(meta, 16)
x = torch.randn(3, dims.hidden_size).to(torch.bfloat16)
y = step.forward_layer(0, x, meta, None)
ref = R.decode_layer(dims, 0, w.layers[0], x, meta, kv)
out["layer"] = float((y.float() - ref.float()).norm() / ref.float().norm())
out["fp8_path"] = step.fp8_path
print(json.dumps(out))
"""


def test_w8a16_gemm_and_its_fullgraph_layer_under_the_interpreter():
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'ops'}", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for m, n, k, split, err in got["gemm"]:
        assert err <= 4e-3, (m, n, k, err)  # one bf16 rounding of the output
    assert any(split > 1 for *_, split, _ in got["gemm"])  # the split-K path ran
    assert got["layer"] <= 1e-2, got["layer"]
    assert "split-K" in got["fp8_path"]


def test_w8a16_kernel_compiles_to_mma_with_async_copies_for_sm90():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from monodecode_ops.decode_bench import w8a16 as W

    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
    sig |= {"k_per_split": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 5, 6)}  # pointers, K, k_per_split
    src = ASTSource(W.w8a16_partials_kernel, sig, {"BM": W.BM, "BN": W.BN, "BK": W.BK}, attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "cp.async" in ptx and "ld.global.b8" not in ptx  # weights streamed, not byte by byte
