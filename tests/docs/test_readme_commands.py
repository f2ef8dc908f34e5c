"""The README's commands work as written: every shell block marked runnable is executed.

A block is runnable when the line before its opening fence is ``<!-- runnable -->`` (or
``<!-- runnable: timeout=SECONDS -->``). It runs under ``bash -euo pipefail`` from the repository
root with the test interpreter's bin directory first on PATH, so ``monodecode-ops`` is the
installed one. Blocks that need hardware or services CI lacks are simply not marked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARK = re.compile(r"^<!-- runnable(?::\s*timeout=(\d+))? -->\s*$")
DOCS = ("README.md", "benchmarks/README.md", "images/README.md", "deploy/RUNBOOK.md")


def runnable_blocks(text: str) -> list[tuple[int, int, str]]:
    """[(line number, timeout, script)] of the marked ```sh / ```bash / ```console blocks."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        m = MARK.match(line)
        if not m or not re.match(r"^```(sh|bash|shell)\s*$", lines[i + 1]):
            continue
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise AssertionError(f"line {i + 2}: runnable block has no closing fence")
        out.append((i + 2, int(m.group(1) or 300), "\n".join(lines[i + 2 : end])))
    return out


def _cases():
    for doc in DOCS:
        path = REPO / doc
        if path.is_file():
            for line, timeout, script in runnable_blocks(path.read_text(encoding="utf-8")):
                yield pytest.param(doc, line, timeout, script, id=f"{doc}:{line}")


def test_marker_parser_finds_blocks_and_ignores_unmarked():
    text = "x\n<!-- runnable -->\n```sh\necho a\n```\n```sh\necho b\n```\n<!-- runnable: timeout=5 -->\n```bash\nfalse\n```\n"
    assert runnable_blocks(text) == [(3, 300, "echo a"), (10, 5, "false")]


def test_readme_has_runnable_blocks():
    assert any(True for _ in _cases()), "no runnable block found in the documentation"


@pytest.mark.parametrize(("doc", "line", "timeout", "script"), list(_cases()))
def test_documented_commands_run(doc, line, timeout, script, tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", HOME=str(tmp_path))
    env.setdefault("XDG_CACHE_HOME", str(tmp_path / "cache"))
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (
        f"{doc}:{line}: block exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )
