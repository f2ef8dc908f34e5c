"""Per-stage, per-program timestamps of K1/K2 (``%globaltimer``), for the benchmark's timeline.

Compiled in only when the ``PROF`` constexpr is on (CUDA targets; the default build has no
trace of it). Each program stores three stamps per stage: on entering the stage (before its
wait), once the wait is over, and after its last task (and its completion signal) — into
``prof[layer, kernel, program, stage, 0:3]`` of an int64 buffer (``SLOTS`` words per stage).
"""

import triton
import triton.language as tl

MAX_STAGES = 5
SLOTS = 4
K1_STAGES = ("qkv", "attn", "combine")
# gate_up and down stand for both halves where the plan splits them (``plan.early_down_waves``):
# their stamps are entry, the end of the first half's wait, and the end of the second half
K2_STAGES = ("o_proj", "post", "gate_up", "down", "final")


def buffer_words(num_layers: int, num_programs: int) -> int:
    return num_layers * 2 * num_programs * MAX_STAGES * SLOTS


@triton.jit
def stamp(
    prof_ptr,
    layer,
    pid,
    KID: tl.constexpr,
    STAGE: tl.constexpr,
    SLOT: tl.constexpr,
    NPROG: tl.constexpr,
    PROF: tl.constexpr,
):
    if PROF:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(prof_ptr + (((layer * 2 + KID) * NPROG + pid) * 5 + STAGE) * 4 + SLOT, t)
