"""Running the installed ``monodecode-ops`` console script (and the image build's ``pyenv.py``) as
a process, and the CLI's error contract.

Imported by sibling test modules as ``cli_helpers`` (pytest puts this directory on sys.path, as
tests/e2e does for its ``servers`` module).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLI = str(Path(sys.executable).with_name("monodecode-ops"))


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``monodecode-ops *args`` from the repository root; ``env`` is added to this environment."""
    return subprocess.run(
        [CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def process_error_line(proc: subprocess.CompletedProcess) -> str:
    """The CLI's contract for user errors: exit 2, one ``error:`` line last on stderr, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), proc.stderr[-2000:]
    return lines[-1]


def pyenv(*args: str) -> subprocess.CompletedProcess:
    """Run ``images/build/pyenv.py *args`` (the image build's helper) with this interpreter."""
    return subprocess.run(
        [sys.executable, str(ROOT / "images" / "build" / "pyenv.py"), *args], capture_output=True, text=True
    )


def image_info(artifacts: Path, out: Path) -> None:
    """``pyenv.py image-info`` of a gfx950 image of profile tiny over the store ``artifacts``,
    written to ``out`` (what the image build bakes as /opt/monodecode/image.json)."""
    proc = pyenv(
        "image-info",
        "--arch",
        "gfx950",
        "--profiles",
        "tiny",
        "--artifacts",
        str(artifacts),
        "--precompile",
        "test",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
