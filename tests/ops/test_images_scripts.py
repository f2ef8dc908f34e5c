"""The scripts that run inside the image build and the image, exercised on the host (no engine):
images/build/entrypoint.py (environment -> ``vllm serve`` command, validation) and
images/build/pyenv.py (install plan, the "base packages untouched" guard, image.json)."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "images" / "build"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"monodecode_image_{name}", BUILD / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ep = _load("entrypoint")
ART = {"MONODECODE_ARTIFACT_DIR": "/opt/monodecode/artifacts"}


def additional(cmd: list[str]) -> dict:
    i = cmd.index("--additional-config")
    return json.loads(cmd[i + 1])


# ---- entrypoint --------------------------------------------------------------------------------


def test_no_arguments_serves_the_model_from_the_environment():
    cmd = ep.command_for([], {**ART, "MONODECODE_MODEL": "meta-llama/Llama-3.1-8B"})
    assert cmd[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B"]
    assert additional(cmd) == {"monodecode": {"enabled": True, "artifact_dir": "/opt/monodecode/artifacts"}}


def test_serve_model_argument_and_passthrough_args():
    env = {
        **ART,
        "MONODECODE_BACKEND": "flydsl",
        "MONODECODE_ON_REFUSAL": "degrade",
        "MONODECODE_WIDTHS": "1, 2,4",
        "MONODECODE_ALLOW_JIT": "no",
    }
    cmd = ep.command_for(["serve", "/models/qwen3", "--tensor-parallel-size", "8"], env)
    assert cmd[:3] == ["vllm", "serve", "/models/qwen3"]
    assert cmd[-2:] == ["--tensor-parallel-size", "8"]
    assert additional(cmd)["monodecode"] == {
        "enabled": True,
        "backend": "flydsl",
        "on_refusal": "degrade",
        "widths": [1, 2, 4],
        "allow_jit": False,
        "artifact_dir": "/opt/monodecode/artifacts",
    }


def test_explicit_additional_config_wins_and_keeps_other_keys():
    env = {**ART, "MONODECODE_ON_REFUSAL": "raise", "MONODECODE_CONFIG": '{"max_failstops": 5}'}
    user = '{"monodecode": {"on_refusal": "degrade"}, "other_plugin": {"x": 1}}'
    cmd = ep.command_for(["serve", "m", f"--additional-config={user}", "--port", "9000"], env)
    assert additional(cmd) == {
        "other_plugin": {"x": 1},
        "monodecode": {
            "max_failstops": 5,
            "enabled": True,
            "on_refusal": "degrade",
            "artifact_dir": "/opt/monodecode/artifacts",
        },
    }
    assert cmd.count("--additional-config") == 1 and cmd[-2:] == ["--port", "9000"]


def test_disabled_by_environment():
    cmd = ep.command_for(["serve", "m"], {"MONODECODE_ENABLED": "false"})
    assert additional(cmd)["monodecode"]["enabled"] is False


def test_verify_and_other_commands():
    assert ep.command_for(["verify", "--json"], {}) == ["monodecode-ops", "verify", "--json"]
    assert ep.command_for(["bash", "-lc", "id"], {}) == ["bash", "-lc", "id"]
    assert ep.command_for(["monodecode-ops", "inspect"], {}) == ["monodecode-ops", "inspect"]


@pytest.mark.parametrize(
    "args,env,expected",
    [
        ([], {}, "no model: pass it as the first argument of serve or set MONODECODE_MODEL"),
        (["serve", "m"], {"MONODECODE_BACKEND": "cuda"}, "'backend' must be one of auto, flydsl, triton, reference"),
        (["serve", "m"], {"MONODECODE_ENABLED": "maybe"}, "MONODECODE_ENABLED must be true or false"),
        (["serve", "m"], {"MONODECODE_WIDTHS": "1,x"}, "MONODECODE_WIDTHS must be comma-separated integers"),
        (["serve", "m"], {"MONODECODE_WIDTHS": "4,2"}, "'widths' must be strictly ascending"),
        (["serve", "m"], {"MONODECODE_CONFIG": "{"}, "MONODECODE_CONFIG is not valid JSON"),
        (["serve", "m"], {"MONODECODE_CONFIG": '{"colour": 1}'}, "unknown key 'colour'"),
        (["serve", "m", "--additional-config", "[1]"], {}, "--additional-config must be a JSON object"),
        (["serve", "m", "--additional-config"], {}, "--additional-config needs a JSON object argument"),
    ],
)
def test_bad_settings_are_one_error_line(args, env, expected, capsys, monkeypatch):
    for key in [k for k in list(os.environ) if k.startswith("MONODECODE_")]:
        monkeypatch.delenv(key)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert ep.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_print_mode_and_missing_executable(capsys, monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    monkeypatch.setenv("MONODECODE_ENTRYPOINT_PRINT", "1")
    assert ep.main(["serve", "m"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["argv"][:3] == ["vllm", "serve", "m"] and out["env"] == {"VLLM_KV_CACHE_LAYOUT": "LBNHC"}
    monkeypatch.delenv("MONODECODE_ENTRYPOINT_PRINT")
    assert ep.main(["monodecode-no-such-command"]) == 2
    assert capsys.readouterr().err.strip() == "error: monodecode-no-such-command: command not found"


def test_serve_environment():
    enabled = ep.command_for(["serve", "m"], {})
    assert ep.serve_environment(enabled, {}) == {"VLLM_KV_CACHE_LAYOUT": "LBNHC"}
    assert ep.serve_environment(enabled, {"VLLM_KV_CACHE_LAYOUT": "NHD"}) == {}  # the operator's choice stands
    assert ep.serve_environment(ep.command_for(["serve", "m"], {"MONODECODE_ENABLED": "0"}), {}) == {}
    assert ep.serve_environment(["monodecode-ops", "verify"], {}) == {}


def test_multiprocess_dir_is_fresh_at_every_start(tmp_path):
    given = tmp_path / "prom"
    given.mkdir()
    (given / "counter_123.db").write_bytes(b"stale")
    (given / "keep.txt").write_text("not ours")
    assert ep.fresh_multiprocess_dir({"PROMETHEUS_MULTIPROC_DIR": str(given)}) == str(given)
    assert sorted(p.name for p in given.iterdir()) == ["keep.txt"]
    new = Path(ep.fresh_multiprocess_dir({}))
    try:
        assert new.is_dir() and not any(new.iterdir())
    finally:
        new.rmdir()


def test_serve_execs_vllm_with_its_environment(tmp_path):
    """The exec itself, with a recording stand-in for the `vllm` executable on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "record.json"
    fake = bindir / "vllm"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\njson.dump({{'argv': sys.argv[1:], "
        f"'mp': os.environ.get('PROMETHEUS_MULTIPROC_DIR'), 'layout': os.environ.get('VLLM_KV_CACHE_LAYOUT')}}, "
        f"open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "MONODECODE_MODEL": "/models/m",
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run([sys.executable, str(BUILD / "entrypoint.py")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(record.read_text())
    assert got["argv"][:2] == ["serve", "/models/m"] and got["layout"] == "LBNHC"
    assert Path(got["mp"]).parent == tmp_path and Path(got["mp"]).is_dir()


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
