"""Running the kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``), for CPU tests.

The interpreter executes programs one after another, so the launcher gives it one program that
stands for all of them, stage by stage (``VP``). ``enable()`` shims two things in Triton
3.6's interpreter: a loop bound becomes a Python int through ``int(array)``, which NumPy >= 2.4
refuses for a 1-element 1-D array; and fp32 -> bf16 casts truncate there, while compiled code
rounds to nearest even (the reference does too), so the shim rounds them with torch.
"""

from __future__ import annotations

import os

_PATCHED = False


def enable() -> None:
    """Select the interpreter (call before the kernel modules are imported) and shim it."""
    global _PATCHED
    os.environ["TRITON_INTERPRET"] = "1"
    if _PATCHED:
        return
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched

    import numpy as np
    import torch
    import triton.language as tl

    builder = interp.InterpreterBuilder
    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interp.TensorHandle(t.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return original_cast(self, src, dst_type)

    builder.cast_impl = cast_impl
    _PATCHED = True
