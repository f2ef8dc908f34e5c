"""The chart derives from the runtime instead of re-describing it, and its helper scripts work.

- ``values.schema.json``'s ``monodecode`` block is generated from ``MonoConfig``
  (``monodecode.config_schema``, ``deploy/sync_chart.py``) and accepts what ``MonoConfig``
  accepts; every option reaches vLLM unchanged, with no per-option template code.
- ``files/serve-settings.json`` is ``SERVE_PAIRS["rocm"]`` (the default first), and
  ``vllm.attentionBackend``'s enum their backends.
- the ``gpu-access`` init container's check and the ``helm test`` script run for real here
  (``setpriv`` for a non-root user, ``sh`` + ``wget`` against a local HTTP server).
"""

from __future__ import annotations

import http.server
import json
import math
import shutil
import subprocess
import sys
import threading
from dataclasses import fields
from pathlib import Path

import jsonschema
import pytest
import yaml
from helm_test_pod import run_helm_test_pod
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_helm_chart import CHART, REPO, arg_after, one, render

sys.path.insert(0, str(REPO / "deploy"))
import sync_chart  # noqa: E402  (deploy/sync_chart.py, the generator)

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
BLOCK = SCHEMA["properties"]["monodecode"]


# ---- one source for every option -----------------------------------------------------------------


def test_generated_chart_files_are_in_sync():
    assert sync_chart.stale() == [], "run: python deploy/sync_chart.py"


def test_sync_check_notices_a_stale_schema(tmp_path, monkeypatch):
    """--check fails (and writes nothing) when the schema block differs from MonoConfig's."""
    stale_schema = json.loads(json.dumps(SCHEMA))
    del stale_schema["properties"]["monodecode"]["properties"]["warmup_rtol"]
    path = tmp_path / "values.schema.json"
    path.write_text(json.dumps(stale_schema, indent=2) + "\n")
    monkeypatch.setattr(sync_chart, "SCHEMA", path)
    before = path.read_text()
    assert sync_chart.main(["--check"]) == 1
    assert path.read_text() == before
    assert sync_chart.main([]) == 0 and sync_chart.stale() == []


def test_schema_block_is_every_mono_config_option_but_the_charts_own():
    from monodecode.config import MonoConfig

    options = {f.name for f in fields(MonoConfig)}
    assert set(sync_chart.CHART_OWNED) <= options
    assert set(BLOCK["properties"]) == options - set(sync_chart.CHART_OWNED)
    assert BLOCK["additionalProperties"] is False


def test_values_defaults_are_mono_configs():
    """values.yaml restates MonoConfig's defaults (for the reader); only `enabled` differs, on purpose."""
    from monodecode.config import MonoConfig

    chart = yaml.safe_load((CHART / "values.yaml").read_text())["monodecode"]
    runtime = MonoConfig().to_dict()
    differ = {k for k, v in chart.items() if v != runtime[k]}
    assert differ == {"enabled"}, {k: (chart[k], runtime[k]) for k in differ}
    assert sorted(chart) == BLOCK["required"]


def _non_default(name: str, schema: dict, default):
    """A valid value of the option other than its default."""
    if "enum" in schema:
        return next(v for v in schema["enum"] if v != default)
    kind = schema["type"] if isinstance(schema["type"], str) else next(t for t in schema["type"] if t != "null")
    if kind == "boolean":
        return not default
    if kind == "integer":
        lo, hi = schema.get("minimum", 0), schema.get("maximum", 10**6)
        return next(v for v in (lo + 1, lo, hi) if v != default and lo <= v <= hi)
    if kind == "number":
        return (default or 1) * 2 + 0.5
    if kind == "array":
        return [1, 3, 16]
    if kind == "string":
        return f"/opt/other/{name}"
    raise AssertionError(f"no non-default value for {name} ({schema})")


def test_every_option_reaches_vllm_unchanged(tmp_path):
    """Each MonoConfig option set in values arrives in --additional-config as MonoConfig reads it:
    the template names no option, so a new MonoConfig field needs no chart change."""
    from monodecode.config import MonoConfig

    defaults = MonoConfig().to_dict()
    chosen = {k: _non_default(k, s, defaults[k]) for k, s in BLOCK["properties"].items()}
    chosen["enabled"] = True  # the chart's default is already on; the non-default here is off
    chosen["on_refusal"] = "degrade"
    docs = render(tmp_path, {"monodecode": chosen})
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    mono = MonoConfig.from_additional_config(json.loads(arg_after(args, "--additional-config")))
    for key, value in chosen.items():
        assert mono.to_dict()[key] == value, key
    assert mono.failstop_dir == "/var/lib/monodecode/failstop"


def test_templates_name_no_mono_config_option():
    """Only the chart-owned failstop_dir and the cross-value checks' keys appear in templates."""
    from monodecode.config import MonoConfig

    text = "".join(p.read_text() for p in (CHART / "templates").rglob("*") if p.is_file())
    named = {f.name for f in fields(MonoConfig) if f"monodecode.{f.name}" in text or f'"{f.name}"' in text}
    assert named <= {"enabled", "on_refusal", "widths", "failstop_dir"}, named


# ---- the generated schema accepts exactly what MonoConfig accepts ------------------------------------

_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_json = st.recursive(
    _json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def _near(schema: dict):
    """Values near the option's constraints: enum members and misspellings, range edges, widths."""
    out = [None, True, 0, -1, 1, 0.5, "", " ", "a\x00b", "/x", [], [1], [1, 1], [2, 1], [0], [256], [257], [1.0]]
    out += list(schema.get("enum", [])) + [str(v).upper() for v in schema.get("enum", [])]
    for key in ("minimum", "maximum", "exclusiveMinimum"):
        if key in schema:
            out += [schema[key] - 1, schema[key], schema[key] + 1, schema[key] + 0.5]
    return st.sampled_from(out)


def _through_helm(value):
    """What the pod receives: Helm holds numbers as float64 and toJson writes 1.0 as 1."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [_through_helm(v) for v in value]
    if isinstance(value, dict):
        return {k: _through_helm(v) for k, v in value.items()}
    return value


def _mono_config_accepts(key: str, value) -> bool:
    from monodecode.config import MonoConfig
    from monodecode.errors import ConfigError

    try:
        MonoConfig.from_dict({key: _through_helm(value)})
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("key", sorted(BLOCK["properties"]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_schema_agrees_with_mono_config(key, data):
    schema = BLOCK["properties"][key]
    value = data.draw(_near(schema) | _json)
    by_schema = jsonschema.Draft7Validator(schema).is_valid(value)
    by_runtime = _mono_config_accepts(key, value)
    if key == "widths" and by_schema and not by_runtime and isinstance(value, list):
        # the one rule JSON schema cannot express: ascending order (the chart template checks it)
        assert value != sorted(value)
        return
    if isinstance(value, float) and not math.isfinite(value):
        return
    assert by_schema == by_runtime, (
        f"{key}={value!r}: schema {'accepts' if by_schema else 'refuses'}, MonoConfig the opposite"
    )


def test_config_schema_refuses_an_unknown_validator(monkeypatch):
    from monodecode import config, config_schema
    from monodecode.errors import ConfigError

    def _odd(label, value):
        return value

    monkeypatch.setitem(config._VALIDATORS, "backend", _odd)
    with pytest.raises(ConfigError, match="option 'backend' uses validator _odd, which has no JSON schema"):
        config_schema.mono_config_schema()


def test_config_schema_cli():
    ok = subprocess.run(
        [sys.executable, "-m", "monodecode.config_schema", "--exclude", "failstop_dir", "--no-defaults"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert ok.returncode == 0, ok.stderr
    printed = json.loads(ok.stdout)
    assert "failstop_dir" not in printed["properties"] and "default" not in printed["properties"]["widths"]
    bad = subprocess.run(
        [sys.executable, "-m", "monodecode.config_schema", "--exclude", "widht"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == "error: config_schema: cannot exclude unknown option(s) widht"


def test_serve_settings_file_is_the_plugins():
    from monodecode.vllm_plugin.serving import SERVE_PAIRS, serve_settings

    got = json.loads((CHART / "files" / "serve-settings.json").read_text())
    assert (got["platform"], got["default"]) == ("rocm", serve_settings("rocm").attention_backend)
    want = {p.attention_backend: {"args": list(p.args), "env": p.env} for p in SERVE_PAIRS["rocm"]}
    assert got["pairs"] == want
    assert SCHEMA["properties"]["vllm"]["properties"]["attentionBackend"]["enum"] == list(want)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["vllm"]["attentionBackend"] == got["default"]


# ---- the security opt-out ------------------------------------------------------------------------


def test_unrestricted_opt_out_is_explicit(tmp_path):
    from test_helm_chart import restricted_violations

    values = {
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "privileged": True}
    }
    refused = render(tmp_path, values, check=False)
    assert refused.returncode != 0 and "at '/securityContext/privileged': value must be false" in refused.stderr
    docs = render(tmp_path, {**values, "allowUnrestrictedSecurityContext": True})
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert "vllm: privileged" in restricted_violations(pod)


# ---- the gpu-access init container --------------------------------------------------------------

CHECK = CHART / "files" / "gpu-access-check.py"


def test_init_container_runs_the_check_with_the_pods_gpus_and_security(tmp_path):
    from test_helm_chart import restricted_violations

    docs = render(tmp_path, {"vllm": {"tensorParallelSize": 2}, "monodecode": {"on_refusal": "degrade"}})
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == "gpu-access" and init["command"] == ["python3", "-c", CHECK.read_text()]
    assert init["image"] == pod["containers"][0]["image"]
    assert init["resources"]["limits"]["amd.com/gpu"] == "2" == init["resources"]["requests"]["amd.com/gpu"]
    assert init["securityContext"] == pod["containers"][0]["securityContext"]
    assert restricted_violations(pod) == []
    off = one(render(tmp_path, {"rocm": {"checkDeviceAccess": False}}), "Deployment")
    assert "initContainers" not in off["spec"]["template"]["spec"]


def _run_check_as(uid: int, groups: list[int], devices: list[Path], log: Path) -> subprocess.CompletedProcess:
    python = "/usr/bin/python3"
    if not Path(python).is_file() or not shutil.which("setpriv"):
        pytest.fail("the device check test needs /usr/bin/python3 and setpriv (util-linux)")
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={','.join(map(str, groups))}"]
    return subprocess.run(
        [*cmd, python, str(devices[0].parent / "check.py"), *map(str, devices)],
        capture_output=True,
        text=True,
        env={"TERMINATION_LOG": str(log)},
        timeout=30,
    )


@pytest.fixture
def fake_devices():
    """Device stand-ins owned by group 44 (mode 0660), like /dev/kfd on a node, plus the script, in
    a directory any user can traverse (pytest's own tmp_path is private to root)."""
    import os
    import tempfile

    if os.geteuid() != 0:
        pytest.fail("the device check test switches users with setpriv and needs root (the test machine runs as root)")
    d = Path(tempfile.mkdtemp(prefix="monodecode-dev-"))
    d.chmod(0o755)
    devices = [d / "kfd", d / "renderD128"]
    for dev in devices:
        dev.touch()
        os.chown(dev, 0, 44)
        dev.chmod(0o660)
    shutil.copy(CHECK, d / "check.py")
    (d / "check.py").chmod(0o644)
    log = d / "termination-log"
    log.touch()
    log.chmod(0o666)
    yield devices, log
    shutil.rmtree(d)


def test_device_check_passes_with_the_device_group(fake_devices):
    devices, log = fake_devices
    proc = _run_check_as(10001, [44, 109], devices, log)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("GPU device files open as uid 10001:")


def test_device_check_names_the_missing_group(fake_devices):
    devices, log = fake_devices
    proc = _run_check_as(10001, [109], devices, log)
    assert proc.returncode == 1
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"cannot open {devices[0]}: permission denied; it belongs to group 44")
    assert "rocm.deviceGroups" in line
    assert log.read_text().strip() == line


def test_device_check_without_a_gpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(CHECK), str(tmp_path / "kfd")],
        capture_output=True,
        text=True,
        env={"TERMINATION_LOG": str(tmp_path / "log")},
    )
    assert proc.returncode == 1 and proc.stderr.startswith("no /dev/kfd in the container: the pod got no AMD GPU")


# ---- the helm test pod ----------------------------------------------------------------------------

SCRIPT = CHART / "files" / "helm-test.sh"


def test_helm_test_requires_what_verify_requires():
    from monodecode_ops.commands.verify import REQUIRED_SERIES

    line = next(x for x in SCRIPT.read_text().splitlines() if x.startswith("required="))
    assert line.split("=", 1)[1].strip('"').split() == list(REQUIRED_SERIES)


def test_helm_test_pod_gets_the_release_scheduling_and_a_deadline(tmp_path):
    values = {
        "tolerations": [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"pool": "inference"},
        "priorityClassName": "serving",
        "imagePullSecrets": [{"name": "regcred"}],
        "tests": {"timeoutSeconds": 45, "startupSeconds": 600, "image": "registry.local/busybox:1.36.1"},
    }
    spec = one(render(tmp_path, values), "Pod", "-verify")["spec"]
    assert spec["tolerations"] == values["tolerations"] and spec["nodeSelector"] == values["nodeSelector"]
    assert spec["priorityClassName"] == "serving" and spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["activeDeadlineSeconds"] == 645
    (c,) = spec["containers"]
    assert c["image"] == "registry.local/busybox:1.36.1" and c["command"][-1] == "45"
    assert "affinity" not in spec, "the test pod needs no GPU node"


class _Pod:
    """The HTTP surface `helm test` talks to: /health, /metrics and /v1/completions, with the
    runtime's own MonoMetrics behind /metrics. A completion counts its decode steps as the
    runner would for `state` (mono, refused = degraded with a refusal reason, disabled), and is
    refused without the bearer key when one is set (as vLLM does under /v1)."""

    def __init__(self, state: str = "mono", api_key: str = "", model: str = "Qwen/Qwen3-8B"):
        from prometheus_client import CollectorRegistry

        from monodecode.metrics import MonoMetrics

        self.registry = CollectorRegistry()
        self.metrics = MonoMetrics(registry=self.registry)
        self.metrics.set_enabled(state == "mono")
        if state == "refused":
            self.metrics.set_refusals(["tp_size"])
        self.state, self.api_key, self.model = state, api_key, model
        self.requests: list[dict] = []

    def complete(self, body: dict) -> None:
        self.requests.append(body)
        self.metrics.count_step("fallback", "prefill")
        for _ in range(body["max_tokens"] - 1):
            if self.state == "mono":
                self.metrics.count_step("mono")
            else:
                self.metrics.count_step("fallback", "degraded" if self.state == "refused" else "disabled")


class _Handler(http.server.BaseHTTPRequestHandler):
    pod: _Pod

    def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 (http.server's name)
        from prometheus_client import generate_latest

        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/metrics":
            self._send(200, generate_latest(self.pod.registry), "text/plain; version=0.0.4")
        else:
            self._send(404, b"")

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.pod.api_key and self.headers.get("Authorization") != f"Bearer {self.pod.api_key}":
            return self._send(401, b'{"error": "Unauthorized"}', "application/json")
        if self.path != "/v1/completions" or body.get("model") != self.pod.model:
            return self._send(404, b'{"error": "no such model"}', "application/json")
        self.pod.complete(body)
        self._send(200, json.dumps({"choices": [{"text": " Paris"}]}).encode(), "application/json")

    def log_message(self, *args):
        pass


@pytest.fixture
def pod_server():
    """Start a _Pod on 127.0.0.1; yields a function (pod -> base URL)."""
    servers = []

    def start(pod: _Pod) -> str:
        handler = type("Handler", (_Handler,), {"pod": pod})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()


def _run_helm_test(tmp_path, base: str, values: dict, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_helm_test_pod(render(tmp_path, values), base, tmp_path, env)


def test_helm_test_sends_a_completion_and_sees_mono_steps(tmp_path, pod_server):
    pod = _Pod("mono")
    proc = _run_helm_test(tmp_path, pod_server(pod), {"tests": {"timeoutSeconds": 20}})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("PASS:") and "mono decode ran 7 decode steps" in proc.stdout, proc.stdout
    (request,) = pod.requests
    assert request["model"] == "Qwen/Qwen3-8B" and request["max_tokens"] == 8


def test_helm_test_fails_when_the_completion_ran_on_stock_decode(tmp_path, pod_server):
    """on_refusal raise expects mono steps: a pod that serves stock decode fails, saying why."""
    proc = _run_helm_test(tmp_path, pod_server(_Pod("refused")), {"tests": {"timeoutSeconds": 20}})
    assert proc.returncode == 1
    assert "no decode step ran mono decode (monodecode_enabled 0; refusal: tp_size; fallback steps:" in proc.stderr
    assert "degraded=7" in proc.stderr and "prefill=1" in proc.stderr


def test_helm_test_accepts_a_refusal_with_degrade_and_stock_with_mono_off(tmp_path, pod_server):
    degrade = {"monodecode": {"on_refusal": "degrade"}, "tests": {"timeoutSeconds": 20}}
    proc = _run_helm_test(tmp_path, pod_server(_Pod("refused")), degrade)
    assert proc.returncode == 0, proc.stderr
    assert "mono decode refused at start-up (tp_size), which monodecode.on_refusal degrade allows" in proc.stdout
    # degrade with no refusal reason exported is not an expected fallback
    proc = _run_helm_test(tmp_path, pod_server(_Pod("disabled")), degrade)
    assert proc.returncode == 1 and "no refusal reason is exported" in proc.stderr
    off = {"monodecode": {"enabled": False}, "tests": {"timeoutSeconds": 20}}
    proc = _run_helm_test(tmp_path, pod_server(_Pod("disabled")), off)
    assert proc.returncode == 0 and "on stock decode, as configured" in proc.stdout, proc.stderr
    proc = _run_helm_test(tmp_path, pod_server(_Pod("mono")), off)
    assert proc.returncode == 1 and "but monodecode.enabled is false" in proc.stderr


def test_helm_test_sends_the_api_key_and_the_served_name(tmp_path, pod_server):
    values = {
        "apiKey": {"existingSecret": "llm-key"},
        "model": {"servedName": 'q "8b"'},
        "tests": {"timeoutSeconds": 20},
    }
    pod = _Pod("mono", api_key="secret-key", model='q "8b"')
    proc = _run_helm_test(tmp_path, pod_server(pod), values)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # without the key (the Secret not mounted) the completion is refused, and the message says so
    proc = _run_helm_test(tmp_path, pod_server(pod), values, env={"API_KEY": ""})
    assert proc.returncode == 1 and "an API key is required: apiKey.existingSecret" in proc.stderr


def test_helm_test_waits_then_names_the_missing_series(tmp_path, pod_server):
    pod = _Pod("mono")
    pod.registry = __import__("prometheus_client").CollectorRegistry()  # a pod without the plugin's series
    proc = _run_helm_test(tmp_path, pod_server(pod), {"tests": {"timeoutSeconds": 10}})
    assert proc.returncode == 1
    assert "lacks monodecode_enabled monodecode_steps_total monodecode_fallback_steps_total" in proc.stderr
    assert "gave up after 10s" in proc.stderr and not pod.requests


def test_helm_test_fails_when_nothing_answers(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _run_helm_test(tmp_path, f"http://127.0.0.1:{port}", {"tests": {"timeoutSeconds": 10}})
    assert proc.returncode == 1 and "does not answer; gave up after 10s" in proc.stderr
