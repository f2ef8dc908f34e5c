"""Shadow check while serving: one layer's kernel output compared with the stock layer every Nth
real mono step; metrics per result; past the warm-up tolerance the runner degrades or
fail-stops, naming the layer, the step and the error."""

from typing import ClassVar

import pytest
import torch
from prometheus_client import CollectorRegistry

from monodecode.config import MonoConfig
from monodecode.kernels.reference_backend import ReferenceBackend, ReferenceKernels
from monodecode.metrics import MonoMetrics
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights
from monodecode.runtime.failstop import FailStop
from monodecode.runtime.runner import Runner
from monodecode.runtime.vote import StepInfo
from monodecode.services.platform import Platform

pytestmark = pytest.mark.usefixtures("torch_one_thread")

DIMS = profile_dims("tiny")
CPU = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)


class GoesWrongLater(ReferenceKernels):
    """Right through the warm-up golden check, then layer 1's output drifts by 0.5 (a kernel bug
    that shows only while serving, e.g. at longer contexts)."""

    calls = 0

    def forward_layer(self, layer, x, meta, kv):
        out = super().forward_layer(layer, x, meta, kv)
        GoesWrongLater.calls += 1
        if layer == 1 and GoesWrongLater.calls > DIMS.num_layers * 2:  # after the golden check (widths 1, 2)
            out = out + 0.5
        return out


class GoesWrongLaterBackend(ReferenceBackend):
    name: ClassVar[str] = "test_goes_wrong_later"

    def build(self, req, weights, artifacts, allow_jit):
        GoesWrongLater.calls = 0
        return GoesWrongLater(req, weights)


@pytest.fixture
def goes_wrong_later(backend):
    return backend(GoesWrongLaterBackend)


def start(tmp_path, weights, **cfg):
    conf = MonoConfig(
        enabled=True,
        widths=(1, 2),
        width_policy="force",
        failstop_dir=str(tmp_path / "fs"),
        termination_log=str(tmp_path / "term"),
        exit_on_failstop=False,
        **cfg,
    )
    reg = CollectorRegistry()
    r = Runner(conf, DIMS, weights, CPU, metrics=MonoMetrics(reg), faults=()).start()
    assert r.state == "mono", r.reasons
    return r, reg


def decode(r, steps):
    """``steps`` single-row decode steps of one growing sequence on the runner's own loop."""
    alloc = BlockAllocator(8, 16)
    kv = PagedKVCache.allocate(DIMS, 8, 16)
    alloc.append_slots(0, 9)
    token = torch.tensor([5])
    paths = []
    for _ in range(steps):
        meta = alloc.decode_metadata([0])
        logits = r.decode_step(token, meta, kv, StepInfo(num_rows=1))
        token = logits.argmax(-1)
        paths.append((r.last_decision.path, r.last_decision.reason))
    return paths


def test_right_kernels_pass_every_check(weights, tmp_path):
    r, reg = start(tmp_path, weights, shadow_check_every=2)
    assert decode(r, 9) == [("mono", None)] * 9
    assert reg.get_sample_value("monodecode_shadow_checks_total", {"result": "pass"}) == 4
    assert reg.get_sample_value("monodecode_shadow_checks_total", {"result": "fail"}) == 0
    assert reg.get_sample_value("monodecode_shadow_max_abs_error") == 0.0  # the reference path is exact


def test_a_stock_layer_that_raises_stops_the_checks_not_serving(weights, tmp_path):
    conf = MonoConfig(
        enabled=True,
        widths=(1,),
        width_policy="force",
        shadow_check_every=1,
        failstop_dir=str(tmp_path / "fs"),
        exit_on_failstop=False,
    )

    def broken(layer, x, meta, kv):
        raise RuntimeError("no forward context")

    r = Runner(conf, DIMS, weights, CPU, faults=(), stock_layer=broken).start()
    assert decode(r, 3) == [("mono", None)] * 3 and r.state == "mono"
    assert r.notes == ["shadow check stopped: the stock layer raised RuntimeError: no forward context"]


def test_off_by_default(weights, tmp_path):
    r, reg = start(tmp_path, weights)
    decode(r, 3)
    assert reg.get_sample_value("monodecode_shadow_checks_total", {"result": "pass"}) == 0


def test_a_kernel_that_goes_wrong_while_serving_degrades(weights, tmp_path, goes_wrong_later):
    r, reg = start(tmp_path, weights, backend=goes_wrong_later, shadow_check_every=1)
    paths = decode(r, 4)
    # check 0 compares layer 0 (right), check 1 layer 1 (drifted): the next step runs stock decode
    assert paths == [("mono", None), ("mono", None), ("fallback", "degraded"), ("fallback", "degraded")]
    assert r.state == "degraded"
    (reason,) = r.reasons
    assert reason.startswith("shadow_mismatch: layer 1 at step 1: the kernels' output differs from the stock")
    assert reg.get_sample_value("monodecode_shadow_checks_total", {"result": "fail"}) == 1
    assert reg.get_sample_value("monodecode_shadow_max_abs_error") >= 0.5
    assert reg.get_sample_value("monodecode_refusal_info", {"reason": "shadow_mismatch"}) == 1


def test_failstop_on_shadow_mismatch_records_the_cause(weights, tmp_path, goes_wrong_later):
    r, reg = start(tmp_path, weights, backend=goes_wrong_later, shadow_check_every=1, shadow_on_fail="failstop")
    with pytest.raises(FailStop) as e:
        decode(r, 4)
    ev = e.value.event
    assert (ev.site, ev.layer, ev.step) == ("shadow_mismatch", 1, 1)
    assert "differs from the stock layer's by" in ev.detail
    assert reg.get_sample_value("monodecode_failstop_total", {"site": "shadow_mismatch"}) == 1
    assert (tmp_path / "fs" / "failstop-rank0.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU torch can launch on")
def test_gpu_shadow_checks_run_off_the_hot_path(tmp_path):
    """The compiled Triton kernels on a GPU: checks queued on the side stream, read back without
    waiting, all within the warm-up tolerance; none blocks the host (sync debug mode)."""
    from monodecode.services.platform import detect_platform

    dims = profile_dims("llama3-1b")
    w = random_weights(dims, seed=0, device="cuda")
    conf = MonoConfig(
        enabled=True,
        backend="triton",
        widths=(1,),
        allow_jit=True,
        width_policy="force",
        shadow_check_every=1,
        failstop_dir=str(tmp_path / "fs"),
        exit_on_failstop=False,
    )
    reg = CollectorRegistry()
    r = Runner(conf, dims, w, detect_platform(0), metrics=MonoMetrics(reg), faults=()).start()
    assert r.state == "mono", r.reasons
    alloc = BlockAllocator(8, 16)
    kv = PagedKVCache.allocate(dims, 8, 16, device="cuda")
    alloc.append_slots(0, 40)
    x = torch.randn(1, dims.hidden_size, device="cuda").to(torch.bfloat16)
    meta = alloc.decode_metadata([0], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            d = r.begin_step(StepInfo(num_rows=1))
            y = x
            for layer in range(dims.num_layers):
                y = r.forward_layer(layer, y, meta, kv)
            r.check_health_before_logits(d, y)
            r.end_step(d)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    r.begin_step(StepInfo(num_rows=1, has_metadata=False))  # collects the finished checks
    assert reg.get_sample_value("monodecode_shadow_checks_total", {"result": "pass"}) == 6
    assert reg.get_sample_value("monodecode_shadow_checks_total", {"result": "fail"}) == 0
    assert r.state == "mono"
