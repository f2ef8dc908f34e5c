"""The interpreter shims of ``monodecode.kernels.triton.interpret``, on a small kernel of their own.

Run in a subprocess: ``triton.jit`` picks the interpreter when a kernel is decorated.
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
    import json
    import triton.runtime.interpreter as interp

    real_patches = []
    real = interp._patch_lang

    def counted(fn):  # under the shim: counts the language patches Triton really makes
        real_patches.append(fn.__name__)
        return real(fn)

    interp._patch_lang = counted
    from monodecode.kernels.triton import interpret
    interpret.enable()

    import torch
    import triton
    import triton.language as tl

    builtin_load = tl.load

    @triton.jit
    def twice(x):
        return x * 2.0

    @triton.jit
    def kernel(src, dst, N: tl.constexpr, REPEAT: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(src + offs)
        for _ in range(REPEAT):  # REPEAT nested device-function calls in one grid
            x = twice(x)
        tl.store(dst + offs, x.to(tl.bfloat16))

    src = torch.linspace(-3.0, 3.0, 16) + 1.0 / 3.0
    out = []
    for _ in range(2):  # two grids: each patches once and restores when it ends
        dst = torch.empty(16, dtype=torch.bfloat16)
        kernel[(1,)](src, dst, N=16, REPEAT=5)
        out.append(dst.float().tolist())
    print(json.dumps({
        "patches": real_patches,
        "restored": tl.load is builtin_load,
        "out": out,
        "want": (src * 32.0).to(torch.bfloat16).float().tolist(),
    }))
    """
)


@pytest.fixture(scope="module")
def child() -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_nested_calls_do_not_repatch_the_language(child):
    """Each grid patches ``triton.language`` once (Triton alone patches again at every one of the
    five nested ``twice`` calls: 12 patches for two grids, not 2)."""
    assert child["patches"] == ["kernel", "kernel"], child["patches"]


def test_results_and_restored_language_are_as_without_the_shim(child):
    """The nested calls still compute (x * 32, rounded to bf16 to nearest even by the cast shim),
    and ``tl.load`` is Triton's builtin again once the grids end."""
    assert child["out"] == [child["want"], child["want"]]
    assert child["restored"]
