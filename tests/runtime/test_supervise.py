"""The serve supervisor: a fail-stop recorded during the run turns the server's exit into 70."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from monodecode.runtime.failstop import EXIT_CODE, FailStopEvent, FailStopRecorder
from monodecode.runtime.supervise import recorded_failstops

REPO = Path(__file__).resolve().parents[2]


def _child(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def _supervise(cmd: list[str], failstop_dir: Path, **kw) -> subprocess.Popen:
    """The supervisor in its own process, as a container's main process would be."""
    code = (
        "import json, sys; from monodecode.runtime.supervise import run_supervised; "
        "sys.exit(run_supervised(json.loads(sys.argv[1]), dict(__import__('os').environ), sys.argv[2]))"
    )
    import json

    return subprocess.Popen([sys.executable, "-c", code, json.dumps(cmd), str(failstop_dir)], cwd=REPO, **kw)


def _record(failstop_dir: Path, rank: int, step: int) -> None:
    event = FailStopEvent(rank=rank, step=step, site="wait_timeout", layer=1, kernel="k2", time=time.time(), pid=1)
    FailStopRecorder(
        failstop_dir, rank=rank, termination_log=failstop_dir / "tl", exit_on_failstop=False
    )._write_marker(event)


def test_worker_failstop_during_the_run_exits_70_although_the_server_exits_0(tmp_path):
    # the child records a fail-stop (as a worker does) and exits 0 (as vLLM's API server does)
    child = _child(f"""
        import time
        from monodecode.runtime.failstop import FailStopEvent, FailStopRecorder
        e = FailStopEvent(rank=0, step=7, site="nonfinite", layer=2, kernel="k2", time=time.time(), pid=42)
        FailStopRecorder({str(tmp_path)!r}, termination_log={str(tmp_path / "tl")!r}, exit_on_failstop=False)._write_marker(e)
    """)
    proc = _supervise(child, tmp_path, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_CODE, err
    assert "1 fail-stop(s) recorded" in err and "server exited 0" in err


def test_earlier_failstops_do_not_count(tmp_path):
    _record(tmp_path, rank=0, step=3)
    _record(tmp_path, rank=1, step=4)
    assert len(recorded_failstops(tmp_path)) == 2
    proc = _supervise(_child("import sys; sys.exit(3)"), tmp_path)
    assert proc.wait(timeout=60) == 3


def test_no_marker_directory_passes_the_status_through(tmp_path):
    proc = _supervise(_child("pass"), tmp_path / "missing")
    assert proc.wait(timeout=60) == 0


def test_sigterm_reaches_the_server_and_its_status_is_returned(tmp_path):
    ready = tmp_path / "ready"
    child = _child(f"""
        import signal, sys, time, pathlib
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(17))
        pathlib.Path({str(ready)!r}).write_text("1")
        time.sleep(60)
    """)
    proc = _supervise(child, tmp_path)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, "child never started"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 17


def test_server_killed_by_a_signal_reports_128_plus_n(tmp_path):
    proc = _supervise(_child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), tmp_path)
    assert proc.wait(timeout=60) == 128 + signal.SIGKILL


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie nobody reaped has stopped too


def test_sigkill_of_the_supervisor_stops_the_server(tmp_path):
    """No handler sees SIGKILL; PR_SET_PDEATHSIG still stops the server (issue 29: make serve orphaned vLLM)."""
    pid_file = tmp_path / "pid"
    child = _child(f"""
        import os, pathlib, time
        pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
        time.sleep(60)
    """)
    proc = _supervise(child, tmp_path)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "child never started"
        time.sleep(0.05)
    server = int(pid_file.read_text())
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(server)
    if alive:
        os.kill(server, signal.SIGKILL)
    assert not alive, "the server outlived its supervisor"
