"""``monodecode-ops build`` / ``inspect``: the plan and every bad input, each one ``error:`` line.

Argument errors are found before the Docker engine is touched (CliRunner, in-process); engine
errors go through the real CLI process: an unreachable engine (a socket path that does not
exist), a base image that is neither present nor pullable (a loopback registry that refuses),
and a build step that fails (a base without a shell).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from monodecode_ops.cli import app
from monodecode_ops.images import BASE_IMAGES

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).with_name("monodecode-ops"))
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    text = (getattr(result, "stderr", None) or result.output).strip()
    assert "Traceback" not in text
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    return lines[0]


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def process_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1500:], proc.stderr[-1500:])
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: "), proc.stderr[-1500:]
    return lines[-1]


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--arch", "gfx90a"], "unknown arch 'gfx90a' (choose gfx942, gfx950 or all)"),
        (["--arch", "gfx942,mi300"], "unknown arch 'mi300'"),
        (["--profile", "llama2-7b"], "unknown profile 'llama2-7b' (known: tiny"),
        (["--push"], "--push needs --registry"),
        (["--repository", "Not/Valid Repo"], "is not a valid image repository name"),
        (["--registry", "bad registry"], "is not a registry host[:port][/namespace]"),
        (["--tag", "-starts-with-dash"], "is not a valid tag"),
        (["--network", "host;rm"], "is not a Docker network name"),
        (["--base-image", "a b"], "is not an image reference"),
        (["--extras", "ops;flydsl"], "must be comma-separated extra names"),
        (["--pip-index-url", "ftp://mirror/simple"], "is not an http(s) URL"),
        (["--ca-bundle", "/nonexistent/ca.pem"], "cannot read it"),
        (["--source", "/"], "is not a monodecode checkout"),
    ],
)
def test_bad_build_arguments(args, expected):
    line = error_line(invoke("build", "--dry-run", *args))
    assert expected in line, line


def test_ca_bundle_must_hold_a_certificate(tmp_path):
    not_pem = tmp_path / "bundle.txt"
    not_pem.write_text("just text\n")
    assert "no PEM certificate" in error_line(invoke("build", "--dry-run", "--ca-bundle", str(not_pem)))


def test_dry_run_plan_uses_pinned_bases_per_arch():
    result = invoke(
        "build", "--dry-run", "--json", "--registry", "registry.example:5000/team", "--push", "--tag", "rc1"
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert [a["arch"] for a in plan["archs"]] == ["gfx942", "gfx950"]
    assert plan["profiles"] == ["tiny", "llama3-8b", "qwen3-8b", "gemma3-27b"]
    assert plan["push"] is True
    for a in plan["archs"]:
        assert a["base_image"] == BASE_IMAGES[a["arch"]].ref
        assert re.search(r"@sha256:[0-9a-f]{64}$", a["base_image"]), a["base_image"]
        assert a["tag"] == f"registry.example:5000/team/vllm-monodecode:rc1-{a['arch']}"
        assert a["build_args"] == {
            "BASE_IMAGE": a["base_image"],
            "GFX_ARCH": a["arch"],
            "PROFILES": "tiny,llama3-8b,qwen3-8b,gemma3-27b",
        }


def test_dry_run_table_and_base_override():
    result = invoke("build", "--dry-run", "-a", "gfx950", "--base-image", "local/base:1", "-p", "tiny")
    assert result.exit_code == 0, result.output
    assert "vllm-monodecode:0.1.0-gfx950" in result.stdout and "local/base:1" in result.stdout
    assert "gfx942" not in result.stdout
    assert "nothing is built" in result.stdout


def test_engine_unreachable_is_one_line():
    env = {"DOCKER_HOST": "unix:///nonexistent/monodecode-docker.sock"}
    line = process_error_line(cli("build", "-a", "gfx942", "-p", "tiny", env=env))
    assert line.startswith("error: cannot reach the Docker engine at unix:///nonexistent/monodecode-docker.sock")
    line = process_error_line(cli("inspect", "any/image:tag", env=env))
    assert "cannot reach the Docker engine" in line


@pytest.mark.docker
def test_missing_base_image_is_one_line():
    # 127.0.0.1:9 refuses connections: the pull fails at once, on loopback
    missing = "127.0.0.1:9/monodecode-missing:base"
    line = process_error_line(cli("build", "-a", "gfx942", "-p", "tiny", "--base-image", missing))
    assert f"base image {missing} is not in the Docker engine and pulling it failed" in line, line
    line = process_error_line(cli("build", "-a", "gfx942", "-p", "tiny", "--base-image", missing, "--no-pull"))
    assert "is not in the Docker engine (pull it first, or drop --no-pull)" in line, line


@pytest.mark.docker
def test_inspect_missing_image_is_one_line():
    line = process_error_line(cli("inspect", "monodecode-test/img:no-such-tag"))
    assert "image monodecode-test/img:no-such-tag is not in the Docker engine" in line


@pytest.mark.docker
def test_build_step_failure_names_the_step():
    from monodecode_ops.images import connect

    client = connect()
    base = f"monodecode-test/no-shell:{os.getpid()}"
    client.images.build(fileobj=io.BytesIO(b"FROM scratch\nLABEL purpose=no-shell\n"), tag=base, rm=True)
    try:
        line = process_error_line(
            cli(
                "build",
                "-a",
                "gfx942",
                "-p",
                "tiny",
                "--base-image",
                base,
                "--repository",
                "monodecode-test/img",
                "--tag",
                f"no-shell-{os.getpid()}",
            )
        )
        assert re.match(
            r"error: build for gfx942 failed at step \d+/\d+ \(RUN sh /src/images/build/resolve-wheels.sh\)", line
        ), line
    finally:
        client.images.remove(base, force=True)
        client.images.prune(filters={"dangling": True})
