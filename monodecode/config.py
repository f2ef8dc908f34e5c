"""``MonoConfig``: every mono-decode option, validated.

Options arrive as a dict: vLLM's ``--additional-config '{"monodecode": {...}}'``, the Helm
chart's values, or a JSON string in ``MONODECODE_CONFIG``. An unknown key or a bad value is a
``ConfigError`` with one line naming the key, what was expected and what was given, so a typo
in a deployment fails at startup instead of silently running with defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from monodecode.errors import ConfigError
from monodecode.jsonio import parse_json

BACKENDS = ("auto", "flydsl", "triton", "triton-step", "reference")
ON_REFUSAL = ("raise", "degrade")
WIDTH_POLICIES = ("auto", "force")
SHADOW_ON_FAIL = ("degrade", "failstop")
# vLLM 0.33's switch for specialized decode (``decode_backend``): accepted as an alias of enabled.
DECODE_BACKEND_ALIAS = "latency_specialized"
MAX_WIDTH = 256
MAX_WAIT_TIMEOUT_S = 3600.0  # a kernel wait that may last longer than an hour is a hang, not a bound

DEFAULT_FAILSTOP_DIR = "~/.cache/monodecode/failstop"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"


@dataclass(frozen=True)
class MonoConfig:
    enabled: bool = False
    # kernel backend; auto = best available (flydsl on gfx942/gfx950, triton on GPUs, reference);
    # triton-step (one launch a step, NVIDIA sm_90+) only when named
    backend: str = "auto"
    # raise: refuse to start listing every reason; degrade: start with stock decode, export why
    on_refusal: str = "raise"
    # step widths (rows per decode step) to build; rows are padded up to the smallest fitting one
    widths: tuple[int, ...] = (1, 2, 4, 8)
    # compile at startup when no baked artifact matches the build key (off in production images)
    allow_jit: bool = False
    # baked artifacts (manifest.json + files); None = no store
    artifact_dir: str | None = None
    # where fail-stop markers live across process restarts (an emptyDir in Kubernetes)
    failstop_dir: str = DEFAULT_FAILSTOP_DIR
    # the container's termination message file (Kubernetes reads it after the container exits)
    termination_log: str = DEFAULT_TERMINATION_LOG
    # crash-loop guard: this many fail-stops within the window -> start degraded
    max_failstops: int = 3
    failstop_window_s: float = 3600.0
    # bounded waits: a kernel or host wait longer than this is a failure (sets the health word)
    wait_timeout_s: float = 10.0
    # warm-up golden check: pass when max|out - ref| <= atol + rtol * max|ref| for every layer
    warmup_atol: float = 0.02
    warmup_rtol: float = 0.02
    # exit the process on a fail-stop (False only for in-process tests)
    exit_on_failstop: bool = True
    # auto: at warm-up time each width's mono step against the stock step and serve mono only at
    # the widths where it is faster; force: serve every built width untimed
    width_policy: str = "auto"
    # every Nth real mono step, compare one layer's kernel output with the stock layer off the hot
    # path (0 = off); past the warm-up tolerance: degrade to stock decode or fail-stop
    shadow_check_every: int = 0
    shadow_on_fail: str = "degrade"

    def __post_init__(self) -> None:
        # Direct construction is validated too (from_dict adds where the values came from).
        for f in fields(self):
            value = _VALIDATORS[f.name](f"monodecode config: {f.name!r}", getattr(self, f.name))
            object.__setattr__(self, f.name, value)

    @property
    def max_width(self) -> int:
        return self.widths[-1]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["widths"] = list(self.widths)
        return d

    def replace(self, **changes: Any) -> MonoConfig:
        return MonoConfig.from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, *, where: str = "monodecode config") -> MonoConfig:
        """Validate and build; ``ConfigError`` (one line) for an unknown key or bad value."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: must be an object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            values[key] = _VALIDATORS[key](f"{where}: {key!r}", value)
        return cls(**values)

    @classmethod
    def from_json(cls, text: str, *, where: str = "monodecode config") -> MonoConfig:
        return cls.from_dict(parse_json(text, where, ConfigError), where=where)

    @classmethod
    def from_additional_config(
        cls, additional_config: Mapping[str, Any] | None, monokernel: bool = False
    ) -> MonoConfig:
        """From vLLM's ``additional_config`` dict (+ the ``--monokernel`` flag).

        ``{"monodecode": {...}}`` carries the options; a top-level ``decode_backend`` of
        ``latency_specialized`` (vLLM 0.33's switch) or ``--monokernel`` turns mono decode on.
        """
        add = dict(additional_config or {})
        section = add.get("monodecode")
        if section is not None and not isinstance(section, Mapping):
            raise ConfigError(f"additional_config.monodecode: must be an object, got {type(section).__name__}")
        opts = dict(section or {})
        alias = add.get("decode_backend")
        if alias is not None and alias not in ("auto", DECODE_BACKEND_ALIAS):
            raise ConfigError(
                f"additional_config: 'decode_backend' must be 'auto' or '{DECODE_BACKEND_ALIAS}', got {alias!r}"
            )
        if (alias == DECODE_BACKEND_ALIAS or monokernel) and "enabled" not in opts:
            opts["enabled"] = True
        return cls.from_dict(opts, where="additional_config.monodecode")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> MonoConfig:
        """From ``MONODECODE_CONFIG`` (a JSON object); defaults when unset."""
        env = os.environ if environ is None else environ
        text = env.get("MONODECODE_CONFIG")
        if not text:
            return cls()
        return cls.from_json(text, where="MONODECODE_CONFIG")


# ---- command-line forms (verify, precompile): one rule with MonoConfig ------------------------

MAX_BLOCK_SIZE = 1024


def parse_widths(text: str, where: str = "--widths") -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)`` by the rule ``MonoConfig.widths`` applies (integers
    1..MAX_WIDTH, strictly ascending, no duplicates); ``ConfigError`` naming ``where`` otherwise."""
    items = [w.strip() for w in str(text).split(",")]
    if not all(w.isascii() and w.isdigit() and len(w) <= 4 for w in items):
        raise ConfigError(f"{where} must be a comma-separated list of integers, got {str(text)[:80]!r}")
    return _widths(where, [int(w) for w in items])


def check_block_size(value: int, where: str = "--block-size") -> int:
    """A paged-KV block size: an integer 1..MAX_BLOCK_SIZE; ``ConfigError`` naming ``where``."""
    return _int_range(1, MAX_BLOCK_SIZE)(where, value)


# ---- validators: (label, value) -> normalized value, or ConfigError --------------------------


def _bool(label: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise ConfigError(f"{label} must be true or false, got {v!r}")


def _choice(options: tuple[str, ...]):
    def check(label: str, v: Any) -> str:
        if isinstance(v, str) and v in options:
            return v
        raise ConfigError(f"{label} must be one of {', '.join(options)}, got {v!r}")

    return check


def _int_range(lo: int, hi: int):
    def check(label: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{label} must be an integer, got {v!r}")
        if not lo <= v <= hi:
            raise ConfigError(f"{label} must be between {lo} and {hi}, got {v}")
        return v

    return check


def _positive_at_most(hi: float):
    """A positive number no larger than ``hi``."""

    def check(label: str, v: Any) -> float:
        v = _positive_float(label, v)
        if v > hi:
            raise ConfigError(f"{label} must be at most {hi:g}, got {v:g}")
        return v

    return check


def _positive_float(label: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{label} must be a number, got {v!r}")
    v = float(v)
    if not (v > 0 and v < float("inf")):
        raise ConfigError(f"{label} must be a positive finite number, got {v}")
    return v


def _nonneg_float(label: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{label} must be a number, got {v!r}")
    v = float(v)
    if not (v >= 0 and v < float("inf")):
        raise ConfigError(f"{label} must be a non-negative finite number, got {v}")
    return v


def _widths(label: str, v: Any) -> tuple[int, ...]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not v:
        raise ConfigError(f"{label} must be a non-empty list of integers, got {v!r}")
    out = []
    for w in v:
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_WIDTH:
            raise ConfigError(f"{label} entries must be integers between 1 and {MAX_WIDTH}, got {w!r}")
        out.append(w)
    if out != sorted(set(out)):
        raise ConfigError(f"{label} must be strictly ascending without duplicates, got {list(v)!r}")
    return tuple(out)


def _path(label: str, v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"{label} must be a non-empty path string, got {v!r}")
    if "\0" in v:
        raise ConfigError(f"{label} must not contain NUL bytes")
    return v


def _optional_path(label: str, v: Any) -> str | None:
    return None if v is None else _path(label, v)


_VALIDATORS = {
    "enabled": _bool,
    "backend": _choice(BACKENDS),
    "on_refusal": _choice(ON_REFUSAL),
    "widths": _widths,
    "allow_jit": _bool,
    "artifact_dir": _optional_path,
    "failstop_dir": _path,
    "termination_log": _path,
    "max_failstops": _int_range(1, 1000),
    "failstop_window_s": _positive_float,
    "wait_timeout_s": _positive_at_most(MAX_WAIT_TIMEOUT_S),
    "warmup_atol": _nonneg_float,
    "warmup_rtol": _nonneg_float,
    "exit_on_failstop": _bool,
    "width_policy": _choice(WIDTH_POLICIES),
    "shadow_check_every": _int_range(0, 1_000_000),
    "shadow_on_fail": _choice(SHADOW_ON_FAIL),
}
assert set(_VALIDATORS) == {f.name for f in fields(MonoConfig)}, "every option needs a validator"
