"""The endpoint commands (``bench --endpoint``, ``verify --endpoint``) against hostile servers.

Whatever a server sends (any status line, bodies that are not JSON or not Prometheus text, bad
chunking, delays, endless bodies, keep-alives, a connection held open), a command ends within its
timeout, with bounded memory, with one ``error:`` line and exit 2 (bench) or a failed check with a
one-line reason and exit 1 (verify), never a traceback. The server is ``hostile_http.HostileServer``,
its answers drawn by Hypothesis; the named cases below are the ones issue 29 reproduced.
About 40 s in all on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from cli_helpers import CLI, ROOT
from hostile_http import Answer, HostileServer, answers, sse, valid_completion, valid_metrics, valid_models
from hypothesis import HealthCheck, Phase, given, settings
from typer.testing import CliRunner

from monodecode_ops.cli import app

TIMEOUT_S = 0.5  # --timeout-s of every bench run below
BENCH_REQUESTS = 8  # what one bench run asks at most: models, metrics x5, completions x2
SLACK_S = 10.0  # overheads on 2 busy cores on top of the timeouts (a hostile server held on for 20 s before)
HYPOTHESIS = settings(
    max_examples=25,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # shrinking a slow server script takes minutes
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def server():
    srv = HostileServer()
    yield srv
    srv.close()


def bench(url: str, out: Path, *extra: str):
    args = ["bench", "--endpoint", url, "--requests", "1", "--concurrency", "1", "--max-tokens", "2"]
    return CliRunner().invoke(app, [*args, "--timeout-s", str(TIMEOUT_S), "--out", str(out), *extra])


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output[-2000:])
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output[-2000:]
    return lines[0]


# ---- Hypothesis: every answer the strategies can draw ------------------------------------------


@HYPOTHESIS
@given(models=answers("models"), metrics=answers("metrics"), completions=answers("completions"))
def test_bench_endpoint_ends_with_one_line_whatever_the_server_sends(server, tmp_path, models, metrics, completions):
    server.script = {"/v1/models": models, "/metrics": metrics, "/v1/completions": completions}
    out = tmp_path / f"out-{time.monotonic_ns()}"
    t0 = time.monotonic()
    r = bench(server.url, out)
    took = time.monotonic() - t0
    assert took < BENCH_REQUESTS * TIMEOUT_S + SLACK_S, took
    if r.exit_code == 0:  # everything drawn was well-formed enough: results were written
        assert len(list(out.glob("serving_ab_*.json"))) == 1, r.output
    else:
        one_error_line(r)
        assert not out.exists()


@HYPOTHESIS
@given(metrics=answers("metrics"))
def test_verify_endpoint_is_one_failed_check_whatever_the_server_sends(server, monkeypatch, metrics):
    from monodecode_ops.commands import verify

    monkeypatch.setattr(verify, "ENDPOINT_TIMEOUT_S", TIMEOUT_S)
    server.script = {"/metrics": metrics}
    t0 = time.monotonic()
    r = CliRunner().invoke(app, ["verify", "--json", "--no-self-test", "--endpoint", server.url + "/metrics"])
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    assert r.exit_code in (0, 1) and "Traceback" not in r.output, r.output[-2000:]
    check = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "endpoint")
    assert "\n" not in check["detail"]
    assert (check["status"] == "pass") == (r.exit_code == 0), check


# ---- the cases issue 29 reproduced ------------------------------------------------------------


def _peak_rss_mb(pid: int) -> float:
    """The process's own peak resident set so far (VmHWM: its address space since exec; wait4's
    ru_maxrss would also carry the forking pytest process's peak), 0 once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _run_measured(args: list[str], timeout: float) -> tuple[int, str, float, float]:
    """The CLI as a process: exit code, stderr, wall seconds and its own peak RSS in MB (VmHWM,
    polled every 20 ms until it exits: a run that grows without bound is seen growing)."""
    with tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen([CLI, *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL)
        peak = 0.0
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                proc.kill()
            peak = max(peak, _peak_rss_mb(proc.pid))
            time.sleep(0.02)
        err.seek(0)
        return proc.returncode, err.read().decode(), time.monotonic() - t0, peak


def test_an_endless_metrics_body_is_cut_at_the_size_cap(server, tmp_path):
    server.script = {"/v1/models": valid_models(), "/metrics": Answer(framing="close", endless=b"x" * 65536)}
    code, stderr, took, rss_mb = _run_measured(
        ["bench", "--endpoint", server.url, "--timeout-s", "5", "--out", str(tmp_path)], timeout=60
    )
    assert code == 2 and "Traceback" not in stderr, stderr[-2000:]
    assert stderr.strip().splitlines() == [
        f"error: endpoint {server.url}: cannot scrape /metrics (GET /metrics: the answer is larger than 16777216 bytes)"
    ]
    assert took < 20 and rss_mb < 800, (took, rss_mb)


def test_keepalives_do_not_stretch_the_timeout(server, tmp_path):
    keepalive = Answer(pieces=sse({"choices": [{"text": "x"}]}), framing="chunked", delay_s=0.2, endless=b": ping\n\n")
    server.script = {"/v1/models": valid_models(), "/metrics": valid_metrics(), "/v1/completions": keepalive}
    t0 = time.monotonic()
    line = one_error_line(bench(server.url, tmp_path))
    assert time.monotonic() - t0 < 2 * TIMEOUT_S + SLACK_S
    assert line.endswith(f"no complete answer within {TIMEOUT_S:g} s"), line


def test_a_held_connection_is_bounded_by_the_timeout(server, tmp_path):
    server.script = {"/v1/models": Answer(pieces=(b'{"da',), framing="short_length", hang=True)}
    t0 = time.monotonic()
    line = one_error_line(bench(server.url, tmp_path))
    assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
    assert line == f"error: endpoint {server.url}: cannot connect (no complete answer within {TIMEOUT_S:g} s)"


@pytest.mark.parametrize(
    "script, message",
    [
        (
            {"/v1/models": Answer(status=b"SSH-2.0-OpenSSH_9.6")},
            "cannot connect (the answer is not HTTP (bad status line))",
        ),
        (
            {"/v1/models": Answer(pieces=(b'{"data": [{"id": 7}]}',))},
            "/v1/models has no list of model ids: not an OpenAI-compatible server",
        ),
        (
            {"/v1/models": valid_models(), "/metrics": Answer(pieces=(b"monodecode_steps_total{path=\n",))},
            "cannot scrape /metrics (/metrics is not Prometheus text",
        ),
        (
            {
                "/v1/models": valid_models(),
                "/metrics": Answer(pieces=(b'monodecode_steps_total{path="mono"} -824\n',)),
            },
            "/metrics has monodecode_steps_total = -824.0, not a count",
        ),
        (
            {
                "/v1/models": valid_models(),
                "/metrics": valid_metrics(),
                "/v1/completions": Answer(pieces=sse([1, 2]), framing="chunked"),
            },
            "a stream chunk is a JSON list, not an object",
        ),
        (
            {
                "/v1/models": valid_models(),
                "/metrics": valid_metrics(),
                "/v1/completions": Answer(pieces=sse({"usage": {"completion_tokens": "lots"}}), framing="chunked"),
            },
            "the usage chunk's completion_tokens 'lots' is not a count in 0..2",
        ),
        (
            {
                "/v1/models": valid_models(),
                "/metrics": valid_metrics(),
                "/v1/completions": Answer(pieces=sse({"usage": {"completion_tokens": -824}}), framing="chunked"),
            },
            "the usage chunk's completion_tokens '-824' is not a count in 0..2",
        ),
    ],
)
def test_hostile_answers_are_one_line(server, tmp_path, script, message):
    server.script = script
    line = one_error_line(bench(server.url, tmp_path))
    assert line.startswith(f"error: endpoint {server.url}") and message in line, line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--endpoint", "http://127.0.0.1:abc/"], "--endpoint must be an http(s) URL such as http://127.0.0.1:8000"),
        (["--endpoint", "http://127.0.0.1:99999/"], "(Port out of range 0-65535)"),
        (["--endpoint", "http://user:secret@127.0.0.1:1/"], "'http://***@127.0.0.1:1/': credentials in the URL"),
        (["--endpoint", "http://127.0.0.1:1", "--timeout-s", "inf"], "--timeout-s must be > 0 and at most 86400"),
        (["--endpoint", "http://127.0.0.1:1", "--timeout-s", "nan"], "--timeout-s must be > 0 and at most 86400"),
        (["--endpoint", "http://127.0.0.1:1", "--requests", "1000000000"], "--requests must be in 1..10000"),
        (["--endpoint", "http://127.0.0.1:1", "--max-tokens", "1"], "--max-tokens in 2..65536"),
    ],
)
def test_bad_endpoint_arguments_are_one_line_before_any_request(tmp_path, args, message):
    r = CliRunner().invoke(app, ["bench", *args, "--out", str(tmp_path)])
    line = one_error_line(r)
    assert message in line and "secret" not in line, line


def test_verify_endpoint_url_errors_are_one_line():
    for url, message in (
        ("http://127.0.0.1:abc/metrics", "--endpoint must be an http(s) URL"),
        ("http://127.0.0.1:99999/metrics", "Port out of range"),
        ("http://u:secret@127.0.0.1:1/metrics", "credentials in the URL are not supported"),
    ):
        r = CliRunner().invoke(app, ["verify", "--no-self-test", "--endpoint", url])
        line = one_error_line(r)
        assert message in line and "secret" not in line, line


def test_outside_text_is_shown_as_text_not_markup(server, tmp_path):
    """A served model named like rich markup, and "[v2]" in the URL path, appear verbatim."""
    name = "[v2] tiny [/]"
    prefix = "/[v2]"
    server.script = {
        f"{prefix}/v1/models": valid_models(name),
        f"{prefix}/metrics": valid_metrics(),
        f"{prefix}/v1/completions": valid_completion(),
    }
    r = bench(server.url + prefix, tmp_path)
    assert r.exit_code == 0, r.output
    assert f"serving A/B of {name}" in r.output and f"A: {server.url}{prefix}" in r.output, r.output


def test_results_never_overwrite_and_out_is_checked_before_the_run(server, tmp_path):
    server.script = {"/v1/models": valid_models(), "/metrics": valid_metrics(), "/v1/completions": valid_completion()}
    for _ in range(2):
        assert bench(server.url, tmp_path).exit_code == 0
    assert len(list(tmp_path.glob("serving_ab_*.json"))) == 2 and len(list(tmp_path.glob("serving_ab_*.png"))) == 2
    assert not list(tmp_path.glob(".*"))  # no temporary files left
    blocker = tmp_path / "file"
    blocker.write_text("")
    server.script = {}  # any request would get a 404
    line = one_error_line(bench(server.url, blocker / "sub"))
    assert line == f"error: --out {blocker / 'sub'}: {blocker} exists and is not a directory"


def test_default_serving_out_is_outside_the_checkout(monkeypatch, tmp_path):
    from monodecode_ops.commands.bench import default_serving_out

    monkeypatch.setenv("MONODECODE_CACHE_DIR", str(tmp_path))
    assert default_serving_out() == tmp_path / "bench"
    monkeypatch.delenv("MONODECODE_CACHE_DIR")
    assert not default_serving_out().resolve().is_relative_to(ROOT)
