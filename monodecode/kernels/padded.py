"""Host side shared by the backends' ``DecodeKernels``: width padding, one-shot faults, health.

Every backend runs a step at the smallest built width that fits it, padding with inert rows
(slot -1); keeps its sticky health code in a device int32 (``health_word``) that the runner
reads before logits; and injects an armed fault (``arm_fault``) into the next launch of one
layer, once. ``TwoLaunchKernels`` adds the K1 -> K2 launch sequence of the compiled backends
(triton, flydsl), which differ only in how one launch is issued.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch

from monodecode.errors import ConfigError
from monodecode.kernels.base import DecodeKernels, smallest_width

FAULT_KINDS = ("stall", "nonfinite")


def pad_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [rows, n] with zero rows appended up to ``width`` (unchanged when it already has them)."""
    rows = t.shape[0]
    if rows >= width:
        return t
    return torch.cat([t, torch.zeros(width - rows, t.shape[1], dtype=t.dtype, device=t.device)])


class PaddedKernels(DecodeKernels):
    """Width padding, the health word and one-shot fault injection (subclasses set
    ``health_word``, ``widths``, ``dims`` and ``kernel_label``)."""

    kernel_label: ClassVar[str] = "kernels"  # prefix of this backend's error messages
    health_word: torch.Tensor  # device int32: 0, or the sticky health_code of the first failure
    _armed: Any = None

    def _width(self, rows: int) -> int:
        width = smallest_width(self.widths, rows)
        if width is None:
            raise ConfigError(f"{self.kernel_label}: {rows} rows exceed the largest built width {self.widths[-1]}")
        return width

    def _pad(self, x: torch.Tensor, meta: Any) -> tuple[torch.Tensor, Any, int]:
        """``x`` and ``meta`` padded to the smallest fitting width with inert rows, and that width."""
        width = self._width(x.shape[0])
        if width > x.shape[0]:
            x = pad_rows(x, width)
            meta = meta.pad_to(width)
        return x.contiguous(), meta, width

    def _take_fault(self, layer: int, kind: str) -> int:
        """1 when a fault of ``kind`` is armed for ``layer`` (disarming it: one-shot), else 0."""
        f = self._armed
        if f is not None and f.kind == kind and f.layer == layer:
            self._armed = None
            return 1
        return 0

    def health(self) -> int:
        return int(self.health_word.item())

    def reset_health(self) -> None:
        self.health_word.zero_()

    def arm_fault(self, fault: Any) -> bool:
        if fault.kind not in FAULT_KINDS or not 0 <= fault.layer < self.dims.num_layers:
            return False
        self._armed = fault
        return True


class TwoLaunchKernels(PaddedKernels):
    """A layer as two device launches on padded inputs: K1 (attention, with the stall fault) then
    K2 (o_proj .. MLP, with the non-finite fault). Subclasses issue the launches."""

    @abstractmethod
    def _launch_k1(self, layer: int, x: torch.Tensor, meta: Any, kv: Any, width: int, stall: int = 0) -> torch.Tensor:
        """K1 on ``width`` padded rows -> attention output [width, q_size] bf16."""

    @abstractmethod
    def _launch_k2(
        self, layer: int, x: torch.Tensor, attn: torch.Tensor, width: int, nan_fault: int = 0
    ) -> torch.Tensor:
        """K2 on ``width`` padded rows -> residual stream leaving the layer [width, hidden] bf16."""

    def _launch_meta(self, meta: Any) -> Any:
        """``meta`` as the launches read it (default: as given)."""
        return meta

    def k1(self, layer, x, meta, kv):
        rows = x.shape[0]
        xp, mp, width = self._pad(x, meta)
        # clone: K1's output may be a buffer the next launch reuses
        return self._launch_k1(layer, xp, self._launch_meta(mp), kv, width)[:rows].clone()

    def k2(self, layer, x, attn):
        rows = x.shape[0]
        width = self._width(rows)
        xp = pad_rows(x.contiguous(), width)
        ap = pad_rows(attn.to(torch.bfloat16).contiguous(), width)
        return self._launch_k2(layer, xp, ap, width)[:rows]

    def forward_layer(self, layer: int, x: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        rows = x.shape[0]
        xp, mp, width = self._pad(x, meta)
        attn = self._launch_k1(layer, xp, self._launch_meta(mp), kv, width, stall=self._take_fault(layer, "stall"))
        out = self._launch_k2(layer, xp, attn, width, nan_fault=self._take_fault(layer, "nonfinite"))
        return out if rows == width else out[:rows]
