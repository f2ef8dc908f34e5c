"""images/build/entrypoint.py on the host: environment and arguments -> the ``vllm serve`` command
and environment, validated by the runtime's own rules; any input is a command or one error line."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from monodecode.config import MonoConfig
from monodecode.vllm_plugin.serving import SERVE_PAIRS, SERVE_SETTINGS, serve_settings

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "images" / "build" / "entrypoint.py"
_spec = importlib.util.spec_from_file_location("monodecode_image_entrypoint", ENTRYPOINT)
ep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ep)

ART = {"MONODECODE_ARTIFACT_DIR": "/opt/monodecode/artifacts"}
ROCM = {"MONODECODE_SERVE_PLATFORM": "rocm"}


def additional(cmd: list[str]) -> dict:
    return json.loads(cmd[cmd.index("--additional-config") + 1])


def serve(args: list[str], env: dict) -> tuple[list[str], dict]:
    return ep.command_for(["serve", *args], {**ROCM, **env})


def one_error(args: list[str], env: dict, capsys) -> str:
    assert ep.main(args, {**ROCM, **env}) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert captured.out == ""
    return lines[0]


# ---- what serve runs -----------------------------------------------------------------------------


def test_no_arguments_serves_the_model_from_the_environment():
    cmd, env = ep.command_for([], {**ROCM, **ART, "MONODECODE_MODEL": "meta-llama/Llama-3.1-8B"})
    assert cmd[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B"]
    assert additional(cmd) == {"monodecode": {"enabled": True, "artifact_dir": "/opt/monodecode/artifacts"}}


@pytest.mark.parametrize("platform", sorted(SERVE_SETTINGS))
def test_serve_sets_exactly_the_supported_pair(platform):
    """The attention backend and KV layout of serving.serve_settings, nothing else (no LBNHC on
    ROCm's default backend: vLLM would refuse to start)."""
    cmd, env = ep.command_for(["serve", "m", "--port", "9000"], {"MONODECODE_SERVE_PLATFORM": platform})
    want = serve_settings(platform)
    assert env == want.env
    assert cmd[5:] == ["--port", "9000", *want.args]
    # the operator may spell the same choice; a different one is refused
    cmd, env = ep.command_for(["serve", "m", *want.args], {"MONODECODE_SERVE_PLATFORM": platform, **want.env})
    assert cmd[5:] == list(want.args) and env == want.env


@pytest.mark.parametrize("pair", SERVE_PAIRS["rocm"], ids=lambda p: p.attention_backend)
def test_the_operator_selects_any_of_the_platforms_pairs_by_its_backend(pair):
    """ROCm's default is AITER on (``ROCM_AITER_FA``); ``--attention-backend`` picks another pair,
    whose own environment comes with it (TRITON_ATTN: LBNHC, AITER left as the operator set it)."""
    cmd, env = serve(["m", "--attention-backend", pair.attention_backend], {})
    assert env == pair.env and cmd[5:] == list(pair.args)
    if pair.attention_backend == "TRITON_ATTN":
        assert "VLLM_ROCM_USE_AITER" not in env
        cmd, env = serve(["m", f"--attention-backend={pair.attention_backend}"], {"VLLM_ROCM_USE_AITER": "1"})
        assert env == pair.env and cmd[5:] == [f"--attention-backend={pair.attention_backend}"]


def test_mono_off_serves_stock():
    cmd, env = serve(["m", "--attention-backend", "FLASHINFER"], {"MONODECODE_ENABLED": "false"})
    assert env == {} and cmd[5:] == ["--attention-backend", "FLASHINFER"]
    assert additional(cmd)["monodecode"]["enabled"] is False


def test_platform_comes_from_torch_when_not_given():
    import torch

    want = "rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu"
    assert ep.serve_platform({}) == want


def test_every_monoconfig_field_has_its_variable():
    """MONODECODE_<FIELD> for every field of MonoConfig, mechanically (a new option needs no edit)."""
    defaults = MonoConfig()
    env = {}
    for f in dataclasses.fields(MonoConfig):
        value = getattr(defaults, f.name)
        if isinstance(value, bool):
            text = "false" if value else "true"
        elif isinstance(value, tuple):
            text = ",".join(str(w) for w in value[:1])
        elif value is None:
            text = "/opt/x"
        else:
            text = str(value)
        env["MONODECODE_" + f.name.upper()] = text
    env["MONODECODE_EXIT_ON_FAILSTOP"] = "true"  # serve never turns it off
    cmd, _ = serve(["m"], env)
    section = additional(cmd)["monodecode"]
    assert set(section) == {f.name for f in dataclasses.fields(MonoConfig)}
    assert MonoConfig.from_dict(section).to_dict() == section | {"widths": list(section["widths"])}


def test_precedence_image_default_config_variable_argument():
    env = {
        **ART,
        "MONODECODE_CONFIG": '{"artifact_dir": "/mnt/kernels", "on_refusal": "raise", "max_failstops": 5}',
        "MONODECODE_ON_REFUSAL": "degrade",
        "MONODECODE_WIDTHS": "1, 2,4",
    }
    user = '{"monodecode": {"widths": [1, 8]}, "other_plugin": {"x": 1}}'
    cmd, _ = serve(["m", f"--additional-config={user}", "--port", "9000"], env)
    assert additional(cmd) == {
        "other_plugin": {"x": 1},
        "monodecode": {
            "enabled": True,
            "artifact_dir": "/mnt/kernels",  # MONODECODE_CONFIG beats the image's default
            "on_refusal": "degrade",  # a variable beats MONODECODE_CONFIG
            "max_failstops": 5,
            "widths": [1, 8],  # the explicit argument beats everything
        },
    }
    assert cmd.count("--additional-config") == 1 and cmd[5:7] == ["--port", "9000"]


def test_decode_backend_alias_is_checked():
    cmd, _ = serve(["m", "--additional-config", '{"decode_backend": "latency_specialized"}'], {})
    assert additional(cmd)["decode_backend"] == "latency_specialized"


def test_verify_and_other_commands():
    assert ep.command_for(["verify", "--json"], {}) == (["monodecode-ops", "verify", "--json"], {})
    assert ep.command_for(["bash", "-lc", "id"], {}) == (["bash", "-lc", "id"], {})


# ---- bad input: one line each ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,env,expected",
    [
        ([], {}, "no model: pass it as the first argument of serve or set MONODECODE_MODEL"),
        (
            ["serve", "m"],
            {"MONODECODE_BACKEND": "cuda"},
            "'backend' must be one of auto, flydsl, triton, triton-step, reference",
        ),
        (["serve", "m"], {"MONODECODE_ENABLED": "maybe"}, "MONODECODE_ENABLED must be true or false"),
        (["serve", "m"], {"MONODECODE_WIDTHS": "1,x"}, "MONODECODE_WIDTHS must be comma-separated integers"),
        (["serve", "m"], {"MONODECODE_WIDTHS": "4,2"}, "'widths' must be strictly ascending"),
        (["serve", "m"], {"MONODECODE_MAX_FAILSTOPS": "1e999"}, "MONODECODE_MAX_FAILSTOPS must be an integer"),
        (["serve", "m"], {"MONODECODE_MAX_FAILSTOPS": "1" * 5000}, "MONODECODE_MAX_FAILSTOPS must be an integer"),
        (["serve", "m"], {"MONODECODE_MAX_FAILSTOPS": "\u0663"}, "MONODECODE_MAX_FAILSTOPS must be an integer"),
        (["serve", "m"], {"MONODECODE_WAIT_TIMEOUT_S": "inf"}, "'wait_timeout_s' must be a positive finite number"),
        (["serve", "m"], {"MONODECODE_WAIT_TIMEOUT_S": "nan"}, "'wait_timeout_s' must be a positive finite number"),
        (["serve", "m"], {"MONODECODE_CONFIG": "{"}, "not valid JSON"),
        (["serve", "m"], {"MONODECODE_CONFIG": "[" * 100000 + "]" * 100000}, "nested too deeply"),
        (["serve", "m"], {"MONODECODE_CONFIG": '{"max_failstops": ' + "1" * 5000 + "}"}, "too many digits"),
        (["serve", "m"], {"MONODECODE_CONFIG": '{"failstop_window_s": 1e999}'}, "not a finite number"),
        (["serve", "m"], {"MONODECODE_CONFIG": '{"colour": 1}'}, "unknown key 'colour'"),
        (["serve", "m"], {"MONODECODE_EXIT_ON_FAILSTOP": "false"}, "serve always exits on a fail-stop"),
        (["serve", "m"], {"MONODECODE_SERVE_PLATFORM": "tpu"}, "MONODECODE_SERVE_PLATFORM must be one of"),
        (
            ["serve", "m"],
            {"VLLM_KV_CACHE_LAYOUT": "NHD"},
            "VLLM_KV_CACHE_LAYOUT='NHD': mono decode on rocm with ROCM_AITER_FA needs",
        ),
        (
            ["serve", "m", "--attention-backend", "ROCM_ATTN"],
            {},
            "--attention-backend: attention backend 'ROCM_ATTN': mono decode on rocm runs with ROCM_AITER_FA with "
            "LBHNC, ROCM_AITER_UNIFIED_ATTN with LBHNC, TRITON_ATTN with LBNHC (or disable mono decode)",
        ),
        (
            ["serve", "m"],
            {"VLLM_ROCM_USE_AITER": "0"},
            "mono decode on rocm with ROCM_AITER_FA needs VLLM_ROCM_USE_AITER=1",
        ),
        (
            ["serve", "m", "--attention-backend=TRITON_ATTN"],
            {"VLLM_KV_CACHE_LAYOUT": "LBHNC"},
            "VLLM_KV_CACHE_LAYOUT='LBHNC': mono decode on rocm with TRITON_ATTN needs VLLM_KV_CACHE_LAYOUT=LBNHC",
        ),
        (["serve", "m", "--additional-config", "[1]"], {}, "--additional-config must be a JSON object, got list"),
        (["serve", "m", "--additional-config"], {}, "--additional-config needs a JSON object argument"),
        (["serve", "m", "--additional-config", '{"monodecode": false}'], {}, "'monodecode' must be a JSON object"),
        (["serve", "m", "--additional-config", '{"monodecode": []}'], {}, "'monodecode' must be a JSON object"),
        (["serve", "m", "--additional-config", '{"monodecode": null}'], {}, "'monodecode' must be a JSON object"),
        (["serve", "m", "--additional-config", '{"decode_backend": "bogus"}'], {}, "'decode_backend' must be"),
        (
            ["serve", "m", "--additional-config", '{"monodecode": {"exit_on_failstop": false}}'],
            {},
            "serve always exits on a fail-stop",
        ),
        (
            ["serve", "m", "--additional-config", '{"monodecode": {"enabled": false}}', "--additional_config={}"],
            {},
            "--additional-config is given twice",
        ),
        (["serve", "m", "--additional-config", '{"x": ' + "[" * 5000 + "]" * 5000 + "}"], {}, "nested too deeply"),
    ],
)
def test_bad_settings_are_one_error_line(args, env, expected, capsys):
    line = one_error(args, env, capsys)
    assert expected in line, line


def test_print_mode_and_missing_executable(capsys):
    assert ep.main(["serve", "m"], {**ROCM, "MONODECODE_ENTRYPOINT_PRINT": "1"}) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["argv"][:3] == ["vllm", "serve", "m"] and out["env"] == serve_settings("rocm").env
    assert ep.main(["monodecode-no-such-command"], {"PATH": "/usr/bin:/bin"}) == 2
    assert capsys.readouterr().err.strip() == "error: monodecode-no-such-command: command not found"


# ---- Prometheus multiprocess directory -------------------------------------------------------------


def test_multiprocess_dir_never_deletes_what_it_did_not_make(tmp_path):
    given = tmp_path / "userdata"
    given.mkdir()
    (given / "app.db").write_text("precious")
    (given / "counter_123.db").write_bytes(b"maybe an earlier start's, maybe not: not ours to judge")
    made = Path(ep.fresh_multiprocess_dir({"PROMETHEUS_MULTIPROC_DIR": str(given)}))
    assert made.parent == given and made.is_dir()
    assert [p.name for p in made.iterdir()] == [ep.METRICS_DIR_MARKER]
    again = Path(ep.fresh_multiprocess_dir({"PROMETHEUS_MULTIPROC_DIR": str(given)}))
    assert again != made and made.is_dir()  # a shared directory: earlier starts stay
    assert (given / "app.db").read_text() == "precious" and (given / "counter_123.db").exists()


def test_multiprocess_dir_in_tmp_clears_only_its_own_earlier_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(ep.tempfile, "tempdir", str(tmp_path))
    first = Path(ep.fresh_multiprocess_dir({}))
    (first / "counter_1.db").write_bytes(b"series of the previous start")
    foreign = tmp_path / (ep.METRICS_DIR_PREFIX + "not-ours")
    foreign.mkdir()
    (foreign / "data.db").write_text("no marker: not made by the entrypoint")
    mixed = Path(ep.fresh_multiprocess_dir({}))
    (mixed / "notes.txt").write_text("someone else's file")
    (mixed / "counter_2.db").write_bytes(b"x")
    third = Path(ep.fresh_multiprocess_dir({}))
    assert not first.exists()  # ours, only our files: gone
    assert (foreign / "data.db").exists()
    assert sorted(p.name for p in mixed.iterdir()) == ["notes.txt"]  # ours, emptied of ours only
    assert third.is_dir() and [p.name for p in third.iterdir()] == [ep.METRICS_DIR_MARKER]


def test_multiprocess_dir_must_be_absolute(capsys, monkeypatch):
    monkeypatch.setenv("PATH", os.environ["PATH"])
    with pytest.raises(ep.EntrypointError, match="must be an absolute path"):
        ep.fresh_multiprocess_dir({"PROMETHEUS_MULTIPROC_DIR": "relative/dir"})


def _fake_vllm(bindir: Path, body: str) -> None:
    bindir.mkdir(exist_ok=True)
    fake = bindir / "vllm"
    fake.write_text(f"#!{sys.executable}\n{body}\n")
    fake.chmod(0o755)


def _serve(bindir: Path, **env: str) -> subprocess.CompletedProcess:
    """The image entrypoint run as the container runs it, the fake ``vllm`` in ``bindir`` on PATH."""
    base = {"PATH": f"{bindir}:/usr/bin:/bin", "MONODECODE_MODEL": "/models/m", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ENTRYPOINT)], env={**base, **env}, capture_output=True, text=True)


def test_serve_execs_vllm_with_its_environment(tmp_path):
    """The exec itself, with a recording stand-in for the `vllm` executable on PATH."""
    record = tmp_path / "record.json"
    _fake_vllm(
        tmp_path / "bin",
        "import json, os, sys\njson.dump({'argv': sys.argv[1:], "
        "'mp': os.environ.get('PROMETHEUS_MULTIPROC_DIR'), 'layout': os.environ.get('VLLM_KV_CACHE_LAYOUT')}, "
        f"open({str(record)!r}, 'w'))",
    )
    mp = tmp_path / "prom"
    mp.mkdir()
    (mp / "app.db").write_text("precious")
    proc = _serve(tmp_path / "bin", MONODECODE_SERVE_PLATFORM="rocm", PROMETHEUS_MULTIPROC_DIR=str(mp))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(record.read_text())
    want = serve_settings("rocm")
    assert got["argv"][:2] == ["serve", "/models/m"] and got["argv"][-2:] == list(want.args)
    assert got["layout"] == want.kv_cache_layout
    assert Path(got["mp"]).parent == mp and Path(got["mp"]).is_dir()
    assert (mp / "app.db").read_text() == "precious"


# ---- any input: a command or one error line ----------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
_config_keys = st.sampled_from([f.name for f in dataclasses.fields(MonoConfig)] + ["colour", "decode_backend"])
_section = st.dictionaries(_config_keys, _json, max_size=4)
_texty = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["1e999", "inf", "-inf", "nan", "1" * 5000, "[" * 3000, "true", "0", "1,2,4", "\u0663", " "]),
    _json.map(json.dumps),
    _section.map(json.dumps),
)
_field_vars = st.sampled_from(
    ["MONODECODE_" + f.name.upper() for f in dataclasses.fields(MonoConfig)]
    + ["MONODECODE_CONFIG", "MONODECODE_MODEL", "MONODECODE_SERVE_PLATFORM", "VLLM_KV_CACHE_LAYOUT"]
)
_additional = st.one_of(
    st.dictionaries(st.sampled_from(["monodecode", "decode_backend", "other"]), _json | _section, max_size=3).map(
        json.dumps
    ),
    _texty,
)
_argv = st.one_of(
    st.lists(st.text(max_size=12), max_size=4),
    st.tuples(st.sampled_from(["serve", "--port"]), st.sampled_from(["m", "-x", ""]), _additional).map(
        lambda t: [t[0], t[1], "--additional-config", t[2]]
    ),
    st.lists(
        st.sampled_from(["serve", "m", "--additional-config", "--attention-backend", "TRITON_ATTN", "{}"]), max_size=6
    ),
)


def _clean(text: str) -> str:
    return text.replace("\0", "")  # the OS never passes NUL in an environment value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argv=_argv, env=st.dictionaries(_field_vars, _texty.map(_clean), max_size=5))
def test_any_input_gives_a_command_or_one_error_line(argv, env):
    env = {"MONODECODE_SERVE_PLATFORM": "rocm", "MONODECODE_MODEL": "m", **env}
    try:
        cmd, add = ep.command_for(argv, env)
    except ep.EntrypointError as e:
        line = ep._error_line(str(e))
        assert "\n" not in line and line.isascii() and len(line) < 2100
        event("error line")
        return
    event(f"command {cmd[0]}")
    assert all(isinstance(a, str) for a in cmd) and all(isinstance(v, str) for v in add.values())
    if cmd[:2] == ["vllm", "serve"]:
        # what vLLM gets passes the runtime's own validation
        assert MonoConfig.from_additional_config(additional(cmd)).exit_on_failstop is True


@settings(max_examples=150, deadline=None)
@given(argv=_argv, env=st.dictionaries(_field_vars, _texty.map(_clean), max_size=4))
def test_main_prints_json_or_one_error_line(argv, env):
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    environ = {"MONODECODE_SERVE_PLATFORM": "rocm", **env, "MONODECODE_ENTRYPOINT_PRINT": "1"}
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = ep.main(argv, environ)
    if code == 0:
        assert err.getvalue() == "" and set(json.loads(out.getvalue())) == {"argv", "env"}
    else:
        assert code == 2 and out.getvalue() == ""
        lines = err.getvalue().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ")


def test_serve_exits_70_when_a_worker_fail_stopped_although_vllm_exits_0(tmp_path):
    """vLLM's API server exits 0 when its engine dies; the container must still end with 70."""
    failstop_dir = tmp_path / "failstop"
    _fake_vllm(
        tmp_path / "bin",
        "import time\nfrom monodecode.runtime.failstop import FailStopEvent, FailStopRecorder\n"
        "e = FailStopEvent(rank=0, step=5, site='wait_timeout', layer=1, kernel='k2', time=time.time(), pid=9)\n"
        f"FailStopRecorder({str(failstop_dir)!r}, termination_log={str(tmp_path / 'tl')!r}, "
        "exit_on_failstop=False)._write_marker(e)",
    )
    proc = _serve(
        tmp_path / "bin",
        MONODECODE_SERVE_PLATFORM="rocm",
        MONODECODE_FAILSTOP_DIR=str(failstop_dir),
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
    )
    assert proc.returncode == 70, proc.stderr
    assert "fail-stop(s) recorded" in proc.stderr


def test_serve_with_mono_decode_off_keeps_vllms_exit_status(tmp_path):
    _fake_vllm(tmp_path / "bin", "import sys; sys.exit(5)")
    proc = _serve(tmp_path / "bin", MONODECODE_ENABLED="false", PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    assert proc.returncode == 5, proc.stderr
