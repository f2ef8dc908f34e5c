"""``make serve``'s launcher (scripts/serve_cpu.py) checks everything before it makes or deletes
anything: a second start on a busy port, or with a bad ``--mono-config``, leaves a running server's
metrics alone (issue 29: it deleted their ``*.db`` files first). Under 2 s."""

from __future__ import annotations

import importlib.util
import socket

import pytest
from cli_helpers import ROOT


@pytest.fixture(scope="module")
def serve_cpu():
    spec = importlib.util.spec_from_file_location("serve_cpu", ROOT / "scripts" / "serve_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def running_server_metrics(tmp_path, monkeypatch):
    """What a running server keeps in PROMETHEUS_MULTIPROC_DIR (its own fresh subdirectory)."""
    given = tmp_path / "multiproc"
    theirs = given / "prometheus-8000-abc"
    theirs.mkdir(parents=True)
    (theirs / "counter_123.db").write_bytes(b"series")
    (given / "gauge_all_9.db").write_bytes(b"series")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(given))
    monkeypatch.setenv("MONODECODE_CACHE_DIR", str(tmp_path / "cache"))
    return given


def _untouched(given) -> bool:
    return sorted(p.relative_to(given).as_posix() for p in given.rglob("*")) == [
        "gauge_all_9.db",
        "prometheus-8000-abc",
        "prometheus-8000-abc/counter_123.db",
    ]


def test_a_busy_port_is_one_line_and_changes_nothing(serve_cpu, running_server_metrics, capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert serve_cpu.main(["--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use (is a server running there?)"]
    assert _untouched(running_server_metrics)


@pytest.mark.parametrize(
    "mono_config, message",
    [
        ("[" * 100_000, "error: --mono-config is nested too deeply"),
        ('{"widths": [1, 1e999]}', "error: --mono-config holds 1e999, not a finite number"),
        ("[1]", "error: --mono-config: must be a JSON object, got list"),
        ('{"backend": "cuda"}', "'backend' must be one of"),
    ],
)
def test_a_bad_mono_config_is_one_line_and_changes_nothing(
    serve_cpu, running_server_metrics, capsys, mono_config, message
):
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]
    assert serve_cpu.main(["--port", str(port), "--mono-config", mono_config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert _untouched(running_server_metrics)


def test_every_start_gets_a_fresh_metrics_dir(serve_cpu, running_server_metrics):
    a, b = serve_cpu.fresh_prometheus_dir(8000), serve_cpu.fresh_prometheus_dir(8000)
    assert a != b and a.parent == b.parent == running_server_metrics
    assert not list(a.iterdir()) and not list(b.iterdir())
    a.rmdir(), b.rmdir()
    assert _untouched(running_server_metrics)
