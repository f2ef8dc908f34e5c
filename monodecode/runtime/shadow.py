"""Shadow check: the kernels' numerics watched while serving.

Every ``every``-th real mono step one decoder layer (the layers in turn) is computed a second
time by the stock layer on the same input, and the two outputs are compared against the warm-up
tolerance (``atol + rtol * max|stock|``). The kernels' output is what was served; the stock
layer only checks it:

- it runs on a private copy of the checked layer's KV blocks that this step's rows use (their
  block tables, remapped), so it computes the new token's K/V itself, attends over the same
  context the kernels saw, and never touches serving state (cost: one layer's K/V blocks of the
  step's rows, copied on the device every ``every`` steps);
- on a GPU it runs on a side stream after the step's work, the error and the bound are copied
  without blocking into pinned memory, and the host reads them when an event says they are
  there (never waiting); the next step's queue waits for the side stream on the device (a
  device-side dependency, so a later step never races with the check's reads of the cache);
- on the CPU (no device queue) it runs in line at the end of the step.

Steps served by replaying a FULL graph run no Python, so they are never shadow-checked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from monodecode.errors import exception_line


@dataclass(frozen=True)
class ShadowResult:
    step: int
    layer: int
    max_abs_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= self.tolerance  # NaN fails

    def reason(self) -> str:
        return (
            f"shadow_mismatch: layer {self.layer} at step {self.step}: the kernels' output differs from "
            f"the stock layer's by {self.max_abs_error:.4g} (warm-up tolerance {self.tolerance:.4g})"
        )


class ShadowCheck:
    def __init__(
        self,
        every: int,
        num_layers: int,
        atol: float,
        rtol: float,
        stock_layer: Callable[[int, Any, Any, Any], Any],
        device: torch.device,
    ):
        self._every = every
        self._num_layers = num_layers
        self._atol, self._rtol = atol, rtol
        self._stock_layer = stock_layer
        self._async = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self._async else None
        self._checks = 0
        self._captured: tuple[int, Any, Any, Any, Any] | None = None  # layer, x, out, meta, kv
        self._pending: list[tuple[int, int, torch.Tensor, Any]] = []  # step, layer, pinned [err, tol], event
        self._side_busy = False
        self.broken: str | None = None  # why the checks stopped (the stock layer failed)

    def layer_for(self, mono_step: int) -> int | None:
        """The layer to check at the ``mono_step``-th real mono step (0-based), or None."""
        if self._every <= 0 or (mono_step + 1) % self._every:
            return None
        layer = self._checks % self._num_layers
        self._checks += 1
        return layer

    def capture(self, layer: int, x: torch.Tensor, out: torch.Tensor, meta: Any, kv: Any) -> None:
        """Keep the layer's input and the kernels' output (device copies, no host sync)."""
        self._captured = (layer, x.clone(), out.clone(), meta, kv)

    def launch(self, step: int) -> None:
        """Compare the captured layer with the stock layer (GPU: queued on the side stream)."""
        if self._captured is None:
            return
        layer, x, out, meta, kv = self._captured
        self._captured = None
        try:
            if not self._async:
                err, tol = self._compare(layer, x, out, meta, kv)
                self._pending.append((step, layer, torch.stack([err, tol]), None))
                return
            main = torch.cuda.current_stream()
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                err, tol = self._compare(layer, x, out, meta, kv)
                host = torch.empty(2, dtype=torch.float32, pin_memory=True)
                host.copy_(torch.stack([err, tol]), non_blocking=True)
                done = torch.cuda.Event()
                done.record()
        except Exception as e:  # the check must never take serving down: it stops, and says why
            self.broken = f"shadow check stopped: the stock layer raised {exception_line(e, 200)}"
            self._every = 0
            return
        for t in (x, out):
            t.record_stream(self._side)
        self._side_busy = True
        self._pending.append((step, layer, host, done))

    def _compare(self, layer: int, x: Any, out: Any, meta: Any, kv: Any) -> tuple[torch.Tensor, torch.Tensor]:
        meta, kv = private_kv(layer, meta, kv)
        ref = self._stock_layer(layer, x, meta, kv).float()
        err = (out.float() - ref).abs().max()
        err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
        tol = self._atol + self._rtol * ref.abs().max()
        return err, tol

    def before_step(self) -> None:
        """The next step's queue waits for an outstanding check on the device (no host wait)."""
        if self._side_busy:
            torch.cuda.current_stream().wait_stream(self._side)
            self._side_busy = False

    def results(self) -> list[ShadowResult]:
        """Finished checks, oldest first (never waits for a running one)."""
        done, still = [], []
        for step, layer, host, event in self._pending:
            if event is None or event.query():
                err, tol = (float(v) for v in host.tolist())
                done.append(ShadowResult(step, layer, err, tol))
            else:
                still.append((step, layer, host, event))
        self._pending = still
        return done


def private_kv(layer: int, meta: Any, kv: Any) -> tuple[Any, Any]:
    """``meta`` and ``kv`` remapped onto a copy of ``layer``'s blocks named in ``meta``'s block
    tables (row r's j-th block becomes block ``r * max_blocks + j``): writes go to the copy, reads
    see what the served cache holds. Device ops only (no host sync)."""
    rows, max_blocks = meta.block_tables.shape
    bs = kv.block_size
    blocks = meta.block_tables.reshape(-1).long()
    keys, values = list(kv.key), list(kv.value)
    keys[layer] = kv.key[layer].index_select(0, blocks)
    values[layer] = kv.value[layer].index_select(0, blocks)
    table = torch.arange(rows * max_blocks, dtype=meta.block_tables.dtype, device=blocks.device)
    pos = meta.positions.long()
    base = torch.arange(rows, device=pos.device) * max_blocks
    slots = (base + pos // bs) * bs + pos % bs
    slots = torch.where(meta.slot_mapping >= 0, slots, torch.full_like(slots, -1))
    meta = replace(meta, block_tables=table.view(rows, max_blocks), slot_mapping=slots)
    return meta, type(kv)(key=keys, value=values, block_size=bs)
