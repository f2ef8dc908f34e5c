"""The ``monodecode-ops`` Typer application.

Each command group lives in its own module under ``monodecode_ops.commands`` and exposes
``register(app)``; they are discovered here so adding a command touches one file. User errors
(``MonodecodeError``) are printed as one ``error: ...`` line on stderr with exit code 2, never a
traceback; that holds under ``typer.testing.CliRunner`` too, because it is done in the group.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import click
import typer
from typer.core import TyperGroup

from monodecode.errors import MonodecodeError

EXIT_USER_ERROR = 2


class _OneLineErrors(TyperGroup):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MonodecodeError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            ctx.exit(130)


app = typer.Typer(
    cls=_OneLineErrors,
    name="monodecode-ops",
    help="Build, precompile, verify and inspect monodecode images, nodes and deployments.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Build, precompile, verify and inspect monodecode images, nodes and deployments."""
    # A callback keeps Typer in command-group mode even while only one command is registered.


def _register_commands() -> None:
    from monodecode_ops import commands

    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{mod.name}")
        module.register(app)


_register_commands()


def main() -> None:
    sys.exit(app())
