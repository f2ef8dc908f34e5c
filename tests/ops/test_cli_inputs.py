"""Inputs issue 29 found slipping through the CLI: each is one ``error:`` line (exit 2) before any
work, and SIGTERM cleans up like Ctrl-C. About 6 s."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from cli_helpers import CLI, ROOT
from hostile_http import Answer, HostileServer
from typer.testing import CliRunner

from monodecode_ops.cli import app


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output[-2000:])
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["precompile", "--arch", "gfx942", "--profile", "tiny", "--out", ""], "'--out': must name a path, got ''"),
        (["precompile", "--arch", "gfx942", "--model", " ", "--out", "x"], "'--model': must name a path, got ''"),
        (["verify", "--no-self-test", "--image", ""], "--image must name an image, got ''"),
        (["verify", "--no-self-test", "--failstop-dir", ""], "'--failstop-dir': must name a path, got ''"),
        (["verify", "--no-self-test", "--artifact-dir", ""], "'--artifact-dir': must name a path, got ''"),
        (
            ["verify", "--no-self-test", "--wait-timeout-s", "1e308"],
            "--wait-timeout-s must be at most 3600 s, got 1e+308",
        ),
        (["bench", "--endpoint", "http://127.0.0.1:1", "--out", ""], "'--out': must name a path, got ''"),
    ],
)
def test_empty_and_huge_values_are_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)  # where an empty --out used to write
    line = one_error_line(CliRunner().invoke(app, args))
    assert message in line, line
    assert not list(tmp_path.iterdir())


def test_sigterm_removes_verify_temporary_directory(tmp_path):
    """verify's fail-stop temp dir is removed when the command is terminated mid-run."""
    server = HostileServer()
    server.script = {"/metrics": Answer(pieces=(b"# partial",), framing="short_length", hang=True)}
    try:
        proc = subprocess.Popen(
            [CLI, "verify", "--no-self-test", "--endpoint", server.url + "/metrics"],
            cwd=ROOT,
            env={**os.environ, "TMPDIR": str(tmp_path)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("monodecode-verify-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(tmp_path.glob("monodecode-verify-*")), "verify never made its temporary directory"
        time.sleep(1.0)  # into the scrape the server never answers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        server.close()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1] == "error: terminated" and "Traceback" not in err
    assert not list(tmp_path.glob("monodecode-verify-*"))


def test_verify_refuses_an_artifact_dir_with_a_symlinked_subdirectory(tmp_path):
    """issue 29: verify passed with a file from outside the store behind a symlinked subdirectory."""
    import json

    from monodecode.services.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "art")
    files = {"k1.hsaco": b"k1", "sub/k2.hsaco": b"k2"}
    store.add(
        build_key="a" * 64,
        backend="flydsl",
        arch="gfx942",
        dims_digest="d" * 64,
        widths=(1,),
        files=files,
        compiler={"name": "flydsl", "version": "0"},
    )
    r = CliRunner().invoke(app, ["verify", "--json", "--no-self-test", "--artifact-dir", str(tmp_path / "art")])
    assert r.exit_code == 0, r.output
    (tmp_path / "art" / "sub").rename(tmp_path / "elsewhere")
    (tmp_path / "art" / "sub").symlink_to(tmp_path / "elsewhere")
    r = CliRunner().invoke(app, ["verify", "--json", "--no-self-test", "--artifact-dir", str(tmp_path / "art")])
    check = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "artifact dir")
    assert r.exit_code == 1 and check["status"] == "fail" and "goes through the symbolic link" in check["detail"]
