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

from cli_helpers import image_info, pyenv

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "images" / "build"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"monodecode_image_{name}", BUILD / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- pyenv -------------------------------------------------------------------------------------


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


def _report_item(name: str, version: str, sha256: str | None) -> dict:
    # pip's installation report: download_info is PEP 610's direct_url.json
    archive = {"hashes": {"sha256": sha256}} if sha256 else {}
    return {
        "metadata": {"name": name, "version": version},
        "download_info": {"url": f"https://files.example/{name}-{version}.whl", "archive_info": archive},
    }


def test_plan_lists_what_pip_would_add_with_the_index_hashes(tmp_path):
    report = {
        "install": [
            {"metadata": {"name": "monodecode", "version": "0.1.0"}, "download_info": {"dir_info": {}}},
            _report_item("prometheus_client", "0.26.0", "a" * 64),
            _report_item("typer", "0.29.2", "b" * 64),
        ]
    }
    (tmp_path / "report.json").write_text(json.dumps(report))
    proc = pyenv("plan", str(tmp_path / "report.json"), str(tmp_path / "missing.txt"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "missing.txt").read_text() == (
        f"prometheus_client==0.26.0 --hash=sha256:{'a' * 64}\ntyper==0.29.2 --hash=sha256:{'b' * 64}\n"
    )
    report["install"].append(_report_item("rich", "15.0.0", None))
    (tmp_path / "report.json").write_text(json.dumps(report))
    proc = pyenv("plan", str(tmp_path / "report.json"), str(tmp_path / "missing2.txt"))
    assert proc.returncode == 1 and "gave no sha256 for rich==15.0.0" in proc.stderr
    assert not (tmp_path / "missing2.txt").exists()


def _tiny_wheel(directory: Path) -> Path:
    """A minimal valid wheel (what pip wheel leaves in the wheelhouse)."""
    import base64
    import zipfile

    files = {
        "tinypkg/__init__.py": b"VALUE = 1\n",
        "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("tinypkg-1.0.dist-info/RECORD,,")
    path = directory / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("tinypkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def test_runtime_install_checks_every_wheel_against_the_lock(tmp_path):
    """The lock the wheels stage writes, installed the way install-runtime.sh does (real pip):
    an intact wheel installs, a wheel changed after the lock is refused."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = _tiny_wheel(wheels)
    lock = tmp_path / "wheels.lock"
    proc = pyenv("lock", str(wheels), str(wheels), str(lock))
    assert proc.returncode == 0, proc.stderr
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert lock.read_text() == f"{wheels}/{wheel.name} --hash=sha256:{sha}\n"

    def install(target: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--require-hashes"]
        return subprocess.run([*cmd, "--target", str(target), "-r", str(lock)], capture_output=True, text=True)

    proc = install(tmp_path / "ok")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ok" / "tinypkg" / "__init__.py").read_text() == "VALUE = 1\n"
    data = bytearray(wheel.read_bytes())
    data[-30] ^= 0x01
    wheel.write_bytes(bytes(data))
    proc = install(tmp_path / "tampered")
    assert proc.returncode != 0 and "DO NOT MATCH THE HASHES" in proc.stderr, proc.stderr


def test_lock_of_an_empty_wheelhouse_fails(tmp_path):
    proc = pyenv("lock", str(tmp_path), "/opt/monodecode/wheels", str(tmp_path / "wheels.lock"))
    assert proc.returncode == 1 and "no wheels" in proc.stderr


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
    image_info(store.root, tmp_path / "image.json")
    info = json.loads((tmp_path / "image.json").read_text())

    assert info["manifest_digest"] == "sha256:" + hashlib.sha256(store.manifest_path.read_bytes()).hexdigest()
    assert info["build_keys"] == [key] and info["backends"] == ["flydsl", "reference"]
    assert info["compilers"] == ["flydsl=0.5.0"] and info["arch"] == "gfx950" and info["profiles"] == ["tiny"]
