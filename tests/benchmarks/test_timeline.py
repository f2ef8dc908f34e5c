"""The benchmark's timeline summary and plot (``monodecode_ops.decode_bench.timeline``) from synthetic stamps
with known stage times: the figures it reports are the ones put in."""

from __future__ import annotations

import torch

from monodecode_ops.decode_bench import timeline as TL


def _stamps(layers=2, programs=4):
    """K1: 3 stages, K2: 4 stages (no final); every program waits 1 us, works 2 us per stage; K2
    starts 5 us after K1's last end."""
    st = torch.zeros(layers, 2, programs, 5, 4, dtype=torch.int64)
    t = 1_000_000
    for l in range(layers):
        for k, n in ((0, 3), (1, 4)):
            for s in range(n):
                st[l, k, :, s, 0] = t
                st[l, k, :, s, 1] = t + 1000
                st[l, k, :, s, 2] = t + 3000
                t += 3000
            t += 5000
    return st


def test_summary_reports_the_stage_times_put_in(tmp_path):
    summ = TL.summarize(_stamps())
    k1, k2 = summ["kernels"]["k1"], summ["kernels"]["k2"]
    assert k1["span_us"] == 9.0 and k2["span_us"] == 12.0
    assert set(k1["stages"]) == {"qkv", "attn", "combine"} and "final" not in k2["stages"]
    assert k2["stages"]["gate_up"] == {"ready_us": 7.0, "end_us": 9.0, "wait_us": 1.0, "busy_us": 2.0}
    assert summ["launch_gap_us"] == 5.0
    assert any(line.startswith("k2 span 12.0 us") for line in TL.describe(summ))
    png = tmp_path / "t.png"
    TL.plot_layer(_stamps(), 1, "synthetic", png)
    assert png.stat().st_size > 5000


def test_a_stage_never_stamped_is_left_out():
    """K2 without its post stage (``Target.fused_post``: no stamps at all for it) reports the other
    stages only; the stages around it keep their own times."""
    st = _stamps()
    st[:, 1, :, 1, :] = 0
    summ = TL.summarize(st)
    k2 = summ["kernels"]["k2"]
    assert set(k2["stages"]) == {"o_proj", "gate_up", "down"}
    assert k2["stages"]["gate_up"] == {"ready_us": 7.0, "end_us": 9.0, "wait_us": 1.0, "busy_us": 2.0}
    assert not any("post" in line for line in TL.describe(summ))


def test_program_slots_past_a_kernels_grid_are_left_out(tmp_path):
    """K1 on a grid of half K2's (``Target.fp8_wide_k1_programs_per_sm``): the slots past K1's
    grid stay 0 and neither its times nor the launch gap count them."""
    st = torch.cat([_stamps(), _stamps()], dim=2)  # 8 program slots, both kernels stamp all
    st[:, 0, 4:] = 0  # K1 ran on the first 4
    summ = TL.summarize(st)
    assert summ["kernels"]["k1"]["span_us"] == 9.0 and summ["launch_gap_us"] == 5.0
    assert summ["kernels"]["k1"]["stages"]["attn"]["busy_us"] == 2.0
    png = tmp_path / "t.png"
    TL.plot_layer(st, 1, "synthetic", png)
    assert png.stat().st_size > 5000


def _step_stamps(layers=2, programs=4):
    """The step launch's slots: QKV and attention where K1's first two stages sit, o_proj, gate/up
    and down at K2's 0, 2 and 3; each stage waits 1 us and works 2 us; o_proj's programs enter
    1 us before the last attention ends (the halves overlap in one launch)."""
    st = torch.zeros(layers, 2, programs, 5, 4, dtype=torch.int64)
    t = 1_000_000
    for l in range(layers):
        for k, s in ((0, 0), (0, 1), (1, 0), (1, 2), (1, 3)):
            if (k, s) == (1, 0):
                t -= 1000
            st[l, k, :, s, 0] = t
            st[l, k, :, s, 1] = t + 1000
            st[l, k, :, s, 2] = t + 3000
            t += 3000
    return st


def test_the_step_launchs_halves_are_named_and_their_overlap_is_a_negative_gap(tmp_path):
    """``STEP``: the summary names the halves and their stages, a slot the layout leaves unnamed
    is never reported even when stamped, the gap (last attention end -> first o_proj entry) is
    negative where they overlap, and the plot is drawn."""
    st = _step_stamps()
    st[:, 0, :, 2, :3] = st[:, 0, :, 1, :3]  # a stamp in the unnamed slot (K1's combine)
    summ = TL.summarize(st, TL.STEP)
    att, mlp = summ["kernels"]["attention_half"], summ["kernels"]["mlp_half"]
    assert set(att["stages"]) == {"qkv", "attention"} and set(mlp["stages"]) == {"o_proj", "gate_up", "down"}
    assert att["stages"]["attention"] == {"ready_us": 4.0, "end_us": 6.0, "wait_us": 1.0, "busy_us": 2.0}
    assert summ["launch_gap_us"] == -1.0
    assert any(line.startswith("last attention end -> first o_proj entry -1.0 us") for line in TL.describe(summ))
    assert TL.summarize(_stamps())["gap"] == "K1 end -> K2 start"
    png = tmp_path / "s.png"
    TL.plot_layer(st, 1, "synthetic step", png, TL.STEP)
    assert png.stat().st_size > 5000


def test_the_chain_splits_a_layers_period_into_hand_offs_and_streams():
    """``chain``, from layer 1 on: each stage's hand-off is measured from the stage before's LAST
    program (layer 1's QKV from layer 0's down) to this stage's MEDIAN program past its wait, its
    stream from there to its last program, and they add up to the layer's period. Every stage of
    ``_step_stamps`` waits 1 us and works 2 us, o_proj entering 1 us before the attention ends
    (a 14 us period); one program finishing gate/up 4 us late puts 4 us on gate/up's stream and
    takes it off down's hand-off, whose programs had waited for it; three of four programs past
    gate/up's wait 1 us later move 1 us from its stream to its hand-off."""
    summ = TL.summarize(_step_stamps(layers=3), TL.STEP)
    chain = {c["stage"]: (c["handoff_us"], c["stream_us"]) for c in summ["chain"]}
    assert list(chain) == ["qkv", "attention", "o_proj", "gate_up", "down"]
    assert chain == {"qkv": (1.0, 2.0), "attention": (1.0, 2.0), "o_proj": (0.0, 2.0), "gate_up": (1.0, 2.0),
                     "down": (1.0, 2.0)}  # fmt: skip
    late = _step_stamps(layers=2)
    late[1, 1, 3, 2, 2] += 4000  # layer 1: program 3's gate/up ends 4 us later ...
    late[1, 1, :, 3, 1:3] += 3000  # ... and down's programs get past their wait 3 us later (1 us after it)
    late[1, 1, 1:, 2, 1] += 1000  # and 3 of gate/up's 4 programs got past their wait 1 us later: the median
    chain = {c["stage"]: (c["handoff_us"], c["stream_us"]) for c in TL.summarize(late, TL.STEP)["chain"]}
    assert chain["gate_up"] == (2.0, 5.0) and chain["down"] == (0.0, 2.0)
    line = TL.describe(TL.summarize(_step_stamps(layers=3), TL.STEP))[-1]
    assert line.endswith("= 14.0 (hand-offs 4.0)") and "o_proj 0.0 + 2.0" in line
    assert TL.summarize(_step_stamps(layers=1), TL.STEP)["chain"] == []


def test_the_attention_stream_splits_at_the_last_partial_stored(tmp_path):
    """``attention_parts`` (``STEP`` only): the attention's stream (the median program past its
    wait -> the last head merged, 2 us in ``_step_stamps``) splits at the LAST task's partial
    stored; a task's own time is the MEDIAN over the programs that had a task (program 3 has none
    and stamps no partial), beside the slowest's. Partials 0.5, 1.0 and 1.5 us past the wait: tasks
    1.0, the slowest 1.5, the last partial 1.5, the merge after it 0.5; their q, k and v in 0.2, 0.4
    and 0.9 us past the wait: 0.4."""
    st = _step_stamps(layers=2)
    for p, after, q_in in ((0, 500, 200), (1, 1000, 400), (2, 1500, 900)):
        st[:, 0, p, 1, 3] = st[:, 0, p, 1, 1] + after
        st[:, 0, p, 2, 0] = st[:, 0, p, 1, 1] + q_in
    summ = TL.summarize(st, TL.STEP)
    assert summ["attention_parts"] == {"task_us": 1.0, "task_max_us": 1.5, "q_in_us": 0.4, "last_partial_us": 1.5,
                                       "merge_us": 0.5}  # fmt: skip
    assert set(summ["kernels"]["attention_half"]["stages"]) == {"qkv", "attention"}  # q_in's slot is no stage
    chain = {c["stage"]: c["stream_us"] for c in summ["chain"]}
    parts = summ["attention_parts"]
    assert parts["last_partial_us"] + parts["merge_us"] == chain["attention"]
    line = TL.describe(summ)[-1]
    assert line.startswith("attention's stream (us): the last partial stored 1.5, then the last head merged 0.5")
    assert "a task 1.0 (median, its wait over -> its partial stored; the slowest 1.5)" in line
    assert line.endswith("its q, k and v in after 0.4")
    assert TL.summarize(_step_stamps(), TL.STEP)["attention_parts"] is None  # no partial stamped
    assert "attention_parts" not in TL.summarize(_stamps())  # the two-launch kernels stamp none
    png = tmp_path / "p.png"
    TL.plot_layer(st, 1, "synthetic step, partials marked", png, TL.STEP)
    assert png.stat().st_size > 5000


def test_a_timeline_cell_draws_each_step_variant_under_its_own_name():
    """A knob timed as a step variant gets a timeline beside the step launch's (run 167's
    ``l2_ahead`` was timed without one, so where its time went was left to guess), each plot
    under its own name, and only backends the cell timed are drawn."""
    from monodecode_ops.decode_bench.harness import timeline_backends, timeline_png

    kernels = {"triton-step-l2a4": 0, "triton": 0, "triton-step": 0, "triton-step-bad": 0}
    steps = dict.fromkeys(kernels)
    timed = {"triton": 1.0, "triton-step": 0.9, "triton-step-l2a4": 0.95}  # "bad" failed: no time
    drawn = timeline_backends(kernels, steps, timed)
    assert drawn == ["triton", "triton-step", "triton-step-l2a4"]
    assert timeline_backends({"triton": 0}, {"triton": 0}, {}) == []
    names = [timeline_png("s", "llama3-8b", "bf16", 1024, 1, b) for b in drawn]
    assert names == [
        "s_timeline_llama3-8b_bf16_c1024_b1.png",
        "s_timeline_llama3-8b_bf16_c1024_b1_step.png",
        "s_timeline_llama3-8b_bf16_c1024_b1_step-l2a4.png",
    ]
