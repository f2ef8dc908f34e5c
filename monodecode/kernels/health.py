"""The health word: how a kernel reports a failure (site, kernel, layer) in one int32.

Kernels store the packed code on device (``site | kernel_id << 8 | (layer + 1) << 10``); the
runtime decodes it before logits and fail-stops. Pure Python, below every backend, so the plan,
the kernels and the runtime share one encoding.
"""

from __future__ import annotations

from dataclasses import dataclass

HEALTH_OK = 0
# site id -> label used in metrics (monodecode_failstop_total{site}) and termination messages
HEALTH_SITES: dict[int, str] = {
    1: "wait_timeout",  # a bounded wait on a mailbox / peer expired
    2: "nonfinite",  # a NaN/Inf in a layer output
    3: "kernel_error",  # anything else a backend detects (launch failure, bad argument)
}
_SITE_IDS = {v: k for k, v in HEALTH_SITES.items()}
_KERNELS = {0: None, 1: "k1", 2: "k2"}
_KERNEL_IDS = {v: k for k, v in _KERNELS.items()}


@dataclass(frozen=True)
class HealthFault:
    site: str
    layer: int | None
    kernel: str | None  # k1 | k2 | None

    def describe(self) -> str:
        where = []
        if self.kernel:
            where.append(self.kernel)
        if self.layer is not None:
            where.append(f"layer {self.layer}")
        return self.site + (f" ({', '.join(where)})" if where else "")


def health_code(site: str, layer: int | None = None, kernel: str | None = None) -> int:
    """Pack a failure into a positive int32: bits 0-7 site, 8-9 kernel, 10-29 layer+1."""
    if site not in _SITE_IDS:
        raise ValueError(f"unknown health site {site!r}; known: {', '.join(_SITE_IDS)}")
    if kernel not in _KERNEL_IDS:
        raise ValueError(f"unknown kernel {kernel!r}; expected k1, k2 or None")
    layer_bits = 0 if layer is None else (layer + 1)
    if not 0 <= layer_bits < (1 << 20):
        raise ValueError(f"layer {layer} out of range for the health word")
    return _SITE_IDS[site] | (_KERNEL_IDS[kernel] << 8) | (layer_bits << 10)


def decode_health(code: int) -> HealthFault | None:
    """Inverse of ``health_code``; None for 0 (healthy). Unknown site ids read as kernel_error."""
    if code == HEALTH_OK:
        return None
    site = HEALTH_SITES.get(code & 0xFF, "kernel_error")
    kernel = _KERNELS.get((code >> 8) & 0x3)
    layer_bits = (code >> 10) & ((1 << 20) - 1)
    return HealthFault(site=site, layer=layer_bits - 1 if layer_bits else None, kernel=kernel)
