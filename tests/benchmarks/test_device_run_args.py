"""``benchmarks/device_run.sh`` refuses a bound in seconds that is not a whole number with one line
naming it, exit 2, before it writes anything (no run folder, no results folder)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("var", "value"), [("STACK_S", "abc"), ("BUDGET_S", "-5"), ("BENCH_TIMEOUT", "10; rm -rf x")])
def test_a_bound_that_is_not_whole_seconds_is_refused_before_any_write(var, value, tmp_path):
    env = {**os.environ, var: value, "OUT": str(tmp_path / "out"), "RUN": str(tmp_path / "run")}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_run.sh"), "tests"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [
        f"device_run.sh: {var} must be a whole number of seconds, got '{value}'"
    ]
    assert list(tmp_path.iterdir()) == [], "device_run.sh wrote before refusing its arguments"
