"""Read-bandwidth probes: the roofline's denominator is the fastest of them.

One probe can read below what the kernels reach (an fp32 ``sum`` read 4.16-4.41 TB/s on the H200
while 27B's gate/up streamed at 4.35 TB/s), which would flatter every "% of roofline". So
several are timed on the same buffer and the fastest counts:

  sum-fp32      ``torch.sum`` over fp32
  sum-bf16      ``torch.sum`` over bf16 (the same bytes, another reduction kernel)
  triton-read   a persistent Triton kernel streaming the buffer with wide loads (a few grid and
                tile sizes, the best kept)
  copy          a device-to-device copy of half the buffer, counted as read + write bytes

The fraction against the datasheet bandwidth (``SPEC_BANDWIDTH``) is printed beside it.

A card fresh from idle reads slow at first: run 187's probes (the first command on a cold H100)
drew 3028 GB/s, runs 188-191 on the same card minutes later 3128-3134, with the kernels' times
the same, so every fraction of that run read 3 % high. So the buffer is read for ``WARM_S``
seconds before any probe is timed, and each probe is timed ``ROUNDS`` times, its fastest kept.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

# Datasheet HBM bandwidth (bytes/s) by a substring of the device name.
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "MI300X": 5.3e12, "MI325X": 6.0e12, "MI355X": 8.0e12}


WARM_S = 2.0  # seconds of reads before the first probe is timed
ROUNDS = 2  # times each probe is timed; its fastest counts


def spec_bandwidth(device_name: str) -> float | None:
    """Datasheet bandwidth of the device (bytes/s), or None when it is not in the table."""
    return next((bw for key, bw in SPEC_BANDWIDTH.items() if key in device_name), None)


def _triton_read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read(x_ptr, out_ptr, n, iters, BLOCK: tl.constexpr):
        """Program ``p`` sums tiles ``p, p + programs, ...`` of ``x`` in fp32 and stores its partial."""
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.range(0, iters):
            offs = i * step + pid * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return stream_read


def triton_stream_sum(x: torch.Tensor, programs: int, block: int, num_warps: int = 8) -> torch.Tensor:
    """Sum of the fp32 vector ``x`` read once by ``programs`` Triton programs (partials summed by torch)."""
    out = torch.empty(programs, dtype=torch.float32, device=x.device)
    iters = -(-x.numel() // (programs * block))
    _triton_read_kernel()[(programs,)](x, out, x.numel(), iters, BLOCK=block, num_warps=num_warps)
    return out.sum()


def time_calls(fn, reps: int, warmup: int = 3) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` (device events around each, a synchronize after
    each), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    return time_back_to_back(fn, 1, rounds=reps)


def time_back_to_back(fn, calls: int, rounds: int = 3) -> list[float]:
    """Seconds a call of ``fn`` over ``calls`` calls queued back to back between two device events
    (one synchronize a round, not a call: the host stays ahead of the device, as under vLLM's
    asynchronous scheduling), for each of ``rounds`` rounds."""
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / calls)
    return out


def _median_s(fn, reps: int) -> float:
    return statistics.median(time_calls(fn, reps))


def warm_up(fn, seconds: float, sync) -> int:
    """Call ``fn``, then ``sync``, until ``seconds`` of wall time have passed (at least once);
    returns the calls made."""
    end = time.monotonic() + seconds
    calls = 0
    while True:
        fn()
        sync()
        calls += 1
        if time.monotonic() >= end:
            return calls


def read_probes(device, gib: float = 4.0, reps: int = 20) -> dict[str, float]:
    """Bytes/s of each probe over a ``gib`` GiB buffer (median of ``reps``, the fastest of
    ``ROUNDS`` rounds, after ``WARM_S`` seconds of reads); a probe that fails is left out (the
    others still count)."""
    x = torch.rand(int(gib * (1 << 30)) // 4, device=device)
    warm_up(x.sum, WARM_S, functools.partial(torch.cuda.synchronize, x.device))
    out: dict[str, float] = {}
    for _ in range(ROUNDS):
        for name, bw in _probe(x, reps).items():
            out[name] = max(out.get(name, 0.0), bw)
    del x
    torch.cuda.empty_cache()
    return out


def _probe(x: torch.Tensor, reps: int) -> dict[str, float]:
    nbytes = x.numel() * 4
    out: dict[str, float] = {"sum-fp32": nbytes / _median_s(x.sum, reps)}
    xb = x.view(torch.bfloat16)  # the same bytes as bf16 values
    out["sum-bf16"] = nbytes / _median_s(xb.sum, reps)
    try:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        best = 0.0
        for programs, block in ((sms * 4, 4096), (sms * 8, 2048), (sms * 2, 8192)):
            best = max(best, nbytes / _median_s(lambda p=programs, b=block: triton_stream_sum(x, p, b), reps))
        out["triton-read"] = best
    except Exception:  # noqa: BLE001 - no Triton for this device: the torch probes still count
        pass
    half = x[: x.numel() // 2]
    dst = torch.empty_like(half)
    out["copy"] = 2 * half.numel() * 4 / _median_s(lambda: dst.copy_(half), reps)
    return out
