"""Serve mono only where it wins: the decision from measured timings, the runner's warm-up
timing on the CPU (test backends and the Triton interpreter) and on a GPU (gpu-marked)."""

import json
import os
import subprocess
import sys
import textwrap
import time
from typing import ClassVar

import pytest
import torch
from prometheus_client import CollectorRegistry

from monodecode.config import MonoConfig
from monodecode.kernels.reference_backend import ReferenceBackend, ReferenceKernels
from monodecode.metrics import MonoMetrics
from monodecode.model.profiles import profile_dims
from monodecode.model.reference import decode_layer
from monodecode.model.weights import random_weights
from monodecode.runtime.runner import Runner
from monodecode.runtime.vote import StepInfo
from monodecode.runtime.width_policy import WidthTiming, choose_widths, time_widths, timing_contexts
from monodecode.services.platform import Platform

pytestmark = pytest.mark.usefixtures("torch_one_thread")

DIMS = profile_dims("tiny")
CPU = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)


def timing(width, mono_ms, stock_ms, context=1024):
    return WidthTiming(width, context, mono_ms / 1e3, stock_ms / 1e3, 3, "graph")


def test_auto_serves_only_the_faster_widths():
    timings = {
        1: (timing(1, 1.0, 1.5),),
        2: (timing(2, 2.0, 1.9),),
        4: (timing(4, 3.0, 3.0),),
        8: (timing(8, 2.0, 4.0),),
    }
    served, dropped = choose_widths((1, 2, 4, 8), timings, "auto")
    assert served == (1, 8) and sorted(dropped) == [2, 4]  # a tie is not a win
    assert dropped[2].startswith("slower than stock: width 2 at context 1024: mono 2 ms vs stock 1.9 ms (0.95x, graph")
    assert choose_widths((1, 2, 4, 8), timings, "force") == ((1, 2, 4, 8), {})
    assert choose_widths((1, 2), {2: (timing(2, 3.0, 1.0),)}, "auto")[0] == (1,)  # untimed width 1 kept


def test_a_width_is_served_only_where_it_wins_at_every_context():
    """Mono's margin shrinks with context: a width that wins at 1k but loses at 32k is dropped,
    and the reason names the losing context only."""
    shrinking = (timing(8, 1.0, 1.2, 1024), timing(8, 2.0, 2.1, 5793), timing(8, 4.0, 3.3, 32767))
    winning = tuple(timing(1, 1.0, 1.1, c) for c in (1024, 5793, 32767))
    served, dropped = choose_widths((1, 8), {1: winning, 8: shrinking}, "auto")
    assert served == (1,)
    assert dropped[8].startswith("slower than stock: width 8 at context 32767: mono 4 ms vs stock 3.3 ms (0.82x")
    assert "context 1024" not in dropped[8] and "context 5793" not in dropped[8]


class SleepBench:
    """A stock side for ``time_widths`` alone: steps that sleep (mono faster at width 1 only)."""

    name = "sleep"

    def __init__(self):
        self.timed = []

    def contexts(self, width):
        return (1024, 2048, 4096)

    def steps(self, width, context):
        self.timed.append((width, context))
        return (lambda: time.sleep(0.002 * width)), (lambda: time.sleep(0.003))

    def close(self):
        pass


def test_a_spent_timing_budget_leaves_only_shorter_contexts_untimed():
    """Every width is timed at its longest context first, even past the budget; then nothing more
    (budget 0): the shorter contexts are reported untimed. Width 2 lost at the longest context
    (6 ms against 3 ms) and is not queued again."""
    bench = SleepBench()
    run = time_widths(bench, (1, 2), "cpu", total_budget_s=0.0)
    assert bench.timed == [(1, 4096), (2, 4096)]
    assert run.skipped == [(1, 2048), (1, 1024)]
    assert [t.context for t in run.timings[1]] == [4096] and run.timings[2][0].speedup < 1
    full = time_widths(SleepBench(), (1, 2), "cpu", total_budget_s=60.0)
    assert [t.context for t in full.timings[1]] == [1024, 2048, 4096] and full.skipped == []
    assert [t.context for t in full.timings[2]] == [4096]


def test_timing_contexts_span_1024_to_the_longest_the_budget_holds():
    assert timing_contexts(32767, 10**9) == (1024, 5793, 32767)  # max_model_len 32k: 1k, between, 32k
    assert timing_contexts(32767, 8191) == (1024, 2896, 8191)  # the KV budget holds 8k per row
    assert timing_contexts(255, 10**9) == (63, 127, 255)  # below 2k: a quarter, between, the longest
    assert timing_contexts(1, 10**9) == (1,)


def runner(tmp_path, weights, stock_layer=None, max_len=None, **cfg):
    conf = MonoConfig(enabled=True, failstop_dir=str(tmp_path / "fs"), exit_on_failstop=False, **cfg)
    reg = CollectorRegistry()
    metrics = MonoMetrics(reg)
    return Runner(
        conf, DIMS, weights, CPU, metrics=metrics, faults=(), stock_layer=stock_layer, max_model_len=max_len
    ), reg


def stock_plus_10ms(weights):
    def layer(i, x, meta, kv):
        time.sleep(0.01)
        return decode_layer(DIMS, i, weights.layers[i], x, meta, kv)

    return layer


def test_warmup_timing_drops_the_slower_width(weights, tmp_path, slow_at_two):
    """Real timing on both paths: widths 1 and 4 beat the stock step (10 ms per layer slower),
    width 2 loses to it (30 ms per layer slower still): served [1, 4], width 2 steps fall back."""
    r, reg = runner(tmp_path, weights, stock_plus_10ms(weights), backend=slow_at_two, widths=(1, 2, 4), max_len=256)
    r.start()
    assert r.state == "mono" and r.served_widths == (1, 4) and list(r.dropped_widths) == [2]
    t = r.width_timings
    contexts = [x.context for x in t[1]]
    assert contexts == [63, 127, 255] and [x.context for x in t[4]] == contexts  # max_model_len 256
    assert all(x.speedup > 1 for x in t[1] + t[4])
    assert [x.context for x in t[2]] == [255] and t[2][0].speedup < 1  # lost at the longest: no more timed
    assert t[1][0].how == "eager" and t[1][0].replays >= 1
    for x in t[2]:
        labels = {"width": "2", "context": str(x.context), "stock": "stock_layer"}
        assert reg.get_sample_value("monodecode_width_speedup", labels) == pytest.approx(x.speedup)
    assert 0 < reg.get_sample_value("monodecode_width_timing_seconds", {"stock": "stock_layer"}) < 60
    assert "dropped 2 (slower than stock: width 2 at context 255: mono" in r.width_report()
    assert (r.decide(StepInfo(2)).path, r.decide(StepInfo(2)).reason) == ("fallback", "width_dropped")
    assert r.decide(StepInfo(1)).width == 1 and r.decide(StepInfo(3)).width == 4
    d = r.begin_step(StepInfo(2))
    assert reg.get_sample_value("monodecode_fallback_steps_total", {"reason": "width_dropped"}) == 1 and not d
    assert r.summary()["widths"]["dropped"] == {"2": r.dropped_widths[2]}


def test_force_serves_every_width_untimed(weights, tmp_path, slow_at_two):
    r, _ = runner(tmp_path, weights, backend=slow_at_two, widths=(1, 2), width_policy="force")
    r.start()
    assert r.served_widths == (1, 2) and r.width_timings == {} and "forced: not timed" in r.width_report()
    assert r.decide(StepInfo(2)).path == "mono"


INTERPRETED = textwrap.dedent(
    """
    import json, sys
    from monodecode.kernels.triton import interpret
    interpret.enable()
    from prometheus_client import CollectorRegistry
    from monodecode.config import MonoConfig
    from monodecode.metrics import MonoMetrics
    from monodecode.model.profiles import profile_dims
    from monodecode.model.weights import random_weights
    from monodecode.runtime.runner import Runner
    from monodecode.services.platform import Platform

    dims = profile_dims("tiny")
    cfg = MonoConfig(enabled=True, backend="triton", widths=(1,), allow_jit=True, on_refusal="degrade",
                     failstop_dir=sys.argv[1], exit_on_failstop=False, width_policy=sys.argv[2])
    reg = CollectorRegistry()
    r = Runner(cfg, dims, random_weights(dims, 0), Platform("cpu", "cpu", "cpu", 2), metrics=MonoMetrics(reg),
               faults=(), max_model_len=16).start()
    labels = {"width": "1", "context": "15", "stock": "reference"}
    print(json.dumps({"state": r.state, "reasons": r.reasons, "served": list(r.served_widths),
                      "speedup": reg.get_sample_value("monodecode_width_speedup", labels),
                      "report": r.width_report()}))
    """
)


def test_interpreted_kernels_lose_to_stock_and_auto_degrades(tmp_path):
    """The real Triton K1/K2 under the interpreter (one program at a time) are far slower than the
    stock step: auto times them, drops the only width and starts degraded (slower_than_stock,
    never a raise); force serves it untimed."""
    env = {k: v for k, v in os.environ.items() if k not in ("MONODECODE_FAULT", "PROMETHEUS_MULTIPROC_DIR")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = {}
    for policy in ("auto", "force"):
        p = subprocess.run(
            [sys.executable, "-c", INTERPRETED, str(tmp_path / policy), policy],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        out[policy] = json.loads(p.stdout.strip().splitlines()[-1])
    auto = out["auto"]
    assert auto["state"] == "degraded" and auto["served"] == [] and auto["speedup"] < 1
    assert auto["reasons"][0].startswith(
        "slower_than_stock: no built width beat the stock step at every timed context at warm-up: width 1 at context 15:"
    )
    force = out["force"]
    assert force["state"] == "mono" and force["served"] == [1] and force["speedup"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU torch can launch on")
def test_gpu_widths_timed_as_graphs(tmp_path):
    """On a GPU the compiled Triton kernels and the stock layers (outside vLLM: the reference,
    named so) are both captured and their graph replays timed at contexts from 1024 up to
    max_model_len 8192; the served widths are exactly those measured faster at every context."""
    from monodecode.services.platform import detect_platform

    dims = profile_dims("llama3-1b")
    gpu_weights = random_weights(dims, seed=0, device="cuda")
    cfg = MonoConfig(
        enabled=True,
        backend="triton",
        widths=(1, 8),
        allow_jit=True,
        on_refusal="degrade",
        failstop_dir=str(tmp_path),
        exit_on_failstop=False,
    )
    reg = CollectorRegistry()
    platform = detect_platform(0)
    r = Runner(cfg, dims, gpu_weights, platform, metrics=MonoMetrics(reg), faults=(), max_model_len=8192).start()
    t = r.width_timings
    print(r.width_report())
    timed = [x for ts in t.values() for x in ts]
    assert sorted(t) == [1, 8] and all(x.how == "graph" and x.mono_s > 0 and x.stock_s > 0 for x in timed)
    assert r.stock_side == "reference" and t[1][-1].context == 8191
    assert r.served_widths == tuple(w for w in (1, 8) if all(x.speedup > 1 for x in t[w]))
    for x in timed:
        labels = {"width": str(x.width), "context": str(x.context), "stock": "reference"}
        assert reg.get_sample_value("monodecode_width_speedup", labels) == pytest.approx(x.speedup)
    assert (r.state == "mono") == bool(r.served_widths)


def test_a_stock_layer_that_cannot_run_leaves_the_widths_untimed_never_reference_timed(weights, tmp_path, slow_at_two):
    """The stock side cannot run: nothing is timed (the reference does not stand in for it), every
    width is served as with force, and the report and the metric's stock label say so."""

    def engine_bound_layer(layer, x, meta, kv):
        raise RuntimeError("Forward context is not set.\nsecond line")

    r, reg = runner(tmp_path, weights, engine_bound_layer, backend=slow_at_two, widths=(2,), on_refusal="degrade")
    r.start()
    assert r.state == "mono" and r.served_widths == (2,) and r.width_timings == {}
    assert r.stock_side == "unavailable"
    assert r.width_report() == (
        "width policy auto: serving widths [2] (not timed: the stock layer cannot run at warm-up "
        "(RuntimeError: Forward context is not set.); every width is served untimed, as with force)"
    )
    assert reg.get_sample_value("monodecode_width_timing_seconds", {"stock": "unavailable"}) == 0


class FailsAtLongContexts(ReferenceKernels):
    """Passes the golden check (short contexts), raises on contexts longer than 64 tokens."""

    def forward_layer(self, layer, x, meta, kv):
        if int(meta.seq_lens.max()) > 64:
            raise RuntimeError("HIP error: an illegal memory access was encountered")
        return super().forward_layer(layer, x, meta, kv)


class FailsAtLongContextsBackend(ReferenceBackend):
    name: ClassVar[str] = "test_fails_at_long_contexts"

    def build(self, req, weights, artifacts, allow_jit):
        return FailsAtLongContexts(req, weights)


def test_a_timing_that_raises_serves_every_width_untimed_and_says_so(weights, tmp_path, backend):
    r, reg = runner(tmp_path, weights, backend=backend(FailsAtLongContextsBackend), widths=(1, 2), max_len=256)
    r.start()
    assert r.state == "mono" and r.served_widths == (1, 2) and r.width_timings == {} and r.stock_side == "unavailable"
    assert r.width_report().startswith(
        "width policy auto: serving widths [1, 2] (not timed: timing the widths against reference raised "
        "RuntimeError: HIP error: an illegal memory access was encountered; every width is served untimed"
    ), r.width_report()
    assert reg.get_sample_value("monodecode_width_timing_seconds", {"stock": "unavailable"}) == 0


def test_a_build_holding_fewer_programs_than_planned_is_logged_and_still_served(weights, tmp_path, backend, caplog):
    """The kernels' residency report (``DecodeKernels.residency_misfits``): the numbers stay
    exact, so mono decode still serves, and the warning names the launch and both counts."""
    from fake_backends import MisfitBackend

    r, _ = runner(tmp_path, weights, backend=backend(MisfitBackend), widths=(1,), width_policy="force")
    with caplog.at_level("WARNING", logger="monodecode"):
        r.start()
    assert r.state == "mono" and r.served_widths == (1,)
    assert (
        "mono decode test_misfit build: width 1 ka: 3 programs per SM, planned for 4 (exact, slower than planned)"
        in [rec.getMessage() for rec in caplog.records]
    )
