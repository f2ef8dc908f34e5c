"""Fail-stop: a kernel failure ends the process with its cause on record; it is never a fallback.

Once a kernel reports a failure (health word nonzero: an expired bounded wait, a non-finite
value) the step's activations are already wrong, so running the stock path afterwards would
return garbage. The runner checks health before logits; on failure ``FailStopRecorder.fail``:

1. appends the event (rank, step, site, layer, kernel, time) to this rank's marker file
   ``<failstop_dir>/failstop-rank<R>.json`` (temp file + rename: never half written);
2. writes one line to the termination-message file (Kubernetes shows it as the container's
   termination reason; default ``/dev/termination-log``);
3. counts it in ``monodecode_failstop_total{site}`` and prints the line on stderr;
4. exits the process with code 70 without running Python cleanup (``os._exit``), so no token of
   the failed step leaves the process and no later step runs on poisoned state.

On the next start the marker is read back: the counters continue from the recorded totals and
``monodecode_last_failstop_timestamp_seconds`` is set. When ``max_failstops`` or more fail-stops
fall within ``failstop_window_s`` the runner starts degraded (stock decode) instead of
crash-looping into the same failure.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from monodecode.errors import MonodecodeError
from monodecode.jsonio import read_json_file
from monodecode.metrics import FAILSTOP_SITES
from monodecode.services.artifacts import atomic_write_bytes

EXIT_CODE = 70  # EX_SOFTWARE
MARKER_SCHEMA = 1
MAX_EVENTS_KEPT = 100
TERMINATION_MESSAGE_LIMIT = 4096  # Kubernetes truncates at 4 KiB


@dataclass(frozen=True)
class FailStopEvent:
    rank: int
    step: int
    site: str
    layer: int | None
    kernel: str | None
    time: float
    detail: str = ""
    pid: int = 0

    def message(self) -> str:
        where = [f"rank {self.rank}", f"step {self.step}", f"site {self.site}"]
        if self.kernel:
            where.append(self.kernel)
        if self.layer is not None:
            where.append(f"layer {self.layer}")
        line = "monodecode fail-stop: " + ", ".join(where)
        return line + (f": {self.detail}" if self.detail else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FailStop(RuntimeError):
    """Raised instead of exiting when ``exit_on_failstop`` is False (in-process tests)."""

    def __init__(self, event: FailStopEvent):
        self.event = event
        super().__init__(event.message())


@dataclass
class MarkerHistory:
    events: list[FailStopEvent]
    totals: dict[str, int]  # site -> fail-stops ever recorded by this rank
    problems: list[str]  # unreadable marker files (reported, never fatal)

    @property
    def last(self) -> FailStopEvent | None:
        return max(self.events, key=lambda e: e.time) if self.events else None

    def within(self, window_s: float, now: float) -> list[FailStopEvent]:
        return [e for e in self.events if now - e.time <= window_s]


FUTURE_SLACK_S = 300.0  # clock skew tolerated before a marker's time counts as "in the future"
_LIMIT = 1 << 62


def _int(raw: Any, key: str, default: Any = ...) -> int:
    value = raw.get(key, default) if default is not ... else raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or not -_LIMIT < value < _LIMIT:
        raise ValueError(f"{key} {str(value)[:40]!r} is not an integer")
    return value


def _event_from(raw: Any) -> FailStopEvent:
    if not isinstance(raw, dict):
        raise ValueError("event is not an object")
    site = raw["site"]
    if site not in FAILSTOP_SITES:
        raise ValueError(f"site {str(site)[:40]!r} is not one of {', '.join(FAILSTOP_SITES)}")
    when = raw["time"]
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not 0 <= when < 1e12:
        raise ValueError(f"time {str(when)[:40]!r} is not a Unix time")
    kernel = raw.get("kernel")
    return FailStopEvent(
        rank=_int(raw, "rank"),
        step=_int(raw, "step"),
        site=site,
        layer=None if raw.get("layer") is None else _int(raw, "layer"),
        kernel=None if kernel is None else str(kernel)[:16],
        time=float(when),
        detail=str(raw.get("detail", ""))[:1000],
        pid=_int(raw, "pid", 0),
    )


class FailStopRecorder:
    """Marker files, termination message and exit for one rank."""

    def __init__(
        self,
        failstop_dir: str | Path,
        rank: int = 0,
        termination_log: str | Path = "/dev/termination-log",
        exit_on_failstop: bool = True,
        metrics: Any = None,
    ):
        self.dir = Path(failstop_dir).expanduser()
        self.rank = rank
        self.termination_log = Path(termination_log)
        self.exit_on_failstop = exit_on_failstop
        self.metrics = metrics

    @property
    def marker_path(self) -> Path:
        return self.dir / f"failstop-rank{self.rank}.json"

    def check_writable(self) -> None:
        """Startup check: a marker that cannot be written would hide the next fail-stop."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            # a fresh name made with O_EXCL: a planted symlink is never followed
            fd, probe = tempfile.mkstemp(dir=self.dir, prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise MonodecodeError(f"fail-stop directory {self.dir} is not writable: {e.strerror}") from None

    def read(self) -> MarkerHistory:
        """This rank's recorded fail-stops (an unreadable marker is reported, not fatal)."""
        path = self.marker_path
        try:
            data = read_json_file(path, f"fail-stop marker {path}")
        except FileNotFoundError:
            return MarkerHistory([], {}, [])
        except MonodecodeError as e:
            return MarkerHistory([], {}, [f"{e}; ignored"])
        try:
            if not isinstance(data, dict) or data.get("schema") != MARKER_SCHEMA:
                raise ValueError(f"schema {str(data.get('schema') if isinstance(data, dict) else None)[:40]!r}")
            raw_events, raw_totals = data.get("events", []), data.get("totals", {})
            if not isinstance(raw_events, list) or not isinstance(raw_totals, dict):
                raise ValueError("'events' must be a list and 'totals' an object")
            events = [_event_from(e) for e in raw_events[-MAX_EVENTS_KEPT:]]
            totals = {site: _int(raw_totals, site) for site in FAILSTOP_SITES if site in raw_totals}
            if any(v < 0 for v in totals.values()):
                raise ValueError("negative totals")
        except (KeyError, TypeError, ValueError) as e:
            return MarkerHistory([], {}, [f"fail-stop marker {path} is malformed ({e}); ignored"])
        problems = []
        unknown = [str(k)[:40] for k in raw_totals if k not in FAILSTOP_SITES]
        if unknown:
            problems.append(f"fail-stop marker {path}: unknown sites {', '.join(map(repr, unknown[:5]))} ignored")
        horizon = time.time() + FUTURE_SLACK_S
        future = [e for e in events if e.time > horizon]
        if future:
            # a clock that ran ahead, or a forged marker: such events would count as "recent"
            # forever (a permanent crash-loop guard); they keep their totals but not their times
            problems.append(f"fail-stop marker {path}: {len(future)} event(s) dated in the future ignored")
            events = [e for e in events if e.time <= horizon]
        return MarkerHistory(events, totals, problems)

    def export(self, history: MarkerHistory) -> None:
        """Publish the recorded history in the metrics (called at start)."""
        if self.metrics is not None:
            last = history.last
            self.metrics.set_failstop_history(history.totals, last.time if last else 0.0)

    def crash_loop_reason(
        self, history: MarkerHistory, max_failstops: int, window_s: float, now: float | None = None
    ) -> str | None:
        """A refusal reason when the N-in-window rule says: start degraded."""
        recent = history.within(window_s, time.time() if now is None else now)
        if len(recent) < max_failstops:
            return None
        last = max(recent, key=lambda e: e.time)
        return (
            f"failstop_loop: {len(recent)} fail-stops within {window_s:g} s (limit {max_failstops}); "
            f"last: {last.site} at rank {last.rank} step {last.step}; starting with stock decode. "
            f"Remove {self.marker_path} after fixing the cause to re-enable"
        )

    def _write_marker(self, event: FailStopEvent) -> None:
        history = self.read()
        events = (history.events + [event])[-MAX_EVENTS_KEPT:]
        totals = dict(history.totals)
        totals[event.site] = totals.get(event.site, 0) + 1
        body = {"schema": MARKER_SCHEMA, "events": [e.to_dict() for e in events], "totals": totals}
        atomic_write_bytes(self.marker_path, (json.dumps(body, indent=1) + "\n").encode())

    def _write_termination_message(self, event: FailStopEvent) -> bool:
        # Not temp+rename: Kubernetes bind-mounts this exact file; it is small and single-line.
        # The directory may be shared, so the file is never a symlink (O_NOFOLLOW), a FIFO or
        # device (O_NONBLOCK, then a regular-file check), nor a hard link to another file;
        # only then is it truncated.
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.termination_log, flags, 0o644)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                return False
            os.ftruncate(fd, 0)
            os.write(fd, (event.message()[:TERMINATION_MESSAGE_LIMIT] + "\n").encode())
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def fail(self, event: FailStopEvent) -> None:
        """Record ``event`` everywhere, then exit (or raise ``FailStop``). Never returns."""
        problems = []
        try:
            self._write_marker(event)
        except OSError as e:
            problems.append(f"marker {self.marker_path} not written: {e.strerror}")
        if not self._write_termination_message(event):
            problems.append(f"termination message {self.termination_log} not written")
        if self.metrics is not None:
            self.metrics.count_failstop(event.site, event.time)
        line = event.message()
        if problems:
            line += " [" + "; ".join(problems) + "]"
        print(line, file=sys.stderr, flush=True)
        if self.exit_on_failstop:
            sys.stdout.flush()
            os._exit(EXIT_CODE)
        raise FailStop(event)
