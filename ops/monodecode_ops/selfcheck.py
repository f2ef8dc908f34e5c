"""A scripted serving sequence for self-tests: mono steps and deliberately ineligible ones.

``run_scenario`` plays the part vLLM plays in serving: it prefills and decodes a few sequences
through a started ``Runner`` (mono kernels on eligible decode steps, stock layers otherwise) and,
in lock-step on its own KV cache, through the pure reference. Inputs are teacher-forced from the
reference so both see identical ids; every step's logits are compared. Each step declares which
path it must take and why, so the runner's decisions and fallback counters can be checked
against an independent expectation.

Steps (W = the largest built width): a prefill; a mixed batch (one prefill + one decode); a
2-row decode; a batched prefill of more sequences; a decode of W+1 rows (exceeds every width);
a W-row decode; a step under PIECEWISE graph mode; a 3-row decode (padded to a width); two
single-row decodes that cross a KV block boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from monodecode.kernels.base import smallest_width
from monodecode.model.paged_kv import BlockAllocator, DecodeMetadata, PagedKVCache
from monodecode.model.reference import decode_step as reference_decode_step
from monodecode.runtime.failstop import FailStop, FailStopEvent
from monodecode.runtime.vote import StepInfo


@dataclass
class StepRecord:
    name: str
    rows: int
    expected_path: str
    expected_reason: str | None
    path: str | None = None
    reason: str | None = None
    max_abs_logit_diff: float = 0.0
    tokens_match: bool = True

    @property
    def as_expected(self) -> bool:
        return self.path == self.expected_path and self.reason == self.expected_reason


@dataclass
class ScenarioResult:
    steps: list[StepRecord] = field(default_factory=list)
    failstop: FailStopEvent | None = None
    tokens_emitted: int = 0

    @property
    def max_abs_logit_diff(self) -> float:
        return max((s.max_abs_logit_diff for s in self.steps), default=0.0)

    @property
    def tokens_match(self) -> bool:
        return all(s.tokens_match for s in self.steps)

    def expected_counts(self) -> dict[str, int]:
        out: dict[str, int] = {"mono": 0, "fallback": 0}
        for s in self.steps:
            out[s.expected_path] += 1
            if s.expected_reason:
                out[s.expected_reason] = out.get(s.expected_reason, 0) + 1
        return out


def _cat(metas: list[DecodeMetadata], max_blocks: int) -> DecodeMetadata:
    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] == max_blocks:
            return t
        return torch.cat([t, torch.zeros(t.shape[0], max_blocks - t.shape[1], dtype=t.dtype, device=t.device)], 1)

    return DecodeMetadata(
        positions=torch.cat([m.positions for m in metas]),
        slot_mapping=torch.cat([m.slot_mapping for m in metas]),
        block_tables=torch.cat([pad(m.block_tables) for m in metas]),
        seq_lens=torch.cat([m.seq_lens for m in metas]),
    )


def run_scenario(runner: Any, seed: int = 7, logit_atol: float = 0.05, logit_rtol: float = 0.02) -> ScenarioResult:
    weights, dims = runner.weights, runner.dims
    device = runner.device
    bs = runner.block_size
    widths = tuple(runner.config.widths) if runner.enabled else (1, 2, 4, 8)
    W = widths[-1]
    nseq = W + 1
    prompt_len = bs - 2  # the single-row decodes at the end cross into a second block
    max_blocks = -(-(prompt_len + 16) // bs) + 1
    num_blocks = nseq * max_blocks + 1
    alloc = BlockAllocator(num_blocks, bs)
    kv_run = PagedKVCache.allocate(dims, num_blocks, bs, device=device)
    kv_ref = PagedKVCache.allocate(dims, num_blocks, bs, device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    next_id: dict[int, int] = {}
    result = ScenarioResult()

    def expect_decode(rows: int) -> tuple[str, str | None]:
        if not runner.enabled:
            return "fallback", ("disabled" if runner.state == "off" else "degraded")
        width = smallest_width(widths, rows)
        if width is None:
            return "fallback", "rows_exceed_width"
        return ("mono", None) if width in runner.served_widths else ("fallback", "width_dropped")

    def run(name: str, parts: list[tuple[str, int, int]], graph_mode: str = "none") -> bool:
        """parts: (kind 'prefill'|'decode', seq, n_tokens). Returns False after a fail-stop."""
        metas, ids, last_rows = [], [], []
        prefill_rows = 0
        for kind, seq, n in parts:
            if kind == "prefill":
                toks = torch.randint(4, dims.vocab_size, (n,), generator=gen)
                metas.append(alloc.prefill_metadata(seq, n, max_blocks=max_blocks, device=device))
                prefill_rows += n
            else:
                toks = torch.tensor([next_id[seq]])
                metas.append(alloc.decode_metadata([seq], max_blocks=max_blocks, device=device))
            ids.append(toks)
            last_rows.append((seq, sum(t.numel() for t in ids) - 1))
        meta = _cat(metas, max_blocks)
        ids_t = torch.cat(ids).to(device)
        rows = ids_t.numel()
        info = StepInfo(num_rows=rows, num_prefill_rows=prefill_rows, graph_mode=graph_mode)
        if not runner.enabled:
            exp = expect_decode(rows)
        elif prefill_rows:
            exp = ("fallback", "prefill" if prefill_rows == rows else "mixed_batch")
        elif graph_mode not in ("none", "full", "full_decode_only"):
            exp = ("fallback", "graph_mode")
        else:
            exp = expect_decode(rows)
        rec = StepRecord(name, rows, exp[0], exp[1])
        result.steps.append(rec)
        ref_logits = reference_decode_step(weights, ids_t, meta, kv_ref)
        try:
            logits = runner.decode_step(ids_t, meta, kv_run, info)
        except FailStop as e:  # exit_on_failstop=False: the step produced no token
            rec.path, rec.reason = "mono", None
            result.failstop = e.event
            return False
        d = runner.last_decision
        rec.path, rec.reason = d.path, d.reason
        diff = (logits - ref_logits).abs().max().item()
        rec.max_abs_logit_diff = diff
        tol = logit_atol + logit_rtol * ref_logits.abs().max().item()
        sel = torch.tensor([r for _, r in last_rows], device=ref_logits.device)
        ref_tok = ref_logits[sel].argmax(-1)
        run_tok = logits[sel].argmax(-1)
        rec.tokens_match = bool((ref_tok == run_tok).all()) and diff <= tol
        for (seq, _), tok in zip(last_rows, ref_tok.tolist()):
            next_id[seq] = tok  # teacher forcing: both paths continue from the reference's token
        result.tokens_emitted += len(last_rows)
        return True

    plan: list[tuple[str, list[tuple[str, int, int]], str]] = [
        ("prefill", [("prefill", 0, prompt_len)], "none"),
        ("mixed batch", [("prefill", 1, 3), ("decode", 0, 1)], "none"),
        ("decode 2 rows", [("decode", 0, 1), ("decode", 1, 1)], "none"),
        (f"prefill {nseq - 2} sequences", [("prefill", s, 2) for s in range(2, nseq)], "none"),
        (f"decode {nseq} rows", [("decode", s, 1) for s in range(nseq)], "none"),
        (f"decode {W} rows", [("decode", s, 1) for s in range(W)], "none"),
        ("piecewise graph", [("decode", s, 1) for s in range(min(3, nseq))], "piecewise"),
        ("decode 3 rows", [("decode", s, 1) for s in range(min(3, nseq))], "none"),
        ("decode 1 row", [("decode", 0, 1)], "none"),
        ("decode 1 row again", [("decode", 0, 1)], "none"),
    ]
    for name, parts, mode in plan:
        if not parts:  # e.g. no extra sequences to prefill when the largest width is 1
            continue
        if not run(name, parts, mode):
            break
    return result
