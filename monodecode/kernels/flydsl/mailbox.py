"""Tagged-mailbox words, bounded waits and the launch epoch: the hand-off protocol of
``monodecode/kernels/plan.py``, the same the Triton backend implements (``kernels/triton/mailbox.py``):

* a mailbox word is 8 bytes: the fp32 value's bits in the low half, the launch's 31-bit epoch
  tag in the high half, written with ONE relaxed agent-scope 64-bit store
  (``global_store_dwordx2 ... sc1``), so a reader that sees the tag sees the value;
* readers load words with relaxed agent-scope 64-bit loads (``global_load_dwordx2 ... sc1``,
  coherent across XCDs) and poll, ``s_sleep 1`` apart, until the tag matches; a word of an
  earlier launch carries an older tag, so nothing is ever zeroed between steps;
* the tag is derived on device from the width's int64 launch counter (the plan's ``epoch_k1`` /
  ``epoch_k2`` regions): every workgroup adds 1 when it leaves, so during launch ``n`` the
  counter reads in ``[n*G, n*G + G - 1]`` before this workgroup's own add and
  ``counter // G + 1`` is the same in every workgroup (graph-safe, no host involvement);
* ``bf16`` format (one GPU): activations are plain bf16 values and attention partials plain fp32
  (``view`` gives the segment as bf16 / fp32 / 32-bit arrays); no tags. A producing stage counts
  its finished tasks in its int64 completion counter (``signal_tasks``: every thread's stores
  drained, the workgroup met, then one release add at agent scope), a consumer waits once per
  task (or GEMV tile) until the counter reaches ``epoch * tasks`` (``wait_done``: acquire at agent
  scope, so the plain loads after it see the producers' stores on every XCD); counters are never
  reset, and the last workgroup of a launch settles them at ``epoch * tasks`` (``finish_launch``),
  so a launch in which a producer never signalled (a stall drill, an expired wait) leaves the next
  one consistent;
* waits are bounded (``max_polls`` polls); on expiry the sticky health word gets the site code
  (compare-and-swap from 0: the first failure wins) and the kernel carries on with the stale
  value, so the launch always terminates and the runner's check before logits stops the step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flydsl.expr as fx
from flydsl.expr import rocdl
from flydsl.expr.primitive import range_constexpr

from monodecode.kernels.flydsl.config import health_word, task_count
from monodecode.kernels.flydsl.device import device, lds_load, lds_store, uniform

TAG_MASK = 0x7FFFFFFF
HEALTH_POLL_EVERY = 64  # a failing wait re-reads the health word this often (stops early after a failure)
# Health sites and kernel ids of monodecode.kernels.health.health_code.
SITE_WAIT, SITE_NONFINITE = 1, 2
KERNEL_K1, KERNEL_K2 = 1, 2


# ---------------------------------------------------------------- tagged words (8 bytes)
_RELAXED = fx.AtomicOrdering.Monotonic


def mb_load(mbox, idx, scope="agent"):
    """One mailbox word (int64), relaxed: at agent scope coherent across XCDs; ``scope=None``
    (system) for the TP peer buffers that other GPUs write."""
    return fx.generic_load(mbox + idx, dtype=fx.Int64, memory_order=_RELAXED, syncscope=scope)


def mb_tag(word):
    return fx.Int32(word >> fx.Int64(32))


def mb_value(word):
    return fx.Int32(word).bitcast(fx.Float32)


def mb_put(mbox, idx, tag, x, scope="agent"):
    """Publish fp32 ``x`` with this launch's tag in one 8-byte store."""
    bits = fx.Int64(fx.Float32(x).bitcast(fx.Int32)) & fx.Int64(0xFFFFFFFF)
    word = (fx.Int64(tag) << fx.Int64(32)) | bits
    fx.generic_store(mbox + idx, word, memory_order=_RELAXED, syncscope=scope)


def peer_buffer(peers, rank):
    """Rank ``rank``'s peer-buffer segment: ``peers`` holds one 64-bit device address per rank
    (IPC-mapped into this process), in the same pointer type as ``peers``."""
    return fx.inttoptr(peers.type, fx.generic_load(peers + rank, dtype=fx.Int64))


def health_load(health):
    return fx.generic_load(health, dtype=fx.Int32, memory_order=_RELAXED, syncscope="agent")


def health_ok(health):
    return health_load(health) == fx.Int32(0)


def raise_health(health, code):
    """Record the first failure only: the word keeps the code of the earliest site (sticky)."""
    fx.atomic_cas(health, fx.Int32(0), fx.Int32(code), syncscope="agent")


def health_code(site: int, kernel: int, layer):
    """``config.health_word`` on the traced layer: bits 0-7 site, 8-9 kernel (1 = k1, 2 = k2),
    10-29 layer + 1."""
    return fx.Int32(health_word(site, kernel, fx.Int32(layer)))


@device
def mb_wait(mbox, idx, tag, polls, health, code, scope="agent"):
    """Bounded wait for the word at ``idx`` to carry ``tag``; returns its fp32 value.

    The fast path is one load. On a miss the word is re-read ``s_sleep 1`` apart, at most
    ``polls`` times; every HEALTH_POLL_EVERY polls the health word is checked so that, once any
    wait of the step has failed, the others give up quickly instead of each burning a timeout.
    """
    w = mb_load(mbox, idx, scope)
    n = fx.Int32(0)
    while (mb_tag(w) != tag) & (n < polls):
        rocdl.s_sleep(1)
        w = mb_load(mbox, idx, scope)
        n = n + fx.Int32(1)
        if (n & fx.Int32(HEALTH_POLL_EVERY - 1)) == fx.Int32(0):
            if health_load(health) != fx.Int32(0):
                n = polls
    if mb_tag(w) != tag:
        raise_health(health, code)
    return mb_value(w)


@device
def mb_wait_all(mbox, idxs, valid, tag, polls, health, code, scope="agent"):
    """fp32 values of several mailbox words (``valid[i]`` False: word i is padding, not waited
    for, its value is garbage). All loads are issued back to back, so one round trip serves them
    all; only when some word is not there yet are the words waited for one by one."""
    words = [mb_load(mbox, i, scope) for i in idxs]
    vals = [mb_value(w) for w in words]
    miss = fx.Int32(0)
    for w, ok in zip(words, valid):
        miss = miss | (ok & (mb_tag(w) != tag)).select(fx.Int32(1), fx.Int32(0))
    if miss != fx.Int32(0):
        for i in range_constexpr(len(idxs)):
            if valid[i]:
                vals[i] = mb_wait(mbox, idxs[i], tag, polls, health, code, scope)
    return vals


# ---------------------------------------------------------------- launch epoch
def launch_epoch(epoch, grid: int):
    """This launch's epoch (int64: 1, 2, ...) and 31-bit tag from the width's launch counter
    (the same in every workgroup)."""
    count = fx.generic_load(epoch, dtype=fx.Int64, memory_order=_RELAXED, syncscope="agent")
    e = (count // fx.Int64(grid)) + fx.Int64(1)
    return e, uniform(fx.Int32(e & fx.Int64(TAG_MASK)))


@device
def finish_launch(epoch, tid, grid: int = 0, settle=()):
    """Count this workgroup out of the launch (once, after every thread has read the epoch). With
    ``settle`` (``(counter, epoch * tasks)`` pairs, bf16 format) the last workgroup out raises each
    stage completion counter to its target: after a healthy launch a no-op. Relaxed, as in the
    Triton kernels: nothing in the launch reads these words afterwards and the kernel boundary
    orders them before the next launch, while acq_rel atomics one after another each wait for
    memory (on the H200 the Triton exit with acq_rel cost 1.7 µs per launch, run 19)."""
    fx.gpu.barrier()
    if fx.const_expr(len(settle) == 0):
        if tid == fx.Int32(0):
            fx.atomic_add(epoch, fx.Int64(1), syncscope="agent")
    else:
        if tid == fx.Int32(0):
            old = fx.atomic_add(epoch, fx.Int64(1), syncscope="agent", ordering=_RELAXED)
            if ((old + fx.Int64(1)) % fx.Int64(grid)) == fx.Int64(0):
                for ctr, target in settle:
                    fx.atomic_max(ctr, target, syncscope="agent", ordering=_RELAXED)


# ---------------------------------------------------------------- bf16 format: plain values, completion counters
def view(like, base):
    """The address of ``base`` as a pointer of ``like``'s element type (a typed view of a segment)."""
    return fx.inttoptr(like.type, fx.ptrtoint(base))


def load_bf16(mb16, idx):
    """A bf16 value of a bf16 region as fp32 (exact)."""
    return (fx.Int32(fx.generic_load(mb16 + idx, dtype=fx.Int16)) << fx.Int32(16)).bitcast(fx.Float32)


def store_bf16(mb16, idx, x):
    """fp32 ``x`` rounded to bf16 (round to nearest even) into a bf16 region."""
    b = fx.Float32(x).bitcast(fx.Int32)
    fx.generic_store(
        mb16 + idx, fx.Int16(((b + fx.Int32(0x7FFF) + ((b >> 16) & fx.Int32(1))) >> 16) & fx.Int32(0xFFFF))
    )


def load_f32(mbf, idx):
    return fx.generic_load(mbf + idx, dtype=fx.Float32)


def store_f32(mbf, idx, x):
    fx.generic_store(mbf + idx, fx.Float32(x))


def _acquire(ctr):
    return fx.generic_load(ctr, dtype=fx.Int64, memory_order=fx.AtomicOrdering.Acquire, syncscope="agent")


@device
def wait_done(ctr, target, polls, health, code):
    """Bounded wait (acquire, agent scope) until a stage completion counter reaches ``target``
    (``epoch * tasks``); on expiry the health word gets ``code``. Every thread waits, so every
    wave's own acquire orders its later plain loads after the producers' stores."""
    seen = _acquire(ctr)
    n = fx.Int32(0)
    while (seen < target) & (n < polls):
        rocdl.s_sleep(1)
        seen = _acquire(ctr)
        n = n + fx.Int32(1)
        if (n & fx.Int32(HEALTH_POLL_EVERY - 1)) == fx.Int32(0):
            if health_load(health) != fx.Int32(0):
                n = polls
    if seen < target:
        raise_health(health, code)


@device
def wait_first(c0, ctr, target, polls, health, code):
    """``wait_done`` before a GEMV task's first chunk (once per tile): its first weights are
    already loading, so they stream in during the wait."""
    if c0 == fx.Int32(0):
        wait_done(ctr, target, polls, health, code)


def drain_stores():
    """Every thread's stores drained, the workgroup met: a release by one thread then covers them."""
    rocdl.s_waitcnt(vmcnt=0)
    fx.gpu.barrier()


@device
def signal_tasks(ctr, first, tasks: int, grid: int, tid, enable):
    """Count this workgroup's finished tasks of a stage (``first, first + grid, ...``) after its
    stage loop: every thread's stores drained, the workgroup met (``drain_stores``), then one
    release add (agent scope) by thread 0. ``enable`` false: nothing is counted (the consumers'
    waits expire)."""
    drain_stores()
    if (tid == fx.Int32(0)) & (first < fx.Int32(tasks)) & enable:
        fx.atomic_add(
            ctr, fx.Int64(task_count(first, tasks, grid)), syncscope="agent", ordering=fx.AtomicOrdering.Release
        )


@device
def arrive_last(ctr, slices: int, tid, lds, flag: int):
    """Split-K merge: one K slice of a row tile arrives (its partials stored by every thread and
    drained, the workgroup met: ``drain_stores``). Thread 0 adds 1 to the tile's int64
    arrival counter (acq_rel, agent scope; monotonic, never reset: every launch adds exactly
    ``slices``, so ``old % slices == slices - 1`` is the last slice; int64 as the stage counters:
    an int32 one would wrap negative within a day of serving, and ``slices`` may be 3) and hands the answer to the
    workgroup through LDS word ``flag``. Returns whether this is the last slice; then every thread
    has acquired the counter, so its plain loads see the other slices' partials (released before
    their adds)."""
    if tid == fx.Int32(0):
        old = fx.atomic_add(ctr, fx.Int64(1), syncscope="agent", ordering=fx.AtomicOrdering.AcqRel)
        is_last = (old % fx.Int64(slices)) == fx.Int64(slices - 1)
        lds_store(lds, fx.Int32(flag), is_last.select(fx.Int32(1), fx.Int32(0)))
    fx.gpu.barrier()
    last = uniform(lds_load(lds, fx.Int32(flag))) != fx.Int32(0)
    fx.gpu.barrier()  # every thread has read the flag before the next tile's arrival overwrites it
    if last:
        _acquire(ctr)
    return last


class Segment(NamedTuple):
    """A width's scratch segment as the kernels address it: the 8-byte words (tagged words, epoch
    and completion counters) and, for the bf16 format, typed views of the same address."""

    words: Any  # int64 elements
    bf16: Any  # 16-bit elements: bf16 activations
    f32: Any  # fp32 elements: attention partials
    i32: Any  # 32-bit elements: bf16 pairs, staged as they are
    bf16_format: bool  # the plan's mailbox format: bf16 (else tagged)


def segment(mbox, bf16_like, f32_like, i32_like, bf16_format: bool) -> Segment:
    """``mbox`` (an int64 pointer) with its views, typed like the given pointer arguments."""
    return Segment(mbox, view(bf16_like, mbox), view(f32_like, mbox), view(i32_like, mbox), bf16_format)


def fetch(seg: Segment, idxs, valid, tag, polls, health, code, partial: bool = False):
    """fp32 values at ``idxs`` of a region: bf16 values (fp32 for attention partials) read
    after the producing stage's wait, or tagged words waited for one by one."""
    if seg.bf16_format:
        return [load_f32(seg.f32, i) if partial else load_bf16(seg.bf16, i) for i in idxs]
    return mb_wait_all(seg.words, idxs, valid, tag, polls, health, code)


def publish(seg: Segment, idx, tag, x, partial: bool = False):
    """Publish fp32 ``x`` at ``idx`` of a region: bf16 (fp32 for a ``partial``) or a tagged word."""
    if seg.bf16_format:
        if partial:
            store_f32(seg.f32, idx, x)
        else:
            store_bf16(seg.bf16, idx, x)
    else:
        mb_put(seg.words, idx, tag, x)


def wait_ready(seg: Segment, ready, polls, health, code):
    """bf16 format: wait once (per task) for the producing stage, ``ready = (counter, target)``;
    tagged words are waited for as they are read."""
    if seg.bf16_format:
        wait_done(ready[0], ready[1], polls, health, code)


@device
def put_row(seg: Segment, tag, tok, region, n, row, x, enable, partial: bool = False):
    """Publish output ``row`` of token ``tok`` into a (W, n) region (rows past n are padding);
    ``partial``: an fp32 split-K partial (``tok`` counts rows of every slice before its own)."""
    if enable & (row < fx.Int32(n)):
        publish(seg, fx.Int32(region) + tok * fx.Int32(n) + row, tag, x, partial)
