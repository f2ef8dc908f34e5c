"""The health guard before logits: what it folds into the code, and (on a GPU) that it neither
blocks the host nor lets a failed step go unrecorded."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from monodecode.kernels.health import decode_health, health_code
from monodecode.runtime.guard import NONFINITE_CODE, HealthGuard, folded_code

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU torch can launch on")


@pytest.mark.parametrize(
    "word, x, expected",
    [
        (0, torch.ones(2, 4), 0),
        (0, None, 0),
        (0, torch.tensor([[1.0, float("nan")]]), NONFINITE_CODE),
        (0, torch.tensor([[float("-inf"), 1.0]]), NONFINITE_CODE),
        (health_code("wait_timeout", 1, "k2"), torch.ones(1, 2), health_code("wait_timeout", 1, "k2")),
        # the kernel's own (first) cause wins over the residual check
        (health_code("nonfinite", 3, "k2"), torch.tensor([[float("nan")]]), health_code("nonfinite", 3, "k2")),
    ],
)
def test_folded_code(word, x, expected):
    assert int(folded_code(torch.tensor(word, dtype=torch.int32), x)) == expected


def test_cpu_guard_hands_the_cause_and_step_over_before_logits():
    seen = []

    def fail(code, step):
        seen.append((decode_health(code), step))
        raise RuntimeError("stopped")

    word = torch.zeros((), dtype=torch.int32)
    guard = HealthGuard(word, fail)
    guard.check(0, torch.ones(1, 4))
    guard.check(1, None)
    assert seen == []
    with pytest.raises(RuntimeError, match="stopped"):
        guard.check(2, torch.tensor([[0.0, float("inf")]]))
    word.fill_(health_code("wait_timeout", 2, "k1"))
    with pytest.raises(RuntimeError):
        guard.check(3, None)  # a fallback step: the sticky word alone
    assert [(f.site, f.layer, f.kernel, s) for f, s in seen] == [
        ("nonfinite", None, None, 2),
        ("wait_timeout", 2, "k1", 3),
    ]


@pytest.mark.gpu
@needs_cuda
def test_gpu_check_never_syncs_the_host():
    """Under torch's sync debug mode a blocking device->host read raises: the guard issues none,
    while the check it replaced (``.item()`` and ``bool(isfinite(x).all())``) does."""
    word = torch.zeros((), dtype=torch.int32, device="cuda")
    x = torch.randn(8, 64, device="cuda")
    guard = HealthGuard(word, lambda code, step: None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(20):
            guard.check(step, x)
        with pytest.raises(RuntimeError):
            int(word.item())
        with pytest.raises(RuntimeError):
            bool(torch.isfinite(x).all())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    guard.drain()


GPU_TRAP = textwrap.dedent(
    """
    import json, os, sys, torch
    from monodecode.kernels.health import decode_health, health_code
    from monodecode.runtime.guard import HealthGuard

    def fail(code, step):
        f = decode_health(code)
        print(json.dumps({"site": f.site, "layer": f.layer, "kernel": f.kernel, "step": step}), flush=True)
        os._exit(70)

    word = torch.zeros((), dtype=torch.int32, device="cuda")
    guard = HealthGuard(word, fail)
    x = torch.ones(4, 16, device="cuda")
    for step in range(3):
        guard.check(step, x)
        print("token", step, int(x.sum()), flush=True)
    word.fill_(health_code("wait_timeout", 5, "k1"))
    guard.check(3, x)
    logits = x * 2  # queued after the assert: never computed
    print("token", 3, int(logits.sum()), flush=True)
    """
)


@pytest.mark.gpu
@needs_cuda
def test_gpu_failed_step_traps_and_the_watcher_records_it(tmp_path):
    script = tmp_path / "trap.py"
    script.write_text(GPU_TRAP)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 70, p.stderr
    lines = p.stdout.splitlines()
    assert [l.split()[1] for l in lines if l.startswith("token")] == ["0", "1", "2"]  # none for step 3
    (cause,) = [json.loads(l) for l in lines if l.startswith("{")]
    assert cause == {"site": "wait_timeout", "layer": 5, "kernel": "k1", "step": 3}
