"""The read probes (``monodecode_ops.decode_bench.probes``): the Triton streaming-read kernel reads
every element once (its sum is the tensor's sum, for grids and tiles that do not divide the
length), run under Triton's CPU interpreter; the datasheet table knows the H200; the warm-up
before the probes lasts its seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("triton")

from monodecode_ops.decode_bench.probes import spec_bandwidth, warm_up  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, sys, torch
from monodecode.kernels.triton.interpret import enable
enable()
from monodecode_ops.decode_bench.probes import triton_stream_sum
x = torch.rand(10007, generator=torch.Generator().manual_seed(0))
out = [[float(triton_stream_sum(x, p, b, num_warps=4)), float(x.double().sum())] for p, b in json.loads(sys.argv[1])]
print(json.dumps(out))
"""


def test_triton_read_probe_reads_every_element_once():
    shapes = [(3, 256), (5, 1024), (1, 4096), (64, 128)]  # 10007 elements: no shape divides it
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'ops'}", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(shapes)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for (got, want), shape in zip(json.loads(proc.stdout.strip().splitlines()[-1]), shapes):
        assert got == pytest.approx(want, rel=1e-5), shape


def test_spec_bandwidth_by_device_name():
    assert spec_bandwidth("NVIDIA H200") == 4.8e12
    assert spec_bandwidth("AMD Instinct MI300X") == 5.3e12
    assert spec_bandwidth("Some GPU") is None


def test_the_warm_up_reads_for_its_seconds_then_stops():
    """``warm_up`` calls the read (and its synchronize) until its seconds are over, at least once:
    a probe timed on a card fresh from idle read 3 % slow (run 187)."""
    calls, syncs = [], []
    t0 = time.monotonic()
    n = warm_up(lambda: calls.append(time.monotonic()), 0.3, lambda: syncs.append(1))
    took = time.monotonic() - t0
    assert n == len(calls) == len(syncs) > 1
    assert 0.3 <= took < 0.5  # promptly after its seconds: each call is short
    assert warm_up(lambda: calls.append(0), 0.0, lambda: None) == 1
