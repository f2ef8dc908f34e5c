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
from monodecode.runtime.width_policy import WidthTiming, choose_widths
from monodecode.services.platform import Platform

pytestmark = pytest.mark.usefixtures("torch_one_thread")

DIMS = profile_dims("tiny")
CPU = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)


def timing(width, mono_ms, stock_ms):
    return WidthTiming(width, mono_ms / 1e3, stock_ms / 1e3, 3, "graph")


def test_auto_serves_only_the_faster_widths():
    timings = {1: timing(1, 1.0, 1.5), 2: timing(2, 2.0, 1.9), 4: timing(4, 3.0, 3.0), 8: timing(8, 2.0, 4.0)}
    served, dropped = choose_widths((1, 2, 4, 8), timings, "auto")
    assert served == (1, 8) and sorted(dropped) == [2, 4]  # a tie is not a win
    assert dropped[2].startswith("slower than stock: width 2: mono 2 ms vs stock 1.9 ms (0.95x, graph")
    assert choose_widths((1, 2, 4, 8), timings, "force") == ((1, 2, 4, 8), {})
    assert choose_widths((1, 2), {2: timing(2, 3.0, 1.0)}, "auto")[0] == (1,)  # untimed width 1 kept


class SlowAtTwo(ReferenceKernels):
    """The reference math, but a width-2 step costs 30 ms more per layer."""

    def forward_layer(self, layer, x, meta, kv):
        if self._width(x.shape[0]) == 2:
            time.sleep(0.03)
        return super().forward_layer(layer, x, meta, kv)


class SlowAtTwoBackend(ReferenceBackend):
    name: ClassVar[str] = "test_slow_at_two"

    def build(self, req, weights, artifacts, allow_jit):
        return SlowAtTwo(req, weights)


@pytest.fixture
def slow_at_two(backend):
    return backend(SlowAtTwoBackend)


def runner(tmp_path, weights, stock_layer=None, **cfg):
    conf = MonoConfig(enabled=True, failstop_dir=str(tmp_path / "fs"), exit_on_failstop=False, **cfg)
    reg = CollectorRegistry()
    return Runner(conf, DIMS, weights, CPU, metrics=MonoMetrics(reg), faults=(), stock_layer=stock_layer), reg


def stock_plus_10ms(weights):
    def layer(i, x, meta, kv):
        time.sleep(0.01)
        return decode_layer(DIMS, i, weights.layers[i], x, meta, kv)

    return layer


def test_warmup_timing_drops_the_slower_width(weights, tmp_path, slow_at_two):
    """Real timing on both paths: widths 1 and 4 beat the stock step (10 ms per layer slower),
    width 2 loses to it (30 ms per layer slower still): served [1, 4], width 2 steps fall back."""
    r, reg = runner(tmp_path, weights, stock_plus_10ms(weights), backend=slow_at_two, widths=(1, 2, 4))
    r.start()
    assert r.state == "mono" and r.served_widths == (1, 4) and list(r.dropped_widths) == [2]
    t = r.width_timings
    assert t[1].speedup > 1 > t[2].speedup and t[1].how == "eager" and t[1].replays >= 1
    assert reg.get_sample_value("monodecode_width_speedup", {"width": "2"}) == pytest.approx(t[2].speedup)
    assert "dropped 2 (slower than stock: width 2: mono" in r.width_report()
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
               faults=()).start()
    print(json.dumps({"state": r.state, "reasons": r.reasons, "served": list(r.served_widths),
                      "speedup": reg.get_sample_value("monodecode_width_speedup", {"width": "1"}),
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
    assert auto["reasons"][0].startswith("slower_than_stock: no built width beat the stock step at warm-up: width 1")
    force = out["force"]
    assert force["state"] == "mono" and force["served"] == [1] and force["speedup"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU torch can launch on")
def test_gpu_widths_timed_as_graphs(tmp_path):
    """On a GPU the compiled Triton kernels and the stock layers are both captured and their
    graph replays timed; the served widths are exactly those measured faster."""
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
    r = Runner(cfg, dims, gpu_weights, detect_platform(0), metrics=MonoMetrics(reg), faults=()).start()
    t = r.width_timings
    print(r.width_report())
    assert sorted(t) == [1, 8] and all(x.how == "graph" and x.mono_s > 0 and x.stock_s > 0 for x in t.values())
    assert r.served_widths == tuple(w for w in (1, 8) if t[w].speedup > 1)
    for w, x in t.items():
        assert reg.get_sample_value("monodecode_width_speedup", {"width": str(w)}) == pytest.approx(x.speedup)
    assert (r.state == "mono") == bool(r.served_widths)


def test_a_stock_layer_that_cannot_run_at_warmup_is_replaced_by_the_reference(weights, tmp_path, slow_at_two):
    def engine_bound_layer(layer, x, meta, kv):
        raise RuntimeError("Forward context is not set.\nsecond line")

    r, _ = runner(tmp_path, weights, engine_bound_layer, backend=slow_at_two, widths=(2,), on_refusal="degrade")
    r.start()
    assert r.state == "degraded" and r.reasons[0].startswith("slower_than_stock: ")  # timed against the reference
    assert r.notes == [
        "width timing: the stock layer cannot run at warm-up (RuntimeError: Forward context is not set.); "
        "the reference layers stand in for the stock step"
    ]
