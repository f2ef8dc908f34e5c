"""Tagged-mailbox words and bounded waits (the hand-off protocol of ``kernels/plan.py``).

A word is an int64: the fp32 value's bits in the low half, the launch's epoch tag (31 bits) in
the high half, written with ONE plain store, so a reader that sees the tag sees the value (no
fence needed). Readers poll with volatile loads (they bypass the incoherent L1); a word from an
earlier launch carries an older tag, so nothing is ever zeroed between launches.

The epoch is derived on device from a per-width int64 launch counter that every program
increments once at exit: during launch ``n`` the counter reads in ``[n*P, n*P + P - 1]`` for a
program that has not yet added its own 1, so ``counter // P + 1`` is the same in every program.

Waits are bounded by a per-program spin budget (cumulative over the launch); on expiry the
sticky health word gets the site code (compare-and-swap from 0: the first failure wins) and the
program carries on with whatever it read, so the launch always terminates.
"""

import triton
import triton.language as tl


@triton.jit
def launch_tag(epoch_ptr, NPROG: tl.constexpr):
    """This launch's 31-bit tag (same in every program of the launch)."""
    count = tl.load(epoch_ptr, volatile=True)
    return (count // NPROG + 1) & 0x7FFFFFFF


@triton.jit
def finish_launch(epoch_ptr, programs: tl.constexpr):
    """Advance the launch counter by the programs this instance stands for (once, at exit)."""
    tl.atomic_add(epoch_ptr, programs, sem="acq_rel")


@triton.jit
def pack(value, tag):
    """fp32 value + tag -> int64 word."""
    bits = value.to(tl.float32).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return bits | (tag << 32)


@triton.jit
def unpack(word):
    """int64 word -> fp32 value."""
    return (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def missing(word, mask, tag):
    """Count of masked words whose tag is not this launch's."""
    return tl.sum(tl.ravel((mask & ((word >> 32) != tag)).to(tl.int32)), axis=0)


@triton.jit
def expire(budget, miss, health_ptr, code):
    """Record an expired wait in the sticky health word."""
    if miss > 0:
        tl.atomic_cas(health_ptr, 0, code)
    return budget


@triton.jit
def wait_words(ptrs, mask, tag, budget, health_ptr, code):
    """Poll ``ptrs`` until every masked word carries ``tag``; returns (words, budget)."""
    w = tl.load(ptrs, mask=mask, other=0, volatile=True)
    miss = missing(w, mask, tag)
    while (miss > 0) & (budget > 0):
        w = tl.load(ptrs, mask=mask, other=0, volatile=True)
        miss = missing(w, mask, tag)
        budget -= 1
    budget = expire(budget, miss, health_ptr, code)
    return w, budget


@triton.jit
def wait_words3(p1, m1, p2, m2, p3, m3, tag, budget, health_ptr, code):
    """Like ``wait_words`` for three tensors polled together (one round trip per poll)."""
    w1 = tl.load(p1, mask=m1, other=0, volatile=True)
    w2 = tl.load(p2, mask=m2, other=0, volatile=True)
    w3 = tl.load(p3, mask=m3, other=0, volatile=True)
    miss = missing(w1, m1, tag) + missing(w2, m2, tag) + missing(w3, m3, tag)
    while (miss > 0) & (budget > 0):
        w1 = tl.load(p1, mask=m1, other=0, volatile=True)
        w2 = tl.load(p2, mask=m2, other=0, volatile=True)
        w3 = tl.load(p3, mask=m3, other=0, volatile=True)
        miss = missing(w1, m1, tag) + missing(w2, m2, tag) + missing(w3, m3, tag)
        budget -= 1
    budget = expire(budget, miss, health_ptr, code)
    return w1, w2, w3, budget
