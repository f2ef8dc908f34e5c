"""Fail-stop for real: a driver process decodes with the runner; injected faults make it exit.

Each case runs a separate Python process (the exit is ``os._exit``), then reads what it left:
stdout tokens (none for the failed step), the marker file, the termination message, and what
the next start exports or decides (crash-loop guard)."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from monodecode.runtime.failstop import EXIT_CODE, FailStop, FailStopEvent, FailStopRecorder

DRIVER = textwrap.dedent(
    """
    import json, sys, torch
    from prometheus_client import CollectorRegistry
    from monodecode.config import MonoConfig
    from monodecode.metrics import FAILSTOP_SITES, MonoMetrics
    from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
    from monodecode.model.profiles import profile_dims
    from monodecode.model.weights import random_weights
    from monodecode.services.platform import Platform
    from monodecode.runtime.runner import Runner

    from monodecode.services.platform import detect_platform

    cfg = MonoConfig.from_json(sys.argv[1])
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    dims = profile_dims("tiny")
    weights = random_weights(dims, seed=0, device=device)
    platform = Platform("cpu", "cpu", "cpu", 2) if device == "cpu" else detect_platform(0)
    reg = CollectorRegistry()
    runner = Runner(cfg, dims, weights, platform, metrics=MonoMetrics(reg)).start()
    print(json.dumps({
        "state": runner.state, "reasons": runner.reasons, "notes": runner.notes,
        "failstops": {s: reg.get_sample_value("monodecode_failstop_total", {"site": s}) for s in FAILSTOP_SITES},
        "last": reg.get_sample_value("monodecode_last_failstop_timestamp_seconds"),
    }), flush=True)
    alloc = BlockAllocator(8, 16)
    kv = PagedKVCache.allocate(dims, 8, 16, device=device)
    alloc.append_slots(0, 15)
    token = 5
    for step in range(int(sys.argv[2])):
        ids = torch.tensor([token], device=device)
        logits = runner.decode_step(ids, alloc.decode_metadata([0], device=device), kv)
        token = int(logits[0].argmax())
        print(f"token step={step} path={runner.last_decision.path} id={token}", flush=True)
    print("done", flush=True)
    """
)


@pytest.fixture
def drive(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    fs = tmp_path / "failstop"

    def run(fault=None, steps=4, device="cpu", **cfg):
        conf = {
            "enabled": True,
            "widths": [1],
            "failstop_dir": str(fs),
            "termination_log": str(tmp_path / "termination-log"),
            "wait_timeout_s": 0.3,
            "max_failstops": 3,
            **cfg,
        }
        env = {k: v for k, v in os.environ.items() if k not in ("MONODECODE_FAULT", "PROMETHEUS_MULTIPROC_DIR")}
        env["OMP_NUM_THREADS"] = "1"  # small tensors: threads only contend on shared cores
        if fault:
            env["MONODECODE_FAULT"] = fault
        p = subprocess.run(
            [sys.executable, str(script), json.dumps(conf), str(steps), device],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
        )
        lines = p.stdout.splitlines()
        head = json.loads(lines[0]) if lines and lines[0].startswith("{") else None
        tokens = [l for l in lines if l.startswith("token ")]
        return p, head, tokens

    run.failstop_dir = fs
    run.termination_log = tmp_path / "termination-log"
    return run


def test_stall_failstop_restart_and_crash_loop_guard(drive):
    # 1. a stalled K1 publish at mono step 2, layer 1: the bounded wait expires, the process exits
    t0 = time.time()
    p, head, tokens = drive("stall:layer=1,step=2")
    assert p.returncode == EXIT_CODE, p.stderr
    assert head["state"] == "mono" and head["failstops"]["wait_timeout"] == 0
    assert [t.split()[1] for t in tokens] == ["step=0", "step=1"]  # no token for the failed step
    assert "done" not in p.stdout
    line = "monodecode fail-stop: rank 0, step 2, site wait_timeout, k2, layer 1"
    assert line in p.stderr
    assert drive.termination_log.read_text().startswith(line)
    marker = json.loads((drive.failstop_dir / "failstop-rank0.json").read_text())
    (ev,) = marker["events"]
    assert (ev["rank"], ev["step"], ev["site"], ev["layer"], ev["kernel"]) == (0, 2, "wait_timeout", 1, "k2")
    assert t0 <= ev["time"] <= time.time() and marker["totals"] == {"wait_timeout": 1}
    assert not [f for f in drive.failstop_dir.iterdir() if f.name.endswith(".tmp")]

    # 2. restart without the fault: the marker is read and exported, decoding works
    p, head, tokens = drive(steps=2)
    assert p.returncode == 0 and head["state"] == "mono" and len(tokens) == 2
    assert head["failstops"] == {"wait_timeout": 1.0, "nonfinite": 0.0, "kernel_error": 0.0, "shadow_mismatch": 0.0}
    assert head["last"] == pytest.approx(ev["time"])

    # 3. a NaN in layer 3 at the first mono step: site nonfinite, no token at all
    p, head, tokens = drive("nonfinite:layer=3")
    assert p.returncode == EXIT_CODE and tokens == []
    assert "monodecode fail-stop: rank 0, step 0, site nonfinite, k2, layer 3" in p.stderr

    # 4. a third fail-stop within the window
    p, _, _ = drive("stall:layer=0,step=0")
    assert p.returncode == EXIT_CODE

    # 5. the crash-loop guard: the next start is degraded; steps take the stock path and finish
    p, head, tokens = drive(steps=2)
    assert p.returncode == 0, p.stderr
    assert head["state"] == "degraded"
    assert head["reasons"][0].startswith(
        "failstop_loop: 3 fail-stops within 3600 s (limit 3); last: wait_timeout at rank 0 step 0"
    )
    assert head["failstops"] == {"wait_timeout": 2.0, "nonfinite": 1.0, "kernel_error": 0.0, "shadow_mismatch": 0.0}
    assert [t.split()[2] for t in tokens] == ["path=fallback", "path=fallback"]

    # 6. a larger limit lets it start with mono decode again
    p, head, _ = drive(steps=1, max_failstops=4)
    assert head["state"] == "mono"


def test_a_drill_that_can_never_fire_is_refused(drive):
    """A drill naming a rank (or layer) this deployment does not have is a refusal reason, never a
    silently ignored drill: degraded here, the steps run the stock path and finish."""
    p, head, tokens = drive("stall:layer=0,step=0,rank=1", steps=2, on_refusal="degrade")
    assert p.returncode == 0 and len(tokens) == 2, p.stderr
    assert head["state"] == "degraded"
    assert head["reasons"] == [
        "fault_drill: MONODECODE_FAULT drill stall:layer=0,step=0,rank=1 names rank 1; there are ranks 0..0"
    ]
    p, head, _ = drive("nonfinite:layer=4", steps=1, on_refusal="degrade")
    assert head["reasons"][0].endswith("names layer 4; the model has layers 0..3")


def test_unwritable_termination_log_still_writes_marker_and_exits(drive, tmp_path):
    p, _, tokens = drive("nonfinite:layer=0", termination_log=str(tmp_path / "no" / "such" / "dir" / "log"))
    assert p.returncode == EXIT_CODE and tokens == []
    assert "termination message" in p.stderr and "not written" in p.stderr
    assert json.loads((drive.failstop_dir / "failstop-rank0.json").read_text())["totals"] == {"nonfinite": 1}


def test_bad_fault_value_is_a_startup_error(drive):
    p, head, _ = drive("stall:layer=banana")
    assert p.returncode != 0 and head is None
    assert "MONODECODE_FAULT: stall parameter 'layer' needs a non-negative integer" in p.stderr


# ---- in-process units of the recorder ---------------------------------------------------------


def ev(t, site="wait_timeout", step=1):
    return FailStopEvent(rank=0, step=step, site=site, layer=None, kernel=None, time=t)


def test_window_counts_only_recent_failstops(tmp_path):
    rec = FailStopRecorder(tmp_path, exit_on_failstop=False, termination_log=tmp_path / "t")
    now = time.time()
    for t in (now - 5000, now - 4000, now - 10):
        with pytest.raises(Exception):
            rec.fail(ev(t))
    h = rec.read()
    assert len(h.events) == 3 and h.totals == {"wait_timeout": 3}
    assert rec.crash_loop_reason(h, max_failstops=2, window_s=3600, now=now) is None
    assert rec.crash_loop_reason(h, max_failstops=2, window_s=4500, now=now).startswith("failstop_loop: 2 fail-stops")


def test_unreadable_or_malformed_marker_is_reported_not_fatal(tmp_path):
    rec = FailStopRecorder(tmp_path)
    rec.marker_path.write_text("{not json")
    h = rec.read()
    assert h.events == [] and "unreadable" in h.problems[0]
    rec.marker_path.write_text(json.dumps({"schema": 1, "events": [{"rank": "x"}]}))
    assert "malformed" in rec.read().problems[0]
    rec.marker_path.write_text(json.dumps({"schema": 9}))
    assert "malformed" in rec.read().problems[0]


def test_marker_keeps_totals_beyond_the_kept_events(tmp_path):
    rec = FailStopRecorder(tmp_path, exit_on_failstop=False, termination_log=tmp_path / "t")
    for i in range(105):
        with pytest.raises(Exception):
            rec.fail(ev(1000.0 + i, site="nonfinite", step=i))
    h = rec.read()
    assert len(h.events) == 100 and h.totals == {"nonfinite": 105} and h.last.step == 104


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA/ROCm GPU torch can launch on")
def test_gpu_failstop_without_host_sync_keeps_the_promise(drive):
    """The compiled kernels on a GPU: the check before logits is a device-side assert (no host
    sync); a NaN injected at mono step 1, layer 2 still ends the process with exit 70, the cause
    in the marker and no token for the failed step."""
    p, head, tokens = drive("nonfinite:layer=2,step=1", steps=4, device="cuda", backend="triton", allow_jit=True)
    assert head is not None and head["state"] == "mono", (p.stdout, p.stderr[-3000:])
    assert p.returncode == EXIT_CODE, p.stderr[-3000:]
    assert [t.split()[1] for t in tokens] == ["step=0"]  # no token for step 1
    marker = json.loads((drive.failstop_dir / "failstop-rank0.json").read_text())
    (ev,) = marker["events"]
    assert (ev["step"], ev["site"], ev["layer"], ev["kernel"]) == (1, "nonfinite", 2, "k2")
    assert drive.termination_log.read_text().startswith("monodecode fail-stop: rank 0, step 1, site nonfinite")


# ---- a shared fail-stop directory: planted links are never followed (issue 29) ---------------


def test_planted_links_are_never_followed(tmp_path):
    """A symlink or a hard link named like the termination log or the writability probe must
    not let a fail-stop truncate another file: the victims keep their bytes, the marker is written."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    fsd = tmp_path / "fsd"
    fsd.mkdir()
    for pid in range(os.getpid() - 2, os.getpid() + 3):  # where a ".probe-<pid>" name once went
        (fsd / f".probe-{pid}").symlink_to(victim)
    (fsd / "termination-log").symlink_to(victim)
    rec = FailStopRecorder(fsd, exit_on_failstop=False, termination_log=fsd / "termination-log")
    rec.check_writable()
    with pytest.raises(FailStop):
        rec.fail(ev(time.time()))
    hard = tmp_path / "hard-log"
    os.link(victim, hard)
    rec = FailStopRecorder(fsd, exit_on_failstop=False, termination_log=hard)
    with pytest.raises(FailStop):
        rec.fail(ev(time.time()))
    assert victim.read_text() == "precious\n"
    assert json.loads(rec.marker_path.read_text())["totals"] == {"wait_timeout": 2}
    plain = tmp_path / "plain-log"
    rec = FailStopRecorder(fsd, exit_on_failstop=False, termination_log=plain)
    with pytest.raises(FailStop):
        rec.fail(ev(time.time()))
    assert plain.read_text().startswith("monodecode fail-stop: rank 0, step 1, site wait_timeout")
