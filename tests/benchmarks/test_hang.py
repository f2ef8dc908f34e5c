"""``decode_bench.hang.exit_if_stuck``: a body that has not finished by its bound ends the process
with ``HANG_EXIT`` and a line naming it (a hung launch cannot be interrupted: the benchmark names
it and stops, its saved cells kept); a body that finishes, or raises, disarms it. Each case runs in
a process of its own (the watcher exits the whole process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from monodecode_ops.decode_bench.hang import HANG_EXIT

ROOT = Path(__file__).resolve().parents[2]


def _run(body: str) -> tuple[subprocess.CompletedProcess, float]:
    code = f"import time\nfrom monodecode_ops.decode_bench.hang import exit_if_stuck\n{body}\n"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'ops'}"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    return proc, time.monotonic() - t0


def test_a_body_past_its_bound_ends_the_process_naming_it():
    proc, elapsed = _run("with exit_if_stuck('triton-step-tag at batch 1, context 1024', 0.5):\n    time.sleep(40)")
    assert proc.returncode == HANG_EXIT, (proc.returncode, proc.stdout, proc.stderr)
    assert "triton-step-tag at batch 1, context 1024 has not returned in 0.5 s" in proc.stdout
    assert elapsed < 30, f"the watcher let a stuck body run {elapsed:.0f} s"


def test_a_body_that_finishes_or_raises_disarms_it():
    proc, _ = _run(
        "with exit_if_stuck('quick', 0.5):\n    pass\n"
        "try:\n    with exit_if_stuck('raises', 0.5):\n        raise ValueError('x')\n"
        "except ValueError:\n    pass\n"
        "time.sleep(1.5)\nprint('still here')"
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout.strip() == "still here"
