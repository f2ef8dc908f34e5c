"""Work a program does before its inputs exist: programmatic dependent launch and L2 prefetch.

``PDL`` (``Target.pdl``; Hopper and later, CUDA only): every launch is made with programmatic
stream serialization, and each program calls ``launch_dependents`` first (1) or last (2), so the
stream's next launch is dispatched while this one runs instead of after it has drained. The next
launch's programs park in ``griddepcontrol.wait`` until this launch has completed and its
writes are visible, then read anything at all (the epoch counter included); only weights,
which no launch writes, are touched before that wait. A launch is dispatched only once every
program of the one before has started, so a parked program never holds resources that an
earlier launch's programs still need: the persistent launches' co-residency is unaffected.

Prefetch (``Target.prefetch_kib``): before a wait, a program asks L2 for the first weight bytes
its next task streams (``prefetch.global.L2``, one per 128-byte line, at most ``PF_BYTES`` per
matrix), so HBM works while the program waits, and the task's pipeline starts on L2 hits.
``prefetch_tile`` is a hint: it changes no value, and it compiles to nothing with ``PF_BYTES`` 0
(the interpreter and HIP builds).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from monodecode.kernels.triton.gemv import INTERPRET

_CHUNK: tl.constexpr = tl.constexpr(1024)  # prefetched lines per pass (4 per thread at 8 warps)


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


@triton.jit
def first_tile(pid, OFF: tl.constexpr, TASKS: tl.constexpr, TILES: tl.constexpr, ROWS: tl.constexpr,
               KT: tl.constexpr, NPROG: tl.constexpr):  # fmt: skip
    """Program ``pid``'s first task of a GEMV stage whose task ``t`` covers row tile ``t % TILES``
    (``ROWS`` rows each) over K slice ``t // TILES`` (``KT`` columns): (has one, first row, first
    column). The same task order as the stages' loops (task t on program ``(t + OFF) % NPROG``)."""
    t = (pid - OFF + NPROG) % NPROG
    return t < TASKS, (t % TILES) * ROWS, (t // TILES) * KT


@triton.jit
def prefetch_tile(w_ptr, n0, N, go, ROW: tl.constexpr, KT: tl.constexpr, ROWS: tl.constexpr,
                  ESIZE: tl.constexpr, PF_BYTES: tl.constexpr):  # fmt: skip
    """Ask L2 for rows ``[n0, n0 + ROWS)`` (below ``N``) x columns ``[0, KT)`` of the row-major
    weights at ``w_ptr`` (``ROW`` elements per row, ``ESIZE`` bytes each), at most ``PF_BYTES``
    of them (whole rows from the first), where ``go``."""
    LINE: tl.constexpr = 128 // ESIZE
    NL: tl.constexpr = (KT + LINE - 1) // LINE  # lines per row
    CAP: tl.constexpr = PF_BYTES // (NL * 128)
    PR: tl.constexpr = ROWS if ROWS < CAP else (CAP if CAP > 0 else 1)  # rows prefetched
    if PF_BYTES > 0 and not INTERPRET:
        if go:
            for c in tl.static_range(0, PR * NL, _CHUNK):
                idx = c + tl.arange(0, _CHUNK)
                r = idx // NL
                ok = (idx < PR * NL) & (n0 + r < N)
                p = w_ptr + (n0 + r).to(tl.int64) * ROW + (idx % NL) * LINE
                p = tl.where(ok, p, w_ptr)  # a masked lane asks for the first line again: harmless
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1
                )
