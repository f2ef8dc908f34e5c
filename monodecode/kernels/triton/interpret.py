"""Running the kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``), for CPU tests.

The interpreter executes programs one after another, so the launcher gives it one program that
stands for all of them, stage by stage (``VP``). ``enable()`` shims two things in Triton
3.6's interpreter: a loop bound becomes a Python int through ``int(array)``, which NumPy >= 2.4
refuses for a 1-element 1-D array; and fp32 -> bf16 casts truncate there, while compiled code
rounds to nearest even (the reference does too), so the shim rounds them with torch. It also
makes the interpreter faster without changing what it computes (``skip_nested_lang_patches``).
"""

from __future__ import annotations

import inspect
import os

_PATCHED = False
_NESTED_SKIPPED = False


def skip_nested_lang_patches() -> None:
    """Patch ``triton.language`` once per grid, not again at every nested ``@triton.jit`` call.

    Triton 3.6's interpreter re-patches the language modules on each device-function call: an
    ``inspect.getmembers`` over ``tl``, ``tl.core``, ``tl.math`` and the tensor class: 27.8 of 76 s
    of two interpreted test_triton_interpreter runs under cProfile (on the 2-core host, those two
    runs took 33.6 s before, 21-29 s with this, the spread being the host's). Inside a grid whose
    patch is live, the repeat installs the same wrappers over the same interpreter builder, so it
    is skipped; a nested call whose module sees a language module the grid did not patch still
    patches it, as before. The grid restores everything when it ends, as before.
    """
    global _NESTED_SKIPPED
    if _NESTED_SKIPPED:
        return
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original = interp._patch_lang
    langs_of = (tl, tl.core)
    patched: frozenset[int] | None = None  # the language modules the running grid has patched (one at a time)
    seen: dict[object, frozenset[int]] = {}  # a function's language modules (its globals' modules stay)

    def langs(fn) -> frozenset[int]:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs_of)
        return seen[fn]

    def patch_lang(fn):
        nonlocal patched
        wanted = langs(fn)
        if patched is not None:  # a device-function call inside a running grid (its own call comes first)
            if wanted <= patched:
                return interp._LangPatchScope()  # nothing to undo: the grid's patch covers it
            patched |= wanted
            return original(fn)
        scope = original(fn)
        patched = wanted
        restore = scope.restore

        def restore_and_end_grid() -> None:
            nonlocal patched
            patched = None
            restore()

        scope.restore = restore_and_end_grid
        return scope

    interp._patch_lang = patch_lang
    _NESTED_SKIPPED = True


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
    skip_nested_lang_patches()
    _PATCHED = True
