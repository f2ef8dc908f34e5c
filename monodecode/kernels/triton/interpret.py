"""Running the kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``), for CPU tests.

The interpreter executes programs one after another, so the launcher gives it one program that
stands for all of them, stage by stage (``VP``). Triton 3.6's interpreter turns a loop bound
into a Python int with ``int(array)``, which NumPy >= 2.4 refuses for a 1-element 1-D array;
``enable()`` installs a one-line shim that reads the element instead.
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
    _PATCHED = True
