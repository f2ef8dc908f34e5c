"""Per-stage timelines of the Triton K1/K2, or of the step launch's two halves, from their ``%globaltimer`` stamps.

The kernels, built with ``enable_timeline`` (``TritonKernels``, ``StepKernels``), write per
program and stage three stamps (ns): entering the stage (before its wait), the wait over, and its
last task done (``monodecode/kernels/triton/timeline.py``'s layout). The step launch runs both
halves in one launch: its stamps sit where K1's (QKV, attention) and K2's (o_proj, gate/up, down)
would (``STEP``). Here they become, per layer and kernel (or half):

  span    first entry to last end of the kernel
  stage   when the first program got past the wait (``ready``), when the last one finished
          (``end``), relative to the kernel's first entry; the mean wait of the programs that had
          tasks; and the programs' mean busy time (ready -> end)
  gap     K1's last end to K2's first entry (the launch boundary; in the step launch, the last
          attention's end to the first program entering o_proj's wait: negative where they overlap)
  chain   from layer 1 on, each stage in order as a hand-off (the stage before's last program done
          -> the median program past this stage's wait, input staged) and a stream (-> this
          stage's last program done): their sum is the layer's period, the hand-offs its time
          between stages that no program spent on its own stage's work
  attention_parts  (the step launch, whose attention tasks also stamp their q, k and v in and
          their partial stored) the attention's stream split at the last partial stored: before it
          the tasks, after it the head counter's round trip and the last split's merge

and a plot of one layer: one line per program, grey while waiting, coloured while working.
"""

from __future__ import annotations

import lzma
from pathlib import Path
from typing import NamedTuple

import torch

from monodecode_ops.plots import save_png

# Raw stamps are mostly zeros and nearby nanosecond counts: xz keeps a timeline at ~1/14 of its
# .pt size, which keeps the saved results (tracked in git, sent with every device call) small.
STAMPS_SUFFIX = "_stamps.pt.xz"


def save_stamps(stamps: torch.Tensor, path: Path) -> None:
    with lzma.open(path, "wb", preset=6) as f:
        torch.save(stamps.cpu(), f)


def load_stamps(path: Path) -> torch.Tensor:
    """A saved timeline's stamps, from ``save_stamps``'s ``.pt.xz`` or an older run's plain ``.pt``."""
    path = Path(path)
    if path.suffix == ".xz":
        with lzma.open(path, "rb") as f:
            return torch.load(f, weights_only=True)
    return torch.load(path, weights_only=True)


COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


class Layout(NamedTuple):
    """What the stamps' two kernel slots and five stage slots are ("": a slot never stamped)."""

    stages: tuple[tuple[str, ...], tuple[str, ...]]
    keys: tuple[str, str]  # the summary's names of the two slots
    labels: tuple[str, str]  # the plot legend's
    gap: str  # what ``launch_gap_us`` measures
    origin: str  # whose first program's start the plot's time axis counts from
    # (kernel, stage, slot) where the attention's tasks stamp their partial stored, before the
    # merge's counter, and (stage, slot) of the same kernel their q, k and v in (the step launch);
    # None: no such stamps
    part: tuple[int, int, int] | None = None
    q_in: tuple[int, int] | None = None


TRITON = Layout(
    (("qkv", "attn", "combine"), ("o_proj", "post", "gate_up", "down", "final")),
    ("k1", "k2"),
    ("K1", "K2"),
    "K1 end -> K2 start",
    "K1",
)
STEP = Layout(
    (("qkv", "attention", ""), ("o_proj", "", "gate_up", "down", "")),
    ("attention_half", "mlp_half"),
    ("", ""),
    "last attention end -> first o_proj entry",
    "the launch",
    (0, 1, 3),
    (2, 0),
)


def _ran(st: torch.Tensor) -> torch.Tensor:
    """``st`` ``[program, stage, slot]`` of one kernel, less the program slots past its grid
    (K1 and K2 may have grids of different sizes: those slots are never stamped)."""
    return st[(st[:, :, 0] > 0).any(dim=1)]


def _valid(st: torch.Tensor) -> torch.Tensor:
    """Stages a kernel ran: every program stamped them (a stage compiled out stays 0)."""
    return (st[:, :, 0] > 0).all(dim=0)


def summarize(stamps: torch.Tensor, layout: Layout = TRITON) -> dict:
    """``stamps``: ``[layer, kernel, program, stage, slot]`` int64 ns. Means over the layers."""
    layers = stamps.shape[0]
    out: dict = {"layers": layers, "kernels": {}, "gap": layout.gap}
    gaps = []
    for k in (0, 1):
        per_stage: dict[str, dict[str, list[float]]] = {}
        spans = []
        for l in range(layers):
            st = _ran(stamps[l, k].double())
            ok = _valid(st)
            if not ok.any():
                continue
            t0 = st[:, ok, 0].min()
            spans.append(float(st[:, ok, 2].max() - t0) / 1e3)
            if k == 1:
                k1 = _ran(stamps[l, 0].double())
                gaps.append(float(t0 - k1[:, _valid(k1), 2].max()) / 1e3)
            for s, name in enumerate(layout.stages[k]):
                if not name or not ok[s]:
                    continue
                enter, ready, end = st[:, s, 0], st[:, s, 1], st[:, s, 2]
                busy = end - ready
                worked = busy > 0
                d = per_stage.setdefault(name, {"ready_us": [], "end_us": [], "wait_us": [], "busy_us": []})
                d["ready_us"].append(float(ready.min() - t0) / 1e3)
                d["end_us"].append(float(end.max() - t0) / 1e3)
                d["wait_us"].append(float((ready - enter)[worked].mean()) / 1e3 if worked.any() else 0.0)
                d["busy_us"].append(float(busy[worked].mean()) / 1e3 if worked.any() else 0.0)
        out["kernels"][layout.keys[k]] = {
            "span_us": sum(spans) / len(spans) if spans else None,
            "stages": {n: {f: sum(v) / len(v) for f, v in d.items()} for n, d in per_stage.items()},
        }
    out["launch_gap_us"] = sum(gaps) / len(gaps) if gaps else None
    out["chain"] = _chain(stamps, layout)
    if layout.part is not None:
        out["attention_parts"] = _attention_parts(stamps, layout.part, layout.q_in)
    return out


def _attention_parts(stamps: torch.Tensor, part: tuple[int, int, int], q_in: tuple[int, int] | None) -> dict | None:
    """The attention stage's stream (the chain's: the median program past its wait -> the last
    head merged) in two, means over the layers (us): ``last_partial_us`` to the last task's partial
    stored, ``merge_us`` from there to the last head merged (the head counter's round trip and the
    last split's merge). And the median task's own time (its wait over -> its partial stored,
    ``task_us``), of which ``q_in_us`` until its q, k and v were in (the block table and the K/V
    copies asked for first), and the slowest task's (``task_max_us``): a short context leaves
    later splits empty, and their quick tasks can pull the median below every task that read
    positions (run 176: 8B at 1k, 16 splits, 8 empty). None where no task stamped its partial."""
    k, s, slot = part
    got: dict[str, list[float]] = {
        "task_us": [],
        "task_max_us": [],
        "q_in_us": [],
        "last_partial_us": [],
        "merge_us": [],
    }
    for l in range(stamps.shape[0]):
        st = _ran(stamps[l, k].double())
        ready, end, mark = st[:, s, 1], st[:, s, 2], st[:, s, slot]
        worked, tasks = end > ready, mark > 0
        if not tasks.any():
            continue
        ready_med = ready[worked].median()
        own = (mark - ready)[tasks]  # each task's wait over -> its partial stored
        got["task_us"].append(float(own.median()) / 1e3)
        got["task_max_us"].append(float(own.max()) / 1e3)
        if q_in is not None:
            got["q_in_us"].append(float((st[:, q_in[0], q_in[1]] - ready)[tasks].median()) / 1e3)
        got["last_partial_us"].append(float(mark[tasks].max() - ready_med) / 1e3)
        got["merge_us"].append(float(end[worked].max() - mark[tasks].max()) / 1e3)
    if not got["task_us"]:
        return None
    return {n: sum(v) / len(v) if v else None for n, v in got.items()}


def _chain(stamps: torch.Tensor, layout: Layout) -> list[dict]:
    """``summarize``'s ``chain``: per stage (every stamped stage of both kernels, in order) the
    mean over layers 1 .. of its hand-off and stream (us); [] with fewer than 2 layers."""
    order = [(k, s, n) for k in (0, 1) for s, n in enumerate(layout.stages[k]) if n]
    per: dict[str, list[tuple[float, float]]] = {}
    prev_end = None
    for l in range(stamps.shape[0]):
        kernels = [_ran(stamps[l, k].double()) for k in (0, 1)]
        for k, s, name in order:
            st = kernels[k]
            if not _valid(st)[s]:
                continue
            ready, end = st[:, s, 1], st[:, s, 2]
            worked = end > ready
            if not worked.any():
                continue
            ready_med, end_max = float(ready[worked].median()), float(end[worked].max())
            if prev_end is not None and l > 0:
                per.setdefault(name, []).append(((ready_med - prev_end) / 1e3, (end_max - ready_med) / 1e3))
            prev_end = end_max
    return [
        {"stage": n, "handoff_us": sum(h for h, _ in v) / len(v), "stream_us": sum(w for _, w in v) / len(v)}
        for n, v in per.items()
    ]


def describe(summ: dict) -> list[str]:
    lines = []
    for k, d in summ["kernels"].items():
        if d["span_us"] is None:
            continue
        parts = [
            f"{n} {v['ready_us']:.1f}->{v['end_us']:.1f} (wait {v['wait_us']:.1f}, busy {v['busy_us']:.1f})"
            for n, v in d["stages"].items()
        ]
        lines.append(f"{k} span {d['span_us']:.1f} us: " + "; ".join(parts))
    if summ.get("launch_gap_us") is not None:
        gap = summ.get("gap", TRITON.gap)
        lines.append(f"{gap} {summ['launch_gap_us']:.1f} us (mean over {summ['layers']} layers)")
    if chain := summ.get("chain"):
        hand = sum(c["handoff_us"] for c in chain)
        period = hand + sum(c["stream_us"] for c in chain)
        parts = ", ".join(f"{c['stage']} {c['handoff_us']:.1f} + {c['stream_us']:.1f}" for c in chain)
        lines.append(f"a layer's chain, hand-off + stream (us): {parts} = {period:.1f} (hand-offs {hand:.1f})")
    if att := summ.get("attention_parts"):
        lines.append(
            f"attention's stream (us): the last partial stored {att['last_partial_us']:.1f}, then the last head "
            f"merged {att['merge_us']:.1f}; a task {att['task_us']:.1f} (median, its wait over -> its partial stored; "
            f"the slowest {att['task_max_us']:.1f})"
            + (f", its q, k and v in after {att['q_in_us']:.1f}" if att.get("q_in_us") is not None else "")
        )
    return lines


def plot_layer(stamps: torch.Tensor, layer: int, title: str, path: Path, layout: Layout = TRITON) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = [_ran(stamps[layer, k].double()) for k in (0, 1)]
    t0 = float(kernels[0][:, _valid(kernels[0]), 0].min())
    fig, ax = plt.subplots(figsize=(12, 6))
    for k, st in enumerate(kernels):
        ok = _valid(st)
        for s, name in enumerate(layout.stages[k]):
            if not name or not ok[s]:
                continue
            enter = (st[:, s, 0] - t0) / 1e3
            ready = (st[:, s, 1] - t0) / 1e3
            end = (st[:, s, 2] - t0) / 1e3
            ys = torch.arange(st.shape[0])
            ax.hlines(ys, enter, ready, colors="0.8", lw=1)
            work = end > ready
            ax.hlines(
                ys[work],
                ready[work],
                end[work],
                colors=COLORS[s],
                lw=1.5 if k == 0 else 2.5,
                label=f"{layout.labels[k]} {name}".strip(),
            )
    if layout.part is not None:  # each attention task's partial stored: the merge's round trips follow
        k, s, slot = layout.part
        mark = kernels[k][:, s, slot]
        tasks = mark > 0
        if tasks.any():
            ys = torch.arange(mark.shape[0])[tasks]
            ax.plot((mark[tasks] - t0) / 1e3, ys, "k|", ms=3, label="partial stored")
    ax.set_xlabel(f"µs since {layout.origin}'s first program started (grey: waiting)")
    ax.set_ylabel("program (SM)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=4, loc="upper right")
    fig.tight_layout()
    save_png(fig, path, dpi=100)
