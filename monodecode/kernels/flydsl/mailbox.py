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
* waits are bounded (``max_polls`` polls); on expiry the sticky health word gets the site code
  (compare-and-swap from 0: the first failure wins) and the kernel carries on with the stale
  value, so the launch always terminates and the runner's check before logits stops the step.
"""

from __future__ import annotations

import flydsl.expr as fx
from flydsl.expr import rocdl
from flydsl.expr.primitive import range_constexpr

from monodecode.kernels.flydsl.config import health_word
from monodecode.kernels.flydsl.device import device, uniform

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
def launch_tag(epoch, grid: int):
    """This launch's 31-bit tag from the width's launch counter (same in every workgroup)."""
    count = fx.generic_load(epoch, dtype=fx.Int64, memory_order=_RELAXED, syncscope="agent")
    tag = fx.Int32(((count // fx.Int64(grid)) + fx.Int64(1)) & fx.Int64(TAG_MASK))
    return uniform(tag)


@device
def finish_launch(epoch, tid):
    """Count this workgroup out of the launch (once, after every thread has read the tag)."""
    fx.gpu.barrier()
    if tid == fx.Int32(0):
        fx.atomic_add(epoch, fx.Int64(1), syncscope="agent")


@device
def put_row(mbox, tag, tok, region, n, row, v, enable):
    """Publish output ``row`` of token ``tok`` into a (W, n) region (rows past n are padding)."""
    if enable & (row < fx.Int32(n)):
        mb_put(mbox, fx.Int32(region) + tok * fx.Int32(n) + row, tag, v)
