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


# ---- claims that went stale once (issue 29): each is checked against what it describes ---------


def _doc_texts() -> dict[str, str]:
    return {doc: (REPO / doc).read_text(encoding="utf-8") for doc in DOCS if (REPO / doc).is_file()}


def test_readme_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first_block = re.search(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S).group(1)
    assert first_block.split("\n")[:-1] == ["make run", "make test"]
    assert text.index("## Requirements") < text.index("```\nmake run") < text.index("## Deploying")


def test_verify_against_a_live_server_is_documented_without_its_self_test():
    """``verify --endpoint URL`` alone also runs the self-test on the operator's machine."""
    pattern = re.compile(r"monodecode-ops verify[^`\n#]*--endpoint\s+\S*http[^`\n#]*")
    found = [(doc, m.group(0)) for doc, text in _doc_texts().items() for m in pattern.finditer(text)]
    assert found and [f for f in found if "--no-self-test" not in f[1]] == []


def test_docs_say_helm_test_runs_verify_only_if_it_does():
    script = (REPO / "helm" / "vllm-monodecode" / "files" / "helm-test.sh").read_text()
    runs_verify = any("monodecode-ops" in ln for ln in script.splitlines() if not ln.lstrip().startswith("#"))
    claims = [
        (doc, m.group(0))
        for doc, text in _doc_texts().items()
        for m in re.finditer(r"helm test`?( pod)?\)?,? (runs|adds)[^.\n]*", text)
    ]
    assert runs_verify or claims == [], claims


def test_the_cpu_servers_mono_backend_is_the_reference_as_the_readme_says(monkeypatch):
    from monodecode.kernels.registry import backends_for
    from monodecode.services.platform import Platform
    from monodecode.vllm_plugin.serving import serve_settings

    assert "the mono backend is the reference" in " ".join((REPO / "README.md").read_text().split())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # what `make serve` runs with
    assert "TRITON_INTERPRET" not in serve_settings("cpu").env
    cpu = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)
    assert backends_for(cpu)[0].name == "reference"


def test_license_file_is_the_declared_license():
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"]["text"]
    heads = {"Apache-2.0": "Apache License\n\\s+Version 2.0, January 2004"}
    assert re.search(heads[declared], (REPO / "LICENSE").read_text()[:200])
