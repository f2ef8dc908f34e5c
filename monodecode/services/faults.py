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
    parts = [p.strip() for p in text.split(";")]
    if not any(parts):
        raise ConfigError(f"{ENV_VAR}: {text.strip()!r} names no fault (unset the variable for none)")
    for part in parts:
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
            raw = raw.strip()
            if not eq or not (raw.isascii() and raw.isdigit()) or len(raw) > 9:
                raise ConfigError(
                    f"{ENV_VAR}: {kind} parameter {key!r} needs a non-negative integer below 10^9, got {raw[:40]!r}"
                )
            if key in values:
                raise ConfigError(f"{ENV_VAR}: {kind} parameter {key!r} is given twice")
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


def unreachable_drills(faults: tuple[Fault, ...], num_layers: int, tp_size: int) -> list[str]:
    """Why each drill in ``faults`` can never fire on a model of ``num_layers`` layers served on
    ``tp_size`` ranks (a layer or rank that does not exist): never a silently ignored drill."""
    out = []
    for f in faults:
        if f.kind == "corrupt_artifact":
            continue
        if f.layer >= num_layers:
            out.append(f"{ENV_VAR} drill {f} names layer {f.layer}; the model has layers 0..{num_layers - 1}")
        if f.rank is not None and f.rank >= tp_size:
            out.append(f"{ENV_VAR} drill {f} names rank {f.rank}; there are ranks 0..{tp_size - 1}")
    return out
