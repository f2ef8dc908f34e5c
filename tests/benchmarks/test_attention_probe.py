"""``benchmarks/attention_probe.py`` launches K1's attention task with the arguments it takes.

The probe wraps ``attention.attn_task`` in a plain grid kernel; a change to the task's signature
would break it only on a GPU machine, where device time is scarce. Here its arguments are built
on the meta device (the same ``setup`` the GPU run uses) and the wrapper is compiled for sm_90
on the CPU. Also checked: the timed launches cycle through at least ``L2_FLUSH_BYTES`` of KV.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from monodecode.kernels.triton.sources import _signature  # noqa: E402

PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("attention_probe", PROBE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("profile, batch, layout", [("gemma3-27b", 8, "vllm"), ("llama3-8b", 2, "planes")])
def test_probe_kernel_compiles_with_its_launch_arguments(profile, batch, layout):
    probe = _probe()
    su = probe.setup(profile, batch, 1024, 132, layout, device="meta")
    assert len(su.launches) * su.kv_bytes >= probe.L2_FLUSH_BYTES
    consts = {**su.consts, "BT": 64, "STAGES": 3}
    sig, attrs = _signature(probe._attn_grid, list(su.launches[0]), consts)
    src = ASTSource(probe._attn_grid, sig, consts, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert "mma.sync" in compiled.asm["ptx"]  # the scores and the weighted sum on matrix instructions
