"""Mailbox hand-offs and bounded waits (the protocol of ``kernels/plan.py``).

Two formats (``plan.MAILBOX_FORMATS``, one per built width; kernels pick with ``BF16MB``):
``bf16`` regions hold plain bf16 activations (fp32 attention partials) and rely on the stage
completion counters alone (``region``, ``publish``, ``fetch``); ``tagged`` regions hold the words
described below and every read also checks the tags.

A tagged word is an int64: the fp32 value's bits in the low half, the launch's epoch tag (31 bits) in
the high half, written with ONE plain store, so a reader that sees the tag sees the value (no
fence needed). Readers poll with volatile loads (they bypass the incoherent L1); a word from an
earlier launch carries an older tag, so nothing is ever zeroed between launches.

The epoch is derived on device from a per-width int64 launch counter that every program
increments once at exit: during launch ``n`` the counter reads in ``[n*P, n*P + P - 1]`` for a
program that has not yet added its own 1, so ``counter // P + 1`` is the same in every program.

Waits are bounded by a per-program spin budget (cumulative over the launch); on expiry the
sticky health word gets the site code (compare-and-swap from 0: the first failure wins) and the
program carries on with whatever it reads, so the launch always terminates.

Waiting is done on one word per producing stage: a monotonic completion counter that counts the
stage's finished tasks (release, after a CTA barrier, once their words are stored; GEMV stages
count a program's tasks together after its task loop, ``signal_tasks``); a consumer polls it with an
acquire atomic until it reaches ``epoch * tasks``, then reads the words (``.cg`` / volatile loads,
never a stale L1 line) and checks every tag (``check_tags``: a mismatch is a protocol failure
recorded in the health word). Polling one word keeps spinning programs from flooding L2 while
their neighbours still stream weights. ``wait_words`` (poll the words themselves) remains for
consumers of a few words.
"""

import triton
import triton.language as tl


@triton.jit
def launch_epoch(epoch_ptr, NPROG: tl.constexpr):
    """This launch's epoch (1, 2, ...; the same in every program of the launch) and its 31-bit tag."""
    count = tl.load(epoch_ptr, volatile=True)
    epoch = count // NPROG + 1
    return epoch, epoch & 0x7FFFFFFF


@triton.jit
def signal_done(ctr_ptr):
    """Count one finished task of a stage, after all of this program's stores for it (release)."""
    tl.debug_barrier()
    tl.atomic_add(ctr_ptr, 1, sem="release", scope="gpu")


@triton.jit
def signal_tasks(ctr_ptr, first, TASKS, NPROG: tl.constexpr):
    """Count all of this program's finished tasks of a stage (``first, first + NPROG, ...``) at
    once, after the stage's loop: consumers wait for the whole stage anyway, and a barrier or a
    release inside a GEMV task loop would stop Triton from pipelining the loop across tasks."""
    if first < TASKS:
        tl.debug_barrier()
        tl.atomic_add(ctr_ptr, (TASKS - first + NPROG - 1) // NPROG, sem="release", scope="gpu")


@triton.jit
def wait_done(ctr_ptr, target, budget, health_ptr, code):
    """Wait (acquire) until a stage's completion counter reaches ``target`` (epoch * tasks).
    A scalar atomic's result is broadcast to the whole program, so all warps leave together."""
    seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
    while (seen < target) & (budget > 0):
        seen = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
        budget -= 1
    if seen < target:
        tl.atomic_cas(health_ptr, 0, code)
    return budget


@triton.jit
def check_tags(words, mask, tag, health_ptr, code):
    """Words read after a wait must all carry this launch's tag; any other is a protocol failure
    (recorded in the health word, never waited on)."""
    bad = tl.sum(tl.ravel((mask & ((words >> 32) != tag)).to(tl.int32)), axis=0)
    if bad > 0:
        tl.atomic_cas(health_ptr, 0, code)


@triton.jit
def finish_launch(epoch_ptr, programs: tl.constexpr, NPROG: tl.constexpr, c1, t1, c2, t2, c3, t3, c4, t4, c5, t5):
    """Advance the launch counter by the programs this instance stands for (once, at exit).

    The program that finishes last settles the stage completion counters at ``epoch * tasks``
    (``atomic_max``: a no-op after a healthy launch). After a launch in which a producer never
    signalled (an injected stall, a wait that expired) the next launch starts consistent.
    Nothing in this launch reads these words after they change, and the kernel boundary orders
    them before the next launch, so the atomics are relaxed: with ``acq_rel`` each one was fenced,
    the last program paid five memory round trips in a row, and the gap from one launch's last
    stage to the next launch's first was 3.5 µs instead of 1.8 (H200, run 19)."""
    old = tl.atomic_add(epoch_ptr, programs, sem="relaxed")
    if (old + programs) % NPROG == 0:
        tl.atomic_max(c1, t1, sem="relaxed")
        tl.atomic_max(c2, t2, sem="relaxed")
        tl.atomic_max(c3, t3, sem="relaxed")
        tl.atomic_max(c4, t4, sem="relaxed")
        tl.atomic_max(c5, t5, sem="relaxed")


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
def _misses(b1, n1, b2, n2, b3, n3, c0, i, tag, POLL: tl.constexpr, UNROLL: tl.constexpr):
    """Untagged words among flat positions [c0, c0 + UNROLL*POLL) of the concatenation
    b1[0:n1] ++ b2[0:n2] ++ b3[0:n3]; the UNROLL loads are independent, so they are in flight together."""
    cnt = tl.zeros([POLL], dtype=tl.int32)
    for u in tl.static_range(UNROLL):
        idx = c0 + u * POLL + i
        ptr = tl.where(idx < n1, b1 + idx, tl.where(idx < n1 + n2, b2 + (idx - n1), b3 + (idx - n1 - n2)))
        m = idx < n1 + n2 + n3
        w = tl.load(ptr, mask=m, other=0, volatile=True)
        cnt += (m & ((w >> 32) != tag)).to(tl.int32)
    return tl.sum(cnt, axis=0)


@triton.jit
def wait_words(b1, n1, b2, n2, b3, n3, tag, budget, health_ptr, code, POLL: tl.constexpr, UNROLL: tl.constexpr):
    """Wait until every word of b1[0:n1], b2[0:n2], b3[0:n3] carries ``tag``; returns the budget.

    The polled vectors are 1-D with POLL >= threads per program, so each word is checked by
    exactly one thread and the miss count is reduced across all warps: every warp leaves the
    loop at the same poll (a count reduced inside one warp over replicated data would let warps
    diverge around the barriers of later reductions). Callers read the values afterwards."""
    i = tl.arange(0, POLL)
    for c0 in range(0, n1 + n2 + n3, POLL * UNROLL):
        miss = _misses(b1, n1, b2, n2, b3, n3, c0, i, tag, POLL, UNROLL)
        while (miss > 0) & (budget > 0):
            miss = _misses(b1, n1, b2, n2, b3, n3, c0, i, tag, POLL, UNROLL)
            budget -= 1
        if miss > 0:
            tl.atomic_cas(health_ptr, 0, code)
    return budget


# -- both mailbox formats (plan.MAILBOX_FORMATS): ``BF16MB`` picks plain bf16/fp32 values ------


@triton.jit
def region(mbox_ptr, word_offset, DT: tl.constexpr):
    """Pointer to a mailbox region whose elements are ``DT`` (``word_offset`` in those elements)."""
    return mbox_ptr.to(tl.pointer_type(DT), bitcast=True) + word_offset


@triton.jit
def publish(ptrs, value, mask, tag, BF16MB: tl.constexpr, PARTIAL: tl.constexpr = False):
    """Store fp32 ``value``: a bf16 activation (fp32 for attention partials) or a tagged word."""
    if BF16MB:
        if PARTIAL:
            tl.store(ptrs, value.to(tl.float32), mask=mask)
        else:
            tl.store(ptrs, value.to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptrs, pack(value, tag), mask=mask)


@triton.jit
def fetch(ptrs, mask, tag, health_ptr, code, BF16MB: tl.constexpr):
    """Read published values as fp32 after the stage's wait (volatile: never a stale L1 line);
    tagged words also have their tags checked."""
    if BF16MB:
        val = tl.load(ptrs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    else:
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
        check_tags(words, mask, tag, health_ptr, code)
        val = unpack(words)
    return val
