"""The decode benchmark's two step timers on a real device (``probes.time_calls``: one call after a
synchronize; ``probes.time_back_to_back``: calls queued back to back between two events). Marked
``gpu``: skipped with a printed reason where torch sees no GPU (CI); ``device_run.sh gpu_all`` runs it."""

from __future__ import annotations

import pytest
import torch

from monodecode_ops.decode_bench.probes import time_back_to_back, time_calls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU torch can launch on"),
]


def test_a_graph_of_many_short_kernels_times_shorter_back_to_back():
    """A graph of 200 tiny kernels: a lone replay pays its submission, replays queued back to back
    overlap it with the previous replay's kernels, so the per-call time can only be shorter; and a
    replay that does 4x the work takes longer by either method (the timers see the device)."""

    def graph_of(n):
        x = torch.zeros(1024, device="cuda")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                x.add_(1.0)
        return g

    small, large = graph_of(200), graph_of(800)
    for g in (small, large):
        g.replay()
    torch.cuda.synchronize()
    one = sorted(time_calls(small.replay, 20))[10]
    b2b = sorted(time_back_to_back(small.replay, 20, rounds=5))[2]
    assert 0 < b2b <= one * 1.05, (b2b, one)
    assert sorted(time_back_to_back(large.replay, 20, rounds=5))[2] > 2 * b2b
    assert sorted(time_calls(large.replay, 20))[10] > 2 * one
