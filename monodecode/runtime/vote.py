"""Rank uniformity: every TP rank must take the same path at every layer of every step.

The kernels of one rank spin on values pushed by its peers, so a rank that takes the stock path
while another runs the megakernel deadlocks both (or, with bounded waits, fail-stops both).
Two rules keep the ranks together:

1. Per-step decisions are a pure function of ``StepInfo``: host metadata that vLLM's scheduler
   gives every rank identically (row counts, prefill/decode split, graph mode, whether attention
   metadata exists) plus the runner's *agreed* state. Nothing rank-local (timers, device health,
   a rank's own error) is read there.
2. Rank-local state enters only through ``RankVote.agree`` / ``min_vote``: a MIN all-reduce on
   the CPU (gloo) TP group at safe points (startup, explicit re-votes outside graph capture).
   After it, every rank holds the same value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepInfo:
    """What the per-step decision may read: identical on all ranks by construction."""

    num_rows: int  # tokens (rows) in this step's batch
    num_prefill_rows: int = 0  # rows that belong to prefill chunks (0 for a pure decode step)
    graph_mode: str = "none"  # none | full | full_decode_only | piecewise
    has_metadata: bool = True  # attention metadata present (profile/dummy runs have none)

    @property
    def num_decode_rows(self) -> int:
        return self.num_rows - self.num_prefill_rows


class RankVote:
    """MIN all-reduce over the TP group's CPU (gloo) process group; a no-op for one rank."""

    def __init__(self, group: Any = None, world_size: int = 1):
        self.group = group
        self.world_size = world_size
        self.votes = 0  # collectives issued (every rank issues the same number)

    def min_vote(self, value: int) -> int:
        """The minimum of ``value`` over all ranks (every rank must call this at the same point)."""
        self.votes += 1
        if self.world_size <= 1:
            return int(value)
        import torch
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def agree(self, ok: bool) -> bool:
        """True only if every rank says ok."""
        return self.min_vote(1 if ok else 0) == 1
