"""``benchmarks/gemv_probe.py`` runs K2's GEMV task the way the kernels do, split along K included.

The probe wraps ``gemv.gemv_task`` in a persistent grid; a wrong K-slice offset or a signature
drift would only show on a GPU machine, where device time is scarce. Here the wrapper runs in
Triton's CPU interpreter (a child process: the interpreter is chosen before Triton is imported)
on a small matrix, every setting kind the probe times, against ``F.linear`` in fp32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
    from monodecode.kernels.triton.interpret import enable
    enable()
    import torch, triton
    import gemv_probe as probe

    torch.manual_seed(0)
    n, k, grid = 192, 1024, 4
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    out = {"shape": list(probe._shape("llama3-8b:down"))}
    for s in json.loads(sys.argv[2]):
        x = torch.randn(s["W"], k).to(torch.bfloat16)
        y = torch.zeros(s["KS"], s["W"], n)
        tasks = triton.cdiv(n, s["BN"]) * s["KS"]
        probe._gemv_grid[(grid,)](
            w, x, y, torch.zeros(1, dtype=torch.int32), n, tasks, K=k, W=s["W"], WP=s["WP"], BN=s["BN"],
            BK=s["BK"], KS=s["KS"], STAGES=s["STAGES"], NPROG=grid,
        )
        ref = torch.nn.functional.linear(x.float(), w.float())
        out[f"{s['mode']}-{s['BN']}-{s['KS']}"] = float((y.sum(0) - ref).abs().max() / ref.abs().max())
    print(json.dumps(out))
    """
)

# the probe's own setting kinds, at this matrix's sizes: width 1's FMA tile, a whole-K dot tile, 64-row
# dot tiles split in two and four K slices (the slices' partials are summed here, as K2's merge does)
SETTINGS = [
    dict(mode="w1", W=1, WP=1, BN=16, BK=256, KS=1, STAGES=2),
    dict(mode="dot", W=3, WP=16, BN=32, BK=128, KS=1, STAGES=2),
    dict(mode="dot", W=3, WP=16, BN=64, BK=128, KS=2, STAGES=2),
    dict(mode="dot", W=8, WP=16, BN=64, BK=128, KS=4, STAGES=2),
]


def test_probe_settings_compute_the_gemv_split_or_not():
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), json.dumps(SETTINGS)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("shape") == [4096, 14336]  # llama3-8b's down: hidden rows, intermediate columns
    assert len(out) == len(SETTINGS)
    for name, err in out.items():
        assert err < 1e-5, f"{name}: max error {err:.2e} of the largest output"
