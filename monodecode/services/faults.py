"""Fault injection for tests and node drills: ``MONODECODE_FAULT``.

Grammar: one or more faults separated by ``;``, each ``kind[:key=value[,key=value]]``:

- ``stall[:layer=L][,step=S][,rank=R]`` - at the S-th mono decode step after warm-up (0-based,
  default 0), layer L's K1 never publishes its result (default layer 0); the K2 wait for it is
  bounded, so it expires after ``wait_timeout_s``, sets the health word (site ``wait_timeout``)
  and the step fail-stops before logits.
- ``nonfinite[:layer=L][,step=S][,rank=R]`` - layer L's output at step S gets a NaN; the backend's
  finiteness check sets the health word (site ``nonfinite``) and the step fail-stops.
- ``corrupt_artifact`` - artifact files read at startup are checked as if one byte on disk had
  flipped: the checksum no longer matches, so the runner refuses (``artifact_checksum``) and
  never loads the file. Nothing on disk is changed.

``rank`` limits a fault to one TP rank (default: every rank). A malformed value is a
``ConfigError`` at startup, never a silently ignored drill.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from monodecode.errors import ConfigError

ENV_VAR = "MONODECODE_FAULT"
KINDS = ("stall", "nonfinite", "corrupt_artifact")
_KEYS = {"stall": ("layer", "step", "rank"), "nonfinite": ("layer", "step", "rank"), "corrupt_artifact": ()}


@dataclass(frozen=True)
class Fault:
    kind: str
    layer: int = 0
    step: int = 0
    rank: int | None = None

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def __str__(self) -> str:
        if self.kind == "corrupt_artifact":
            return self.kind
        s = f"{self.kind}:layer={self.layer},step={self.step}"
        return s + (f",rank={self.rank}" if self.rank is not None else "")


def parse_faults(text: str | None) -> tuple[Fault, ...]:
    """Parse a ``MONODECODE_FAULT`` value; empty/None -> no faults."""
    if text is None or not text.strip():
        return ()
    faults = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        kind, _, params = part.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            raise ConfigError(f"{ENV_VAR}: unknown fault {kind!r} (known: {', '.join(KINDS)})")
        values: dict[str, int] = {}
        for item in filter(None, (p.strip() for p in params.split(","))):
            key, eq, raw = item.partition("=")
            key = key.strip()
            if key not in _KEYS[kind]:
                allowed = ", ".join(_KEYS[kind]) or "no parameters"
                raise ConfigError(f"{ENV_VAR}: fault {kind!r} has no parameter {key!r} (takes {allowed})")
            if not eq or not raw.strip().isdigit():
                raise ConfigError(
                    f"{ENV_VAR}: {kind} parameter {key!r} needs a non-negative integer, got {raw.strip()!r}"
                )
            values[key] = int(raw)
        faults.append(Fault(kind=kind, **values))
    return tuple(faults)


def faults_from_env(environ: Mapping[str, str] | None = None) -> tuple[Fault, ...]:
    env = os.environ if environ is None else environ
    return parse_faults(env.get(ENV_VAR))


def find_fault(faults: tuple[Fault, ...], kind: str) -> Fault | None:
    for f in faults:
        if f.kind == kind:
            return f
    return None
