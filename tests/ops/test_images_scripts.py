"""The scripts that run inside the image build, exercised on the host (no engine):
images/build/pyenv.py (install plan, the "base packages untouched" guard, image.json).
The image's entry point has its own tests (test_entrypoint.py)."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "images" / "build"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"monodecode_image_{name}", BUILD / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- pyenv -------------------------------------------------------------------------------------


def pyenv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUILD / "pyenv.py"), *args], capture_output=True, text=True)


def test_undisturbed_names_every_changed_base_package(tmp_path):
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(json.dumps({"torch": "2.9.1+rocm7.12", "numpy": "1.26.4", "vllm": "0.33.0"}))
    after.write_text(json.dumps({"torch": "2.9.1+rocm7.12", "numpy": "2.4.6", "monodecode": "0.1.0"}))
    proc = pyenv("undisturbed", str(before), str(after))
    assert proc.returncode == 1
    assert "numpy 1.26.4 -> 2.4.6" in proc.stderr and "vllm 0.33.0 -> removed" in proc.stderr
    after.write_text(json.dumps({"torch": "2.9.1+rocm7.12", "numpy": "1.26.4", "vllm": "0.33.0", "rich": "15"}))
    proc = pyenv("undisturbed", str(before), str(after))
    assert proc.returncode == 0 and "added 1: rich" in proc.stdout


def test_plan_lists_what_pip_would_add_except_monodecode(tmp_path):
    report = {
        "install": [
            {"metadata": {"name": "monodecode", "version": "0.1.0"}},
            {"metadata": {"name": "prometheus_client", "version": "0.26.0"}},
            {"metadata": {"name": "typer", "version": "0.29.2"}},
        ]
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    proc = pyenv("plan", str(tmp_path / "report.json"), str(tmp_path / "missing.txt"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "missing.txt").read_text() == "prometheus_client==0.26.0\ntyper==0.29.2\n"


def test_constraints_pin_the_installed_versions(tmp_path):
    out = tmp_path / "constraints.txt"
    assert pyenv("constraints", str(out)).returncode == 0
    lines = out.read_text().splitlines()
    assert f"pytest=={md.version('pytest')}" in lines
    assert all(line.count("==") == 1 for line in lines)


def test_image_info_summarises_the_manifest(tmp_path):
    from monodecode.services.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "artifacts")
    key = "ab" * 32
    store.add(
        build_key=key,
        backend="flydsl",
        arch="gfx950",
        dims_digest="cd" * 32,
        widths=[1, 2],
        files={"k1.hsaco": b"\x7fELF"},
        compiler={"name": "flydsl", "version": "0.5.0"},
        profile="tiny",
    )
    proc = pyenv(
        "image-info",
        "--arch",
        "gfx950",
        "--profiles",
        "tiny",
        "--artifacts",
        str(store.root),
        "--precompile",
        "test",
        "--out",
        str(tmp_path / "image.json"),
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / "image.json").read_text())

    assert info["manifest_digest"] == "sha256:" + hashlib.sha256(store.manifest_path.read_bytes()).hexdigest()
    assert info["build_keys"] == [key] and info["backends"] == ["flydsl", "reference"]
    assert info["compilers"] == ["flydsl=0.5.0"] and info["arch"] == "gfx950" and info["profiles"] == ["tiny"]
