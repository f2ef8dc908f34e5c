"""`monodecode-ops verify` through Typer's CliRunner, plus one real process of the console script.

The tiny model is generated into a per-session cache directory (MONODECODE_CACHE_DIR)."""

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from monodecode.metrics import MonoMetrics, start_exporter
from monodecode_ops.cli import app

# small torch ops on one thread (2 shared CI cores; see conftest)
pytestmark = pytest.mark.usefixtures("torch_one_thread")

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    old = os.environ.get("MONODECODE_CACHE_DIR")
    os.environ["MONODECODE_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("MONODECODE_CACHE_DIR", None)
    else:
        os.environ["MONODECODE_CACHE_DIR"] = old


def invoke(*args, env=None):
    """verify in this process on the reference backend (the interpreted triton backend, verify's
    CPU default, runs in ``test_real_process_runs_the_triton_kernels_interpreted``: selecting the
    interpreter is process-wide)."""
    if "--backend" not in args:
        args = (*args, "--backend", "reference")
    return CliRunner().invoke(app, ["verify", *args], env=env, catch_exceptions=False)


def checks_of(result):
    doc = json.loads(result.stdout)
    return doc, {c["name"]: c for c in doc["checks"]}


def test_cpu_self_test_passes_with_fallback_accounting():
    r = invoke("--json", "--widths", "1,2,4")
    assert r.exit_code == 0, r.output
    doc, c = checks_of(r)
    assert doc["verdict"] == "pass" and doc["platform"]["kind"] == "cpu"
    assert c["gpu"]["status"] == "skip" and "GPU checks skipped" in c["gpu"]["detail"]
    assert c["backend reference"]["status"] == "pass"
    assert c["warm-up golden check"]["status"] == "pass" and "widths 1,2,4" in c["warm-up golden check"]["detail"]
    assert c["decode vs reference"]["status"] == "pass"
    acc = c["fallback accounting"]
    assert acc["status"] == "pass" and acc["data"]["counted"]["rows_exceed_width"] >= 1
    assert acc["data"]["counted"]["prefill"] >= 1 and acc["data"]["counted"]["mono"] >= 4
    assert doc["metrics_url"].startswith("http://127.0.0.1:")
    assert {s["expected_reason"] for s in doc["steps"]} >= {
        None,
        "prefill",
        "mixed_batch",
        "rows_exceed_width",
        "graph_mode",
    }


def test_human_table():
    r = invoke("--widths", "1,2")
    assert r.exit_code == 0, r.output
    assert "metrics served at http://127.0.0.1:" in r.stdout
    assert "fallback accounting" in r.stdout and "verdict: PASS" in r.stdout


def test_require_gpu_fails_on_cpu():
    r = invoke("--json", "--require-gpu", "--no-self-test")
    assert r.exit_code == 1
    doc, c = checks_of(r)
    assert doc["verdict"] == "fail" and c["gpu"]["status"] == "fail" and "--require-gpu" in c["gpu"]["detail"]


def test_unavailable_backend_is_a_failed_check_not_a_crash():
    r = invoke("--json", "--backend", "flydsl", "--widths", "1")
    assert r.exit_code == 1
    _, c = checks_of(r)
    assert c["refusal rules"]["status"] == "fail" and "backend_unavailable" in c["refusal rules"]["detail"]


def test_stall_drill_fail_stops_without_a_token(tmp_path):
    r = invoke(
        "--json",
        "--widths",
        "1,2,4,8",
        "--wait-timeout-s",
        "0.2",
        "--failstop-dir",
        str(tmp_path),
        env={"MONODECODE_FAULT": "stall:layer=1,step=1"},
    )
    assert r.exit_code == 1
    _, c = checks_of(r)
    assert c["decode"]["status"] == "fail" and "site wait_timeout, layer 1" in c["decode"]["detail"]
    assert "no token was returned" in c["decode"]["detail"]
    marker = json.loads((tmp_path / "failstop-rank0.json").read_text())
    assert marker["events"][0]["site"] == "wait_timeout" and marker["events"][0]["layer"] == 1
    assert (tmp_path / "termination-log").read_text().startswith("monodecode fail-stop: rank 0")


@pytest.fixture
def live_exporter():
    reg = CollectorRegistry()
    m = MonoMetrics(reg)
    m.set_enabled(True)
    m.count_step("mono")
    m.count_step("fallback", "prefill")
    exp = start_exporter(0, registry=reg)
    yield exp
    exp.stop()


def test_endpoint_with_series(live_exporter):
    base = f"http://127.0.0.1:{live_exporter.port}"
    r = invoke("--json", "--no-self-test", "--endpoint", base)  # /metrics is appended
    assert r.exit_code == 0, r.output
    _, c = checks_of(r)
    assert c["endpoint"]["status"] == "pass" and "enabled=1" in c["endpoint"]["detail"]
    assert c["endpoint"]["data"]["mono"] == 1 and c["endpoint"]["data"]["fallback"] == 1


class _Plain(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_endpoint_without_series_and_unreachable():
    srv = HTTPServer(("127.0.0.1", 0), _Plain)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        r = invoke("--json", "--no-self-test", "--endpoint", f"http://127.0.0.1:{srv.server_port}/metrics")
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.exit_code == 1
    _, c = checks_of(r)
    assert "lacks monodecode_enabled" in c["endpoint"]["detail"]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = invoke("--json", "--no-self-test", "--endpoint", f"http://127.0.0.1:{port}/metrics")
    assert r.exit_code == 1 and "cannot scrape" in checks_of(r)[1]["endpoint"]["detail"]


def _busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--widths", "a,b"], "'--widths': must be a comma-separated list of integers"),
        (["--widths", "4,2"], "'--widths': must be strictly ascending"),
        (["--widths", "0"], "'--widths': entries must be integers between 1 and 256"),
        (["--widths", "1,1"], "'--widths': must be strictly ascending without duplicates"),
        (["--widths", "1,\u0663"], "'--widths': must be a comma-separated list of integers"),
        (["--block-size", "99999999"], "--block-size must be between 1 and 1024"),
        (["--backend", "cuda"], "'backend' must be one of auto, flydsl, triton, triton-step, reference"),
        (["--metrics-port", "70000"], "metrics port must be an integer between 0 and 65535"),
        (["--endpoint", "ftp://host/metrics"], "--endpoint must be an http(s) URL"),
        (["--endpoint", "not a url"], "--endpoint must be an http(s) URL"),
        (["--weight-dtype", "int4"], "'int4' is not one of 'bf16', 'fp8', 'fp8_fnuz'"),
        (["--block-size", "0"], "--block-size must be between 1 and 1024"),
        (["--serve-seconds", "-1"], "--serve-seconds must be between 0 and 604800, got -1.0"),
        (["--serve-seconds", "inf"], "--serve-seconds must be between 0 and 604800, got inf"),
        (["--serve-seconds", "nan"], "--serve-seconds must be between 0 and 604800, got nan"),
        (["--wait-timeout-s", "0"], "'wait_timeout_s' must be a positive finite number"),
        (["--model", "/nonexistent/model"], "--model /nonexistent/model: not a directory"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, fragment):
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and fragment in r.stderr and r.stderr.count("\n") == 1
    assert "Traceback" not in r.output


def test_metrics_port_in_use():
    s = _busy_port()
    try:
        port = s.getsockname()[1]
        r = invoke("--metrics-port", str(port))
    finally:
        s.close()
    assert r.exit_code == 2 and r.stderr == f"error: metrics port {port} on 127.0.0.1 is already in use\n"


def test_bad_model_config_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    r = invoke("--model", str(tmp_path))
    assert r.exit_code == 2 and "unsupported model_type 'mamba'" in r.stderr and r.stderr.count("\n") == 1
    (tmp_path / "config.json").write_text("{broken")
    r = invoke("--model", str(tmp_path))
    assert r.exit_code == 2 and "is not valid JSON" in r.stderr


def test_bad_fault_env_is_one_line():
    r = invoke("--widths", "1", env={"MONODECODE_FAULT": "meltdown"})
    assert (
        r.exit_code == 2
        and r.stderr
        == "error: MONODECODE_FAULT: unknown fault 'meltdown' (known: stall, nonfinite, corrupt_artifact)\n"
    )


def test_real_process_runs_the_triton_kernels_interpreted(cache_dir):
    """The console script on a CPU node, as ``make run`` calls it: the mono backend is the Triton
    K1/K2 under Triton's interpreter, so the golden check, the mono steps and their tokens come
    from the kernel code (not the reference compared with itself), and the output says so."""
    env = {**os.environ, "MONODECODE_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1"}
    for var in ("MONODECODE_FAULT", "PROMETHEUS_MULTIPROC_DIR", "TRITON_INTERPRET"):
        env.pop(var, None)
    p = subprocess.run(
        [str(VENV_BIN / "monodecode-ops"), "verify", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    c = {x["name"]: x for x in doc["checks"]}
    assert doc["verdict"] == "pass" and doc["runner"]["state"] == "mono" and doc["runner"]["backend"] == "triton"
    assert "Triton's CPU interpreter" in c["mono backend"]["detail"]
    golden = c["warm-up golden check"]
    assert golden["status"] == "pass" and golden["detail"].startswith("triton vs reference, every layer, widths 1,2")
    assert golden["data"]["max_abs_error"] > 0  # bf16 kernel arithmetic, not the reference against itself
    assert c["decode vs reference"]["status"] == "pass"
    mono = [s for s in doc["steps"] if s["path"] == "mono"]
    assert len(mono) >= 3 and all(s["tokens_match"] for s in mono)
    assert all(x["status"] in ("pass", "skip") for x in doc["checks"])


def test_unwritable_cache_and_failstop_dirs_are_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = invoke("--widths", "1", env={"MONODECODE_CACHE_DIR": str(blocker)})
    assert (
        r.exit_code == 2
        and r.stderr.startswith("error: tiny model: cannot create a directory")
        and r.stderr.count("\n") == 1
    )
    r = invoke("--widths", "1", "--failstop-dir", str(blocker / "sub"))
    assert r.exit_code == 2 and "fail-stop directory" in r.stderr and "not writable" in r.stderr
    assert blocker.read_text() == "x"


def test_a_drill_that_can_never_fire_fails_verify():
    r = invoke("--json", "--widths", "1", env={"MONODECODE_FAULT": "stall:layer=99"})
    assert r.exit_code == 1, r.output
    _, c = checks_of(r)
    assert c["refusal rules"]["status"] == "fail"
    assert "fault_drill: MONODECODE_FAULT drill stall:layer=99,step=0 names layer 99" in c["refusal rules"]["detail"]


def _store(root: Path) -> Path:
    from monodecode.services.artifacts import ArtifactStore

    ArtifactStore(root).add(
        build_key="ab" * 32,
        backend="flydsl",
        arch="gfx942",
        dims_digest="cd" * 32,
        widths=(1, 2),
        files={"k1.hsaco": b"\x7fELF k1", "k2.hsaco": b"\x7fELF k2"},
        compiler={"name": "flydsl", "version": "0.5.0"},
    )
    return root


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda d: d / "missing", "is not a directory"),
        (lambda d: d, "has no manifest.json"),
        (lambda d: (d / "manifest.json").write_text("{") and d, "manifest.json"),
        (lambda d: _flip(_store(d)), "1 of 1 entries fail"),
    ],
    ids=["missing", "no-manifest", "bad-manifest", "flipped-byte"],
)
def test_an_artifact_dir_given_is_checked_on_any_node(tmp_path, make, fragment):
    """On a node whose backend reads no artifacts the directory must still be checked, not
    silently passed over."""
    r = invoke("--no-self-test", "--json", "--artifact-dir", str(make(tmp_path)))
    assert r.exit_code == 1, r.output
    _, checks = checks_of(r)
    assert checks["artifact dir"]["status"] == "fail" and fragment in checks["artifact dir"]["detail"]


def _flip(root: Path) -> Path:
    target = next(p for p in root.rglob("k1.hsaco"))
    data = bytearray(target.read_bytes())
    data[0] ^= 1
    target.write_bytes(bytes(data))
    return root


def test_a_sound_artifact_dir_passes(tmp_path):
    r = invoke("--no-self-test", "--json", "--artifact-dir", str(_store(tmp_path)))
    assert r.exit_code == 0, r.output
    _, checks = checks_of(r)
    assert checks["artifact dir"]["status"] == "pass" and "1 entries" in checks["artifact dir"]["detail"]


def test_verify_prints_the_width_timing_table(slow_at_two):
    """The width timing per width and context, and what the stock step was: outside vLLM the
    reference layers, named as such. Width 2 (30 ms a layer slower than the same math) loses at
    the longest context (the tiny model's 4096 positions) and is not timed at shorter ones."""
    doc, c = checks_of(invoke("--json", "--backend", slow_at_two, "--widths", "1,2"))
    timing = c["width timing"]
    head, *rows = timing["detail"].splitlines()
    assert timing["status"] == "pass" and timing["data"]["stock"] == "reference", timing
    assert head.startswith("stock step reference (") and head.endswith("s); stock / mono time by context:"), head
    assert rows[0].startswith("width 1: ") and rows[1].startswith("width 2: 4095: 0."), rows
    assert list(timing["data"]["speedup"]["2"]) == ["4095"], timing
    # width 1 runs the reference's own math (a ratio near 1): timed at the longest context first,
    # then at shorter ones until it loses one (on a loaded machine it may lose any of them)
    w1 = sorted(int(c) for c in timing["data"]["speedup"]["1"])
    assert w1[-1] == 4095 and 1 <= len(w1) <= 3, timing
