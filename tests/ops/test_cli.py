"""What the ``monodecode-ops`` group does for every command: help renders, a bad argument is one
``error:`` line (never a framed box or a traceback), ``--json`` is one option accepted before the
command or among its options."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from monodecode_ops.cli import app

runner = CliRunner()
COMMANDS = ("build", "precompile", "verify", "inspect", "bench")


@pytest.mark.parametrize("command", ("", *COMMANDS))
def test_help_of_every_command_renders(command):
    result = runner.invoke(app, [*([command] if command else []), "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, (result.output, result.exception)
    assert "Usage:" in result.stdout
    if command:
        assert "--json" in result.stdout  # the one global option, on every command's help


def test_build_help_shows_brackets_as_text():
    result = runner.invoke(app, ["build", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, (result.output, result.exception)
    assert "host[:port][/namespace]" in result.stdout


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["verify", "--block-size", "abc"], "--block-size"),
        (["verify", "--no-such-option"], "No such option: --no-such-option"),
        (["no-such-command"], "No such command 'no-such-command'"),
        (
            ["precompile", "--arch", "gfx90a", "--profile", "tiny", "--out", "x"],
            "'gfx90a' is not one of 'gfx942', 'gfx950'",
        ),
        (
            ["precompile", "--arch", "gfx942", "--profile", "tiny", "--out", "x", "--widths", "1,1"],
            "strictly ascending",
        ),
        (
            ["precompile", "--arch", "gfx942", "--profile", "tiny", "--out", "x", "--block-size", "99999999"],
            "--block-size",
        ),
        (["precompile", "--arch", "gfx942", "--profile", "tiny", "--out", "x", "--widths", "1,,2"], "comma-separated"),
        (
            ["precompile", "--arch", "gfx942", "--profile", "tiny", "--out", "x", "--widths", "\u0663"],
            "comma-separated",
        ),
        (["build", "--dry-run", "-p", "nope"], "'nope' is not one of"),
    ],
)
def test_bad_arguments_are_one_error_line(args, fragment):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert result.stdout == ""
