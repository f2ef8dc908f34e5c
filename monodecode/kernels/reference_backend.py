"""The ``reference`` backend: the reference decode's PyTorch K1/K2 behind the kernel interface. Runs everywhere.

It is the numerics oracle made dispatchable: rows are padded to the smallest built width with
inert rows (slot -1) exactly like a real kernel, K1 hands its output to K2 through an
epoch-tagged mailbox whose wait is bounded, and a non-finite layer output sets the sticky
health word (a device int32, updated without a host sync). So the runner's lifecycle, fallback
accounting and fail-stop run for real on a CPU-only machine. With TP > 1 every rank computes the
whole layer from unsharded weights (replicated: no peer exchange, identical results).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from monodecode.kernels.base import BuildRequest, KernelBackend
from monodecode.kernels.health import health_code
from monodecode.kernels.padded import PaddedKernels
from monodecode.services.buildkey import source_digest
from monodecode.services.platform import Platform
from monodecode.services.waits import bounded_wait
from monodecode.spec import KernelSpec

_MODEL_DIR = Path(__file__).resolve().parent.parent / "model"


class ReferenceKernels(PaddedKernels):
    kernel_label = "reference kernels"

    def __init__(self, req: BuildRequest, weights: Any):
        from monodecode.model import reference  # the oracle's module; imported at build, not at registry load

        self._ref = reference
        self.req = req
        self.dims = req.dims
        self.weights = weights
        self.widths = req.widths
        device = weights.embed.device if hasattr(weights, "embed") else torch.device("cpu")
        self.health_word = torch.zeros((), dtype=torch.int32, device=device)
        self._mailbox: dict[int, tuple[int, torch.Tensor]] = {}
        self._epoch = 0

    def _set_health(self, bad: torch.Tensor, code: int) -> None:
        # sticky: only the first failure is kept; no .item() so no host sync
        code_t = torch.tensor(code, dtype=torch.int32, device=self.health_word.device)
        self.health_word.copy_(torch.where(bad & (self.health_word == 0), code_t, self.health_word))

    def k1(self, layer, x, meta, kv):
        return self._ref.k1_reference(self.dims, layer, self.weights.layers[layer], x, meta, kv)

    def k2(self, layer, x, attn):
        return self._ref.k2_reference(self.dims, layer, self.weights.layers[layer], x, attn)

    def forward_layer(self, layer: int, x: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        rows = x.shape[0]
        x_in, meta, _ = self._pad(x, meta)
        self._epoch += 1
        epoch = self._epoch
        attn = self.k1(layer, x_in, meta, kv)
        if not self._take_fault(layer, "stall"):
            self._mailbox[layer] = (epoch, attn)  # publish, tagged with this launch's epoch
        # K2 consumes K1's result only when the tag matches; the wait is bounded
        arrived = bounded_wait(lambda: self._mailbox.get(layer, (None, None))[0] == epoch, self.req.wait_timeout_s)
        if not arrived:
            self._set_health(
                torch.ones((), dtype=torch.bool, device=self.health_word.device),
                health_code("wait_timeout", layer, "k2"),
            )
            stale = self._mailbox.get(layer)
            attn = stale[1] if stale is not None and stale[1].shape == attn.shape else torch.zeros_like(attn)
        else:
            attn = self._mailbox[layer][1]
        out = self.k2(layer, x_in, attn)
        if self._take_fault(layer, "nonfinite"):
            out = out.clone()
            out[0, 0] = float("nan")
        self._set_health(~torch.isfinite(out).all(), health_code("nonfinite", layer, "k2"))
        return out[:rows]


class ReferenceBackend(KernelBackend):
    name: ClassVar[str] = "reference"
    needs_artifacts: ClassVar[bool] = False

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        return None

    def kernel_spec(self, platform: Platform, widths: tuple[int, ...]) -> KernelSpec:
        # any platform, any TP size (replicated), any block size; bf16 KV only
        return KernelSpec(
            backend=self.name,
            tp_sizes=None,
            block_sizes=None,
            widths=tuple(widths),
            kv_cache_dtypes=("auto", "bf16", "bfloat16"),
        )

    def compiler_version(self) -> str:
        return f"torch {torch.__version__}"

    def source_digest(self) -> str:
        return source_digest(_MODEL_DIR / "reference.py", extra_files=[Path(__file__)])

    def build(self, req: BuildRequest, weights: Any, artifacts: Any, allow_jit: bool) -> ReferenceKernels:
        return ReferenceKernels(req, weights)
