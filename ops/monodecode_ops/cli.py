"""The ``monodecode-ops`` Typer application.

Each command group lives in its own module under ``monodecode_ops.commands`` and exposes
``register(app)``; they are discovered here so adding a command touches one file.

Handled once, here, for every command:

- errors: a user error (``MonodecodeError``) or a bad argument is one ``error: ...`` line on
  stderr with exit code 2, never a traceback or a framed box; under ``typer.testing.CliRunner``
  too, because it is done in the group;
- SIGTERM (the console script): unwinds like Ctrl-C, cleans up, ``error: terminated``, exit 143;
- ``--json``: one option, accepted before the command (``monodecode-ops --json inspect X``) or
  among its options (``monodecode-ops inspect X --json``); commands ask ``output.json_output()``;
- help text is plain text (no rich markup), so ``host[/namespace]`` in a help string is text.
"""

from __future__ import annotations

import copy
import importlib
import pkgutil
import signal
import sys
from typing import Any

import click
import typer
from typer.core import TyperGroup

from monodecode.errors import MonodecodeError
from monodecode_ops.output import set_json_output

EXIT_USER_ERROR = 2
JSON_HELP = "Print one JSON document on stdout instead of tables."

# Typer may vendor its own click; its exception base is the one BadParameter derives from.
_CLICK_EXCEPTION = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _one_line(text: str, limit: int = 2000) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Terminated(BaseException):
    """SIGTERM arrived. Raised like Ctrl-C's KeyboardInterrupt, so ``finally`` blocks run
    (temporary directories, the metrics server) instead of the process vanishing mid-command."""


def _raise_terminated(_signum: int, _frame: Any) -> None:
    raise Terminated()


def _remember_json(_ctx: Any, _param: Any, value: bool) -> None:
    if value:
        set_json_output(True)


class _OneLineErrors(TyperGroup):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The root's --json, copied onto every command: one definition, one place that reads it.
        root_json = next(p for p in self.params if "--json" in p.opts)
        for command in self.commands.values():
            if not any("--json" in p.opts for p in command.params):
                option = copy.copy(root_json)
                option.expose_value, option.callback = False, _remember_json
                command.params.append(option)

    def invoke(self, ctx: Any):
        try:
            return super().invoke(ctx)
        except MonodecodeError as e:
            click.echo(f"error: {_one_line(e)}", err=True)
            ctx.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            ctx.exit(130)
        except Terminated:
            click.echo("error: terminated", err=True)
            ctx.exit(128 + signal.SIGTERM)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra: Any) -> Any:
        set_json_output(False)  # a fresh invocation (CliRunner reuses the process)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except _CLICK_EXCEPTION as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `monodecode-ops`: the help, as click shows it
                e.show()
            else:
                click.echo(f"error: {_one_line(e.format_message())}", err=True)
            code = e.exit_code
        except typer.Abort:
            click.echo("error: aborted", err=True)
            code = 1
        if not standalone_mode:
            return code
        sys.exit(code)


app = typer.Typer(
    cls=_OneLineErrors,
    name="monodecode-ops",
    help="Build, precompile, verify and inspect monodecode images, nodes and deployments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help=JSON_HELP)) -> None:
    """Build, precompile, verify and inspect monodecode images, nodes and deployments."""
    _remember_json(ctx, None, as_json)


def _register_commands() -> None:
    from monodecode_ops import commands

    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{mod.name}")
        module.register(app)


_register_commands()


def main() -> None:
    signal.signal(signal.SIGTERM, _raise_terminated)  # the console script only (not under CliRunner)
    sys.exit(app())
