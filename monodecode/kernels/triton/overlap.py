"""Launch boundaries without the stream's drain: programmatic dependent launch (PDL).

``PDL`` (``Target.pdl``; Hopper and later, CUDA only): every launch is made with programmatic
stream serialization, and each program calls ``launch_dependents`` first (1) or last (2), so the
stream's next launch is dispatched before this one has drained and its memory flushed. The next
launch's programs wait in ``griddepcontrol.wait`` until this launch has completed and its writes
are visible, before they read anything (the epoch counter included). A launch is dispatched only
once every program of the one before has called it (or ended), so a waiting program never holds
resources that an earlier launch's programs still need: the persistent launches' co-residency is
unaffected.

Measured on the H200 (``benchmarks/README.md``, runs 54-56): at the end (2) it saves about 1 % of
a step at 1k; at entry (1) the early programs share SMs with the running launch and the step is
5-17 % slower.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from monodecode.kernels.triton.gemv import INTERPRET


@triton.jit
def launch_next(PDL: tl.constexpr, AT: tl.constexpr):
    """Let the stream's next launch be dispatched now (its programs wait for this one's end),
    where this is the place ``PDL`` asks for (1: the launch's entry, 2: its programs' end)."""
    if PDL == AT and not INTERPRET:
        gdc_launch_dependents()


@triton.jit
def await_previous(PDL: tl.constexpr):
    """Wait until the stream's previous launch has completed and its writes are visible."""
    if PDL > 0 and not INTERPRET:
        gdc_wait()
