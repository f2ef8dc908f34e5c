"""Shared output helpers for every ``monodecode-ops`` command: rich tables for people,
``--json`` for machines, and the ``Check`` record that verify-style commands report.

Machine output goes to stdout as one JSON document and nothing else (so ``| jq`` works);
human output is a rich table. Errors are not printed here: commands raise ``MonodecodeError``
and the CLI group prints one ``error: ...`` line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

PASS, FAIL, SKIP = "pass", "fail", "skip"
STATUSES = (PASS, FAIL, SKIP)
_STYLE = {PASS: "green", FAIL: "bold red", SKIP: "yellow"}


@dataclass
class Check:
    """One verified fact: ``status`` pass/fail/skip, ``detail`` says why (always, also on pass).

    ``required=False`` checks are reported but never fail the command. ``data`` carries the
    measured values for ``--json`` (numbers, paths), never needed to read the table.
    """

    name: str
    status: str
    detail: str = ""
    required: bool = True
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status must be one of {STATUSES}, got {self.status!r}")

    @property
    def failed(self) -> bool:
        return self.status == FAIL and self.required

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def passed(cls, name: str, detail: str = "", **kw: Any) -> Check:
        return cls(name, PASS, detail, **kw)

    @classmethod
    def failure(cls, name: str, detail: str, **kw: Any) -> Check:
        return cls(name, FAIL, detail, **kw)

    @classmethod
    def skipped(cls, name: str, detail: str, **kw: Any) -> Check:
        return cls(name, SKIP, detail, **kw)


def console(stderr: bool = False) -> Console:
    # soft_wrap keeps long paths and reasons intact when output is piped; markup off: what is
    # printed often came from outside (URLs, model names, paths), and "[v2]" or "[/]" in it is
    # text, never style. Styles are given as rich Text objects instead.
    return Console(stderr=stderr, soft_wrap=False, highlight=False, markup=False)


def emit_json(obj: Any, stream: Any = None) -> None:
    """Write ``obj`` as one JSON document on stdout (dataclasses with to_dict are expanded)."""
    out = stream or sys.stdout
    out.write(json.dumps(_jsonable(obj), indent=2, sort_keys=False, default=str) + "\n")
    out.flush()


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return _jsonable(obj.to_dict())
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left", show_lines=False)
    for col in columns:
        t.add_column(col, overflow="fold")
    for row in rows:
        t.add_row(*("" if v is None else str(v) for v in row))
    return t


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    console().print(table(title, columns, rows))


def checks_table(checks: Sequence[Check], title: str = "checks") -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("check")
    t.add_column("result")
    t.add_column("why", overflow="fold")
    for c in checks:
        label = c.status.upper() + ("" if c.required or c.status != FAIL else " (optional)")
        t.add_row(c.name, Text(label, style=_STYLE[c.status]), c.detail)
    return t


def verdict(checks: Sequence[Check]) -> str:
    return FAIL if any(c.failed for c in checks) else PASS


def checks_exit_code(checks: Sequence[Check]) -> int:
    """0 when no required check failed, else 1 (2 is reserved for user errors)."""
    return 1 if any(c.failed for c in checks) else 0


def report_checks(
    checks: Sequence[Check],
    *,
    as_json: bool,
    title: str = "checks",
    extra: dict[str, Any] | None = None,
) -> int:
    """Print ``checks`` (table or JSON with ``extra`` fields) and return the exit code."""
    code = checks_exit_code(checks)
    if as_json:
        emit_json({"verdict": verdict(checks), **(extra or {}), "checks": [c.to_dict() for c in checks]})
    else:
        con = console()
        con.print(checks_table(checks, title))
        counts = {s: sum(1 for c in checks if c.status == s) for s in STATUSES}
        v = verdict(checks)
        con.print(
            Text.assemble(
                "verdict: ",
                (v.upper(), _STYLE[v]),
                f"  ({counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped)",
            )
        )
    return code


# Set by the CLI group for the invocation in progress (``--json`` before or after the command).
_json_requested = False


def set_json_output(value: bool) -> None:
    global _json_requested
    _json_requested = bool(value)


def json_output() -> bool:
    """Whether this invocation asked for ``--json`` (one JSON document on stdout)."""
    return _json_requested
