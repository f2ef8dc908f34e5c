"""Option types every ``monodecode-ops`` command shares: one spelling, one parser, one help text.

Choices are Enums derived from the runtime's own lists (the AMD archs monodecode builds for, the
kernel plan's weight dtypes, the model profiles), so a new arch or profile reaches every command
at once; comma-separated profile lists are checked against the same profiles. ``--widths`` and
``--block-size`` go through the runtime's rules (``config.parse_widths``,
``config.check_block_size``: what ``MonoConfig`` and ``verify`` apply). A bad value is one
``error:`` line (the CLI group prints usage and user errors that way).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from monodecode import config
from monodecode.errors import MonodecodeError
from monodecode.model.profiles import PROFILES, profile_config
from monodecode.model.weights import WEIGHT_DTYPES
from monodecode_ops.labels import ARCHS

Arch = Enum("Arch", {a: a for a in ARCHS}, type=str, module=__name__)
Arch.__doc__ = "A GPU arch monodecode builds kernels for."
BuildArch = Enum("BuildArch", {**{a: a for a in ARCHS}, "all": "all"}, type=str, module=__name__)
BuildArch.__doc__ = "An arch to build an image for, or all of them."
WeightDtype = Enum("WeightDtype", {d: d for d in WEIGHT_DTYPES}, type=str, module=__name__)
WeightDtype.__doc__ = "How the weights are stored: bf16, or FP8 (fp8 = OCP e4m3fn, fp8_fnuz = e4m3fnuz)."
Profile = Enum("Profile", {p: p for p in PROFILES}, type=str, module=__name__)
Profile.__doc__ = "A named model profile (its dims; no weights needed)."


class Network(str, Enum):
    """Docker network modes a build's RUN steps may use (no bridge is needed for host or none)."""

    host = "host"
    none = "none"
    default = "default"
    bridge = "bridge"


class Widths(tuple):
    """Step widths, ascending without duplicates (what ``--widths 1,2,4,8`` parses to)."""


def parse_widths(text: str) -> Widths:
    """``--widths`` text -> ``Widths`` by the runtime's rule (``config.parse_widths``)."""
    try:
        return Widths(config.parse_widths(text, "--widths"))
    except MonodecodeError as e:  # click names the option itself
        raise typer.BadParameter(str(e).removeprefix("--widths").lstrip(": ")) from None


class ProfileNames(tuple):
    """Model profile names, known to ``monodecode.model.profiles`` (what ``--profile a,b`` parses to)."""


def parse_profile_names(text: str) -> ProfileNames:
    """Comma-separated profile names -> ``ProfileNames``; empty text is none."""
    names = ProfileNames(x.strip() for x in text.split(",") if x.strip())
    try:
        for name in names:
            profile_config(name)  # the runtime's check: names the unknown profile and the known ones
    except MonodecodeError as e:
        raise typer.BadParameter(str(e)) from None
    return names


def parse_path(text: str | Path) -> Path:
    """A path option's text as a ``Path``; empty text is refused (``Path("")`` would silently be
    the current directory)."""
    if isinstance(text, Path):
        return text
    if not text.strip():
        raise typer.BadParameter("must name a path, got ''")
    if "\0" in text:
        raise typer.BadParameter("must not contain NUL bytes")
    return Path(text)


def path_option(flag: str, help: str, default: Any = None) -> Any:
    """A ``--flag PATH`` option parsed by ``parse_path`` (as a parameter's default, not in Annotated)."""
    return typer.Option(default, flag, parser=parse_path, metavar="PATH", help=help)


def _block_size(value: int) -> int:
    return config.check_block_size(value, "--block-size")


ArchOpt = Annotated[
    Arch, typer.Option("--arch", "-a", help="GPU arch: gfx942 (MI300X/MI325X) or gfx950 (MI350X/MI355X).")
]
BuildArchsOpt = Annotated[list[BuildArch], typer.Option("--arch", "-a", help="gfx942, gfx950 or all (repeatable).")]
ProfileOpt = Annotated[Optional[Profile], typer.Option("--profile", "-p", help="Named model profile.")]
ProfilesOpt = Annotated[
    list[Profile], typer.Option("--profile", "-p", help="Model profile to precompile kernels for (repeatable).")
]
ProfileNamesOpt = Annotated[
    ProfileNames,
    typer.Option("--profile", parser=parse_profile_names, metavar="P[,P...]", help="Model profiles (comma-separated)."),
]
WeightDtypeOpt = Annotated[WeightDtype, typer.Option("--weight-dtype", help="bf16, or fp8 / fp8_fnuz (FP8 weights).")]
WidthsOpt = Annotated[
    Optional[Widths],
    typer.Option("--widths", parser=parse_widths, metavar="W[,W...]", help="Step widths, ascending, e.g. 1,2,4,8."),
]
BlockSizeOpt = Annotated[
    int,
    typer.Option("--block-size", callback=_block_size, help=f"Paged-KV block size (1..{config.MAX_BLOCK_SIZE})."),
]
ModelDirOpt = Annotated[
    Optional[Path],
    typer.Option("--model", parser=parse_path, metavar="PATH", help="Model directory with a Hugging Face config.json."),
]
NetworkOpt = Annotated[Network, typer.Option("--network", help="Network for RUN steps (host works without a bridge).")]
