"""The Triton K1/K2 logic on a CPU: Triton's interpreter runs the real kernels against the reference.

The interpreter executes programs one after another, so the launcher gives it one instance that
plays all planned programs stage by stage (``VP``); task tables, mailbox words and tags, the
completion counters, the split-context attention and its merge, the paged-KV insert and every
rounding point run as written (``kernels/triton/interpret.py`` says what it shims). It runs in a
subprocess because the interpreter is chosen when the kernel modules are imported.
Same tolerances as the GPU tests (``test_triton_numerics.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is installed by the project's 'triton' extra (make test)")

CHILD = textwrap.dedent(
    """
    import json, sys
    from monodecode.kernels.triton import interpret
    interpret.enable()
    import torch
    from monodecode.kernels.base import BuildRequest
    from monodecode.kernels.triton.config import CUDA
    from monodecode.kernels.triton.launch import TritonKernels
    from monodecode.model import reference as R
    from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
    from monodecode.model.profiles import profile_dims
    from monodecode.model.weights import random_weights
    from monodecode.runtime.platform import Platform

    def rel(a, b):
        a, b = a.float(), b.float()
        return float((a - b).norm() / b.norm()), float((a - b).abs().max() / b.abs().max())

    out = {}
    dims = profile_dims("tiny")
    for name, wd, widths, rows, layers, ctx in json.loads(sys.argv[1]):
        torch.manual_seed(0)
        w = random_weights(dims, 1, weight_dtype=wd, num_layers=layers)
        req = BuildRequest(dims=dims, weight_dtype=wd, tp_size=1, widths=tuple(widths), block_size=16,
                           platform=Platform("cuda", "sm_90", "interpreter", 8), wait_timeout_s=0.01)
        tk = TritonKernels(req, w, CUDA, 8, "cpu")
        alloc = BlockAllocator(64, 16, shuffle_seed=2)
        for i, c in enumerate(ctx):
            alloc.append_slots(i, c - 1)
        kv_ref = PagedKVCache.allocate(dims, 64, 16, num_layers=layers)
        for t in kv_ref.key + kv_ref.value:
            t.normal_()
        kv_tri = PagedKVCache([k.clone() for k in kv_ref.key], [v.clone() for v in kv_ref.value], 16)
        meta = alloc.decode_metadata(list(range(rows)))
        x = torch.randn(rows, dims.hidden_size).to(torch.bfloat16)
        res = []
        for l in range(layers):
            a_ref = R.k1_reference(dims, l, w.layers[l], x, meta, kv_ref)
            y_ref = R.k2_reference(dims, l, w.layers[l], x, a_ref)
            y_tri = tk.forward_layer(l, x, meta, kv_tri)  # pads rows up to the width
            s = meta.slot_mapping
            res.append({"y": rel(y_tri, y_ref),
                        "k": rel(kv_tri.key[l].view(-1, 2, 64)[s], kv_ref.key[l].view(-1, 2, 64)[s]),
                        "v": rel(kv_tri.value[l].view(-1, 2, 64)[s], kv_ref.value[l].view(-1, 2, 64)[s]),
                        "untouched": all(torch.equal(a.view(-1, 128)[m], b.view(-1, 128)[m])
                                         for a, b in ((kv_tri.key[l], kv_ref.key[l]), (kv_tri.value[l], kv_ref.value[l]))
                                         for m in [torch.ones(a.shape[0] * 16, dtype=torch.bool).index_fill_(0, s, False)])})
            x = y_ref
        out[name] = {"layers": res, "health": tk.health()}
    print(json.dumps(out))
    """
)

# (name, weight dtype, built widths, live rows, layers, context lengths): contexts cross KV blocks
# and exceed tiny's sliding window (24); "padded" runs 2 live rows on a width-3 build.
RUNS = [
    ("w1", "bf16", [1], 1, 4, [37]),
    ("w3_fp8", "fp8", [3], 3, 2, [5, 40, 17]),
    ("padded", "bf16", [3], 2, 2, [16, 33]),
]


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(RUNS)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_interpreted_kernels_match_reference(results, name):
    run = results[name]
    assert run["health"] == 0, f"{name}: health word {run['health']}"
    for l, layer in enumerate(run["layers"]):
        for what in ("y", "k", "v"):
            rel_fro, max_frac = layer[what]
            assert rel_fro <= 1e-2 and max_frac <= 0.03, f"{name} layer {l} {what}: {rel_fro:.2e} / {max_frac:.2%}"
        assert layer["untouched"], f"{name} layer {l}: KV entries other than the step's slots changed"
