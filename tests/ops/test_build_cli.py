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

import pytest
from cli_helpers import cli, process_error_line
from typer.testing import CliRunner

from monodecode_ops.base_vllm import vllm_problem
from monodecode_ops.bases import BASE_IMAGES, RECORDED_DIGESTS
from monodecode_ops.cli import app

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


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--arch", "gfx90a"], "'gfx90a' is not one of 'gfx942', 'gfx950', 'all'"),
        (["--profile", "llama2-7b"], "'llama2-7b' is not one of 'tiny'"),
        (["--push"], "--push needs --registry"),
        (["--repository", "Not/Valid Repo"], "is not a valid image repository name"),
        (["--registry", "bad registry"], "is not a registry host[:port][/namespace]"),
        (["--tag", "-starts-with-dash"], "is not a valid tag"),
        (["--network", "host;rm"], "'host;rm' is not one of 'host', 'none', 'default', 'bridge'"),
        (["--network", "bogus"], "'bogus' is not one of 'host', 'none', 'default', 'bridge'"),
        (["--base-image", "a b"], "is not an image reference"),
        (["--base-image", "::"], "'::' is not an image reference"),
        (["--base-image", "Repo/Upper:1"], "is not an image reference"),
        (["--base-image", "r/x@sha256:abc"], "is not an image reference"),
        (["--local-base"], "--local-base needs --base-image"),
        (["--extras", "ops;flydsl"], "must be comma-separated extra names"),
        (["--pip-index-url", "ftp://mirror/simple"], "is not an http(s) URL"),
        (
            ["--pip-index-url", "ftp://user:s3cr3t@mirror/simple"],
            "'ftp://user:***@mirror/simple' is not an http(s) URL",
        ),
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


PINNED = "registry.example:5000/team/base:1@sha256:" + "e" * 64
NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent/monodecode-docker.sock"}


def test_dry_run_plan_with_a_pinned_base():
    result = invoke(
        "build",
        "--dry-run",
        "--json",
        "--base-image",
        PINNED,
        "--registry",
        "registry.example:5000/team",
        "--push",
        "--tag",
        "rc1",
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert [a["arch"] for a in plan["archs"]] == ["gfx942", "gfx950"]
    assert plan["profiles"] == ["tiny", "llama3-8b", "qwen3-8b", "gemma3-27b"]
    assert plan["push"] is True
    for a in plan["archs"]:
        assert a["base"] == {"ref": PINNED, "use": PINNED, "digest": "sha256:" + "e" * 64, "how": "reference"}
        assert a["tag"] == f"registry.example:5000/team/vllm-monodecode:rc1-{a['arch']}"
        assert a["build_args"] == {
            "BASE_IMAGE": PINNED,
            "GFX_ARCH": a["arch"],
            "PROFILES": "tiny,llama3-8b,qwen3-8b,gemma3-27b",
        }


def test_global_json_before_the_command():
    result = invoke("--json", "build", "--dry-run", "--base-image", PINNED, "-p", "tiny", "-a", "gfx950")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["archs"][0]["arch"] == "gfx950"


def test_dry_run_table_and_base_override():
    args = ["build", "--dry-run", "-a", "gfx950", "--base-image", PINNED, "-p", "tiny"]
    result = runner.invoke(app, args, env={"COLUMNS": "300"})  # one table row per line
    assert result.exit_code == 0, result.output
    assert "vllm-monodecode:0.1.0-gfx950" in result.stdout and PINNED in result.stdout
    assert "gfx942" not in result.stdout
    assert "nothing is built" in result.stdout


@pytest.mark.parametrize("as_json", [False, True])
def test_pip_index_credentials_are_never_printed(as_json):
    url = "https://builder:s3cr3t-token@pypi.example/simple"
    args = ["build", "--dry-run", "--base-image", PINNED, "-p", "tiny", "--pip-index-url", url]
    result = runner.invoke(app, [*args, *(["--json"] if as_json else [])], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "s3cr3t" not in result.output
    assert "https://builder:***@pypi.example/simple" in result.stdout


def test_unpinned_base_is_refused_without_its_digest():
    """A tag without a digest is pinned through its registry (engine needed) or refused: the dry
    run checks that too, and the defaults (no digest on record for their vLLM) are no exception."""
    for args in (["--base-image", "ubuntu:latest"], []):
        proc = cli("build", "--dry-run", "-a", "gfx942", "-p", "tiny", *args, env=NO_ENGINE)
        line = process_error_line(proc)
        base = "ubuntu:latest" if args else BASE_IMAGES["gfx942"].ref
        assert line.startswith(f"error: base image {base} has no digest; pinning it needs the Docker engine"), line


def test_default_bases_are_real_references():
    for arch, base in BASE_IMAGES.items():
        assert base.arch == arch and base.ref.startswith("vllm/vllm-openai-rocm:v")
        # never an invented digest: pinned only where a public record has one
        assert base.digest is None or RECORDED_DIGESTS.get(base.ref.split("@")[0]) == base.digest
        # the default's vLLM is one the plugin supports; the recorded v0.31.0 is not
        assert base.ref.endswith(f":v{base.vllm_version}") and vllm_problem(base.vllm_version) is None
    assert vllm_problem("0.31.0") is not None


def test_engine_unreachable_is_one_line():
    env = NO_ENGINE
    line = process_error_line(cli("build", "-a", "gfx942", "-p", "tiny", "--base-image", PINNED, env=env))
    assert line.startswith("error: cannot reach the Docker engine at unix:///nonexistent/monodecode-docker.sock")
    line = process_error_line(cli("inspect", "any/image:tag", env=env))
    assert "cannot reach the Docker engine" in line


@pytest.mark.docker
def test_missing_base_image_is_one_line():
    # 127.0.0.1:9 refuses connections: the pull fails at once, on loopback
    missing = "127.0.0.1:9/monodecode-missing:base@sha256:" + "e" * 64
    line = process_error_line(cli("build", "-a", "gfx942", "-p", "tiny", "--base-image", missing))
    assert f"base image {missing} is not in the Docker engine and pulling it failed" in line, line
    line = process_error_line(cli("build", "-a", "gfx942", "-p", "tiny", "--base-image", missing, "--no-pull"))
    assert "is not in the Docker engine (pull it first, or drop --no-pull)" in line, line
    # without a digest the registry must pin it first; this one refuses the connection
    tag_only = missing.split("@")[0]
    line = process_error_line(cli("build", "--dry-run", "-a", "gfx942", "-p", "tiny", "--base-image", tag_only))
    assert line.startswith(f"error: base image {tag_only} has no digest and cannot be pinned: the registry"), line


@pytest.mark.docker
def test_inspect_missing_image_is_one_line():
    line = process_error_line(cli("inspect", "monodecode-test/img:no-such-tag"))
    assert "image monodecode-test/img:no-such-tag is not in the Docker engine" in line


@pytest.mark.docker
def test_build_step_failure_names_the_step():
    from monodecode_ops.engine import connect

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
                "--local-base",
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
