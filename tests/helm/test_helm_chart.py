"""The Helm chart, with the real helm v4 binary (scripts/toolchains.d/30-helm.sh).

`helm lint --strict`; `helm template` over a matrix of values with every rendered manifest
validated strictly (Kubernetes 1.30 schemas bundled in kubernetes-validate, offline; the
Prometheus-operator CRD models with extra fields forbidden) and its content checked; bad values
rejected with a message naming the key; the alert rules and dashboard shipped in the chart are
the bytes of deploy/ (one source of truth).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import typing
from pathlib import Path

import pydantic
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "vllm-monodecode"
RULES_SRC = REPO / "deploy" / "prometheus" / "monodecode-alerts.yaml"
DASHBOARD_SRC = REPO / "deploy" / "grafana" / "monodecode.json"
# where a team would host deploy/RUNBOOK.md (required with the rules: runbook_url is absolute)
RUNBOOK_URL = "https://git.example.com/ml/monodecode/blob/main/deploy/RUNBOOK.md"
# the chart's own files (not links): generated serve settings, the init container's and helm test's scripts
CHART_OWN_FILES = ("serve-settings.json", "gpu-access-check.py", "helm-test.sh")
K8S_VERSION = "1.30.0"
MONITORING_APIS = [f"monitoring.coreos.com/v1/{k}" for k in ("ServiceMonitor", "PodMonitor", "PrometheusRule")]
# Physical and virtual functions, as the AMD GPU operator's node-feature rule lists them
# (ROCm/gpu-operator helm-charts-k8s/templates/gpu-nfd-default-rule.yaml); 75a8 is not an id there.
DEVICE_IDS = {
    "gfx942": ["74a1", "74a9", "74a5", "74a0", "74a2", "74a8", "74b5", "74bd", "74b6", "74bc", "74b9"],
    "gfx950": ["75a0", "75a3", "75b0", "75b3"],
}
SPX = {"key": "amd.com/compute-memory-partition", "operator": "In", "values": ["spx_nps1"]}


def helm_bin() -> str:
    found = os.environ.get("MONODECODE_HELM") or str(REPO / ".tools" / "bin" / "helm")
    if not Path(found).is_file():
        found = shutil.which("helm") or ""
    if not found:
        pytest.fail("helm is not installed: run scripts/toolchains.d/30-helm.sh .venv (make test does)")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    # No cluster: a kubeconfig that does not exist, so helm never reaches out to an API server.
    env = {**os.environ, "KUBECONFIG": str(REPO / ".tools" / "no-cluster.kubeconfig")}
    proc = subprocess.run(
        [helm_bin(), *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env
    )
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def render(
    tmp_path: Path, values: dict, *, apis: list[str] = MONITORING_APIS, namespace: str = "llm", check: bool = True
) -> list[dict] | subprocess.CompletedProcess:
    vf = tmp_path / "values.yaml"
    vf.write_text(yaml.safe_dump(values))
    args = ["template", "rel", str(CHART), "-n", namespace, "-f", str(vf), "--include-crds"]
    for api in apis:
        args += ["--api-versions", api]
    proc = helm(*args, check=check)
    if not check:
        return proc
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind}*{name_suffix}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


# ---- strict validation -------------------------------------------------------------------------

# Custom resources: cloudcoil's pydantic models where installed (Prometheus operator: a test
# dependency; KEDA: used when present), else a JSON schema of the fields the chart renders,
# shipped in crd_schemas/ (unknown fields refused either way).
CRD_MODEL_MODULES = {
    "monitoring.coreos.com/v1": "cloudcoil.models.prometheus_operator.v1",
    "keda.sh/v1alpha1": "cloudcoil.models.keda.v1alpha1",
}
CRD_SCHEMAS = Path(__file__).resolve().parent / "crd_schemas"
_CRD_MODELS: dict[tuple[str, str], type | None] = {}


def _nested_models(annotation) -> list[type]:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _nested_models(arg)]


def _forbid_extra(model: type, done: set[type]) -> None:
    """cloudcoil's models allow extra fields; forbid them on every model reachable from `model`
    and rebuild leaves first (a parent's schema embeds its children's as they were built)."""
    if model in done:
        return
    done.add(model)
    for field in model.model_fields.values():
        for child in _nested_models(field.annotation):
            _forbid_extra(child, done)
    model.model_config["extra"] = "forbid"
    model.model_rebuild(force=True)


def crd_model(api_version: str, kind: str) -> type | None:
    """The strict cloudcoil model of a custom resource kind, or None when its package is absent."""
    key = (api_version, kind)
    if key not in _CRD_MODELS:
        import importlib

        module_name = CRD_MODEL_MODULES.get(api_version)
        try:
            module = importlib.import_module(module_name) if module_name else None
        except ModuleNotFoundError:
            module = None
        model = getattr(module, kind, None)
        if model is not None:
            _forbid_extra(model, set())
        _CRD_MODELS[key] = model
    return _CRD_MODELS[key]


def crd_models() -> dict[str, type]:
    """The Prometheus-operator kinds' strict models (a required test dependency)."""
    kinds = {k: crd_model("monitoring.coreos.com/v1", k) for k in ("ServiceMonitor", "PodMonitor", "PrometheusRule")}
    assert all(kinds.values()), "cloudcoil-models-prometheus-operator is a test dependency (pyproject.toml)"
    return kinds


def crd_schema(api_version: str, kind: str) -> dict | None:
    path = CRD_SCHEMAS / f"{api_version.replace('/', '_')}_{kind}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def validate_strict(doc: dict) -> None:
    import jsonschema
    import kubernetes_validate

    kind, api = doc["kind"], doc["apiVersion"]
    name = doc["metadata"]["name"]
    model = crd_model(api, kind)
    if model is not None:
        try:
            model.model_validate(doc)
        except pydantic.ValidationError as e:
            pytest.fail(f"{kind}/{name} does not match the {kind} CRD: {e}")
        return
    schema = crd_schema(api, kind)
    if schema is not None:
        error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(doc))
        if error is not None:
            pytest.fail(f"{kind}/{name} does not match the {kind} CRD schema at {error.json_path}: {error.message}")
        return
    assert "." not in api.split("/")[0] or api.split("/")[0].endswith(".k8s.io"), f"no CRD model or schema for {api}"
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = "/".join(str(p) for p in e.path)
        pytest.fail(f"{kind}/{name} is not a valid Kubernetes {K8S_VERSION} object at {path}: {e.message}")


def test_validators_reject_what_they_should():
    """The strict validators themselves fail on an unknown field (so a pass means something)."""
    import kubernetes_validate

    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "bogus": 1}, "data": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    sm = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "x"},
        "spec": {"selector": {}, "endpoints": [{"port": "http", "scrapeInterval": "30s"}]},
    }
    with pytest.raises(pydantic.ValidationError):
        crd_models()["ServiceMonitor"].model_validate(sm)
    sm["spec"]["endpoints"][0] = {"port": "http", "interval": "30s"}
    crd_models()["ServiceMonitor"].model_validate(sm)
    for bad in (
        dict(sm, metadata={"name": "x", "lables": {}}),
        dict(
            sm, spec={"selector": {}, "endpoints": [{"port": "http", "relabelings": [{"action": "keep", "regx": "a"}]}]}
        ),
    ):
        with pytest.raises(pydantic.ValidationError):
            crd_models()["ServiceMonitor"].model_validate(bad)
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "x"},
        "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "1", "for": "1m"}]}]},
    }
    crd_models()["PrometheusRule"].model_validate(rule)
    rule["spec"]["groups"][0]["rules"][0]["pending"] = "1m"
    with pytest.raises(pydantic.ValidationError):
        crd_models()["PrometheusRule"].model_validate(rule)


def test_kubernetes_schemas_are_bundled_offline():
    """kubernetes-validate ships the 1.30 strict schemas and validates with no network at all
    (CI cannot reach a schema host): run its CLI in an empty network namespace."""
    import kubernetes_validate

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    assert (root / "v1.30.0-local-strict").is_dir(), sorted(p.name for p in root.iterdir())
    cli = [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k", K8S_VERSION, "-"]
    isolate = ["unshare", "-n"]
    if not shutil.which("unshare") or subprocess.run([*isolate, "true"], capture_output=True).returncode != 0:
        isolate = []  # no permission for a network namespace: the bundled-schema check above stands
    good = "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {ports: [{port: 80}]}\n"
    for doc, ok in ((good, True), (good.replace("{name: x}", "{name: x, bogus: 1}"), False)):
        proc = subprocess.run([*isolate, *cli], input=doc, capture_output=True, text=True, timeout=60)
        assert (proc.returncode == 0) is ok, proc.stdout + proc.stderr


# ---- the restricted Pod Security Standard ------------------------------------------------------

RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod_spec: dict) -> list[str]:
    """The checks of Kubernetes' "restricted" Pod Security Standard that apply to our pods."""
    bad = []
    psc = pod_spec.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(flag):
            bad.append(f"{flag} is set")
    for v in pod_spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            bad.append(f"volume {v['name']} uses {sorted(kinds - RESTRICTED_VOLUME_TYPES)}")
    seccomp_pod = psc.get("seccompProfile", {}).get("type")
    for c in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation is not false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            bad.append(f"{name}: capabilities do not drop ALL")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities")
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            bad.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: runs as uid 0")
        if sc.get("seccompProfile", {}).get("type", seccomp_pod) not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile is not RuntimeDefault/Localhost")
        for p in c.get("ports", []):
            if p.get("hostPort"):
                bad.append(f"{name}: hostPort")
    return bad


def test_restricted_check_catches_violations():
    spec = {"containers": [{"name": "c", "securityContext": {}}], "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}
    found = "\n".join(restricted_violations(spec))
    for expected in ("hostPath", "allowPrivilegeEscalation", "drop ALL", "runAsNonRoot", "seccompProfile"):
        assert expected in found


# ---- lint --------------------------------------------------------------------------------------


def test_helm_is_v4():
    assert helm("version", "--short").stdout.startswith("v4."), "the chart is tested with helm v4"


@pytest.mark.parametrize("values_file", [None, *sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))])
def test_lint_strict(values_file):
    args = ["lint", "--strict", str(CHART)]
    if values_file:
        args += ["-f", str(CHART / "ci" / values_file)]
    proc = helm(*args, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out
    assert "0 chart(s) failed" in out


# ---- the matrix ----------------------------------------------------------------------------------

MATRIX = list(itertools.product(("gfx942", "gfx950"), (1, 2, 8), (False, True), ("raise", "degrade"), ("hf", "pvc")))


def matrix_values(arch, tp, monitoring, on_refusal, source) -> dict:
    values = {
        "arch": arch,
        "vllm": {"tensorParallelSize": tp},
        "monodecode": {"on_refusal": on_refusal},
        "monitoring": {"serviceMonitor": {"enabled": monitoring, "labels": {"release": "prom"}}},
        "prometheusRule": {"enabled": monitoring, "runbookBaseUrl": RUNBOOK_URL},
        "rulesConfigMap": {"enabled": monitoring},
        "grafanaDashboard": {"enabled": monitoring},
    }
    if source == "hf":
        values["model"] = {"source": "hf", "hf": {"id": "Qwen/Qwen3-8B", "tokenSecret": {"name": "hf-token"}}}
    else:
        values["model"] = {"source": "pvc", "pvc": {"claimName": "models", "path": "qwen3-8b"}}
    return values


def arg_after(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


@pytest.mark.parametrize(
    "arch,tp,monitoring,on_refusal,source",
    MATRIX,
    ids=["-".join(map(str, m)).replace("True", "mon").replace("False", "nomon") for m in MATRIX],
)
def test_template_matrix(tmp_path, arch, tp, monitoring, on_refusal, source):
    from monodecode.config import MonoConfig
    from monodecode.vllm_plugin.serving import serve_settings

    values = matrix_values(arch, tp, monitoring, on_refusal, source)
    if tp > 1 and on_refusal == "raise":
        proc = render(tmp_path, values, check=False)
        assert proc.returncode != 0, "TP > 1 with on_refusal raise always crash-loops: it must not render"
        assert f"vllm.tensorParallelSize {tp} with monodecode.on_refusal raise always crash-loops" in proc.stderr
        return
    docs = render(tmp_path, values)
    for doc in docs:
        validate_strict(doc)
        assert doc["metadata"].get("namespace") == "llm", f"{doc['kind']} outside the release namespace"

    dep = one(docs, "Deployment")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    (c,) = pod["containers"]

    # GPUs = TP size; the image and the nodes are the arch's
    for kind in ("requests", "limits"):
        assert c["resources"][kind]["amd.com/gpu"] == str(tp)
    assert c["image"] == f"vllm-monodecode:0.1.0-{arch}"
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == [
        {"matchExpressions": [{"key": "amd.com/gpu.device-id", "operator": "In", "values": DEVICE_IDS[arch]}, SPX]}
    ]

    # vLLM arguments, and the mono decode options as MonoConfig reads them
    args = c["args"]
    assert "command" not in c and args[0] == "serve", "the image's entrypoint runs vllm serve"
    assert arg_after(args, "--tensor-parallel-size") == str(tp)
    mono = MonoConfig.from_additional_config(json.loads(arg_after(args, "--additional-config")))
    assert mono.enabled and mono.on_refusal == on_refusal and mono.widths == (1, 2, 4, 8) and not mono.allow_jit
    # the attention backend + KV layout pair mono decode supports on ROCm, exactly
    serve = serve_settings("rocm")
    backend_flag = serve.args[0]
    assert [args[i : i + 2] for i, a in enumerate(args) if a == backend_flag] == [list(serve.args)]
    env_values = {e["name"]: e.get("value") for e in c["env"]}
    assert {k: env_values.get(k) for k in serve.env} == serve.env
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["failstop"]["mountPath"] == mono.failstop_dir and "emptyDir" in volumes["failstop"]
    assert mounts["shm"]["mountPath"] == "/dev/shm" and volumes["shm"]["emptyDir"]["medium"] == "Memory"

    # model source
    env = {e["name"]: e for e in c["env"]}
    if source == "hf":
        assert args[1] == "Qwen/Qwen3-8B"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        assert env["HF_HOME"]["value"].startswith(mounts["model"]["mountPath"])
        assert not mounts["model"].get("readOnly")
    else:
        assert args[1] == "/models/qwen3-8b"
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert mounts["model"]["readOnly"] is True and env["HF_HUB_OFFLINE"]["value"] == "1"
        assert "HF_TOKEN" not in env

    # probes: startup covers weight load + warm-up; liveness/readiness only run after it
    sp = c["startupProbe"]
    assert sp["periodSeconds"] * sp["failureThreshold"] >= 1200 + 600
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["port"] == "http"
    assert set(pod["securityContext"]["supplementalGroups"]) >= {44, 109}

    # a PDB that lets a node drain proceed; the helm test hook
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    test_pod = one(docs, "Pod", "-verify")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert restricted_violations(test_pod["spec"]) == []
    svc = one(docs, "Service")
    command = test_pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["sh", "-c"] and command[3:] == [
        "helm-test",
        f"http://{svc['metadata']['name']}.llm.svc:{svc['spec']['ports'][0]['port']}",
        args[1],  # the model vLLM serves under (no --served-model-name here)
        "mono" if on_refusal == "raise" else "mono-or-refused",
        "120",
    ]
    assert test_pod["spec"]["activeDeadlineSeconds"] == 120 + 300
    assert "busybox" in test_pod["spec"]["containers"][0]["image"]

    monitoring_kinds = {"ServiceMonitor", "PrometheusRule"}
    kinds = {d["kind"] for d in docs}
    if monitoring:
        assert monitoring_kinds <= kinds
        sm = one(docs, "ServiceMonitor")
        assert sm["metadata"]["labels"]["release"] == "prom"
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
        assert_targets_carry_the_alert_label(sm, dep)
        dash = one(docs, "ConfigMap", "-dashboard")
        assert json.loads(dash["data"]["monodecode.json"]) == json.loads(DASHBOARD_SRC.read_text())
        assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    else:
        assert not monitoring_kinds & kinds
        assert not [d for d in by_kind(docs, "ConfigMap")]


def labelmap_of_pod_labels(labels: dict) -> dict:
    """Pod labels as Prometheus target labels (`labelmap` of __meta_kubernetes_pod_label_(.+),
    and the operator's podTargetLabels): every character outside [a-zA-Z0-9_] becomes '_'."""
    import re

    return {re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in labels.items()}


def alert_target_selector() -> dict:
    """The equality matchers MonodecodeMetricsAbsent selects scrape targets (`up`) by."""
    import re

    rules = {r.get("alert"): r for g in yaml.safe_load(RULES_SRC.read_text())["groups"] for r in g["rules"]}
    expr = rules["MonodecodeMetricsAbsent"]["expr"]
    selectors = set(re.findall(r"up\{([^}]*)\}", expr))
    assert len(selectors) == 1, f"MonodecodeMetricsAbsent selects up{{...}} in more than one way: {selectors}"
    matchers = dict(re.findall(r'([a-zA-Z_]+)="([^"]*)"', selectors.pop()))
    assert "job" not in matchers, "select on a label the chart controls, not the scrape job"
    return matchers


def assert_targets_carry_the_alert_label(monitor: dict, deployment: dict) -> None:
    """The monitor copies the pod label the alert rules select on onto every scraped series."""
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    copied = {k: v for k, v in pod_labels.items() if k in monitor["spec"].get("podTargetLabels", [])}
    assert labelmap_of_pod_labels(copied).items() >= alert_target_selector().items(), (
        f"{monitor['kind']} does not put {alert_target_selector()} on the targets (podTargetLabels {copied})"
    )


def test_pod_monitor_targets_carry_the_alert_label(tmp_path):
    docs = render(tmp_path, yaml.safe_load((CHART / "ci" / "pvc-degrade-values.yaml").read_text()))
    assert_targets_carry_the_alert_label(one(docs, "PodMonitor"), one(docs, "Deployment"))
    validate_strict(one(docs, "PodMonitor"))


def test_rolling_update_never_surges(tmp_path):
    docs = render(tmp_path, {"rollout": {"strategy": "RollingUpdate", "maxUnavailable": 1}, "replicaCount": 3})
    strategy = one(docs, "Deployment")["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def test_monodecode_off_renders_stock_vllm_without_rules(tmp_path):
    docs = render(
        tmp_path,
        {"monodecode": {"enabled": False}, "prometheusRule": {"enabled": True}, "rulesConfigMap": {"enabled": True}},
    )
    from monodecode.vllm_plugin.serving import serve_settings

    c = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    args = c["args"]
    # explicit: the image's entrypoint turns mono decode on unless told otherwise
    assert json.loads(arg_after(args, "--additional-config"))["monodecode"]["enabled"] is False
    assert not by_kind(docs, "PrometheusRule") and not by_kind(docs, "ConfigMap")
    # stock vLLM picks its own attention backend and KV layout
    serve = serve_settings("rocm")
    assert serve.args[0] not in args and not set(serve.env) & {e["name"] for e in c["env"]}


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "ROCM_AITER_UNIFIED_ATTN"])
def test_another_attention_pair_is_selectable(tmp_path, backend):
    """The default is AMD's recommended setting (AITER on, ROCM_AITER_FA); vllm.attentionBackend
    selects another pair, with its own layout and AITER setting (TRITON_ATTN: AITER left off)."""
    from monodecode.vllm_plugin.serving import serve_settings

    c = one(render(tmp_path, {"vllm": {"attentionBackend": backend}}), "Deployment")["spec"]["template"]["spec"]
    (c,) = c["containers"]
    pair = serve_settings("rocm", backend)
    assert arg_after(c["args"], "--attention-backend") == backend
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert {k: env.get(k) for k in ("VLLM_KV_CACHE_LAYOUT", "VLLM_ROCM_USE_AITER")} == {
        "VLLM_KV_CACHE_LAYOUT": pair.kv_cache_layout,
        "VLLM_ROCM_USE_AITER": pair.env.get("VLLM_ROCM_USE_AITER"),
    }


def test_an_attention_backend_without_a_pair_is_one_error(tmp_path):
    proc = render(tmp_path, {"vllm": {"attentionBackend": "ROCM_ATTN"}}, check=False)
    assert proc.returncode != 0 and "attentionBackend" in proc.stderr and "ROCM_AITER_FA" in proc.stderr, proc.stderr


def test_overrides_reach_the_pod(tmp_path):
    digest = "sha256:" + "ab" * 32
    docs = render(
        tmp_path,
        {
            "arch": "gfx950",
            "image": {"repository": "registry.local/mono", "digests": {"gfx950": digest}},
            "nodeSelection": {
                "deviceIds": {"gfx950": ["75a3"]},
                "extraRequirements": [
                    {"key": "amd.com/compute-memory-partition", "operator": "In", "values": ["spx_nps1"]}
                ],
            },
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}
                    ]
                }
            },
            "monodecode": {
                "backend": "triton",
                "widths": [1, 4, 16],
                "allow_jit": True,
                "artifact_dir": "/opt/kernels",
            },
            "vllm": {"maxModelLen": 4096, "extraArgs": ["--enable-prefix-caching"]},
            "model": {"servedName": "qwen"},
            "probes": {"startup": {"weightLoadSeconds": 100, "warmupSeconds": 55, "periodSeconds": 10}},
            "rollout": {"progressDeadlineSeconds": 600},
            "rocm": {"deviceGroups": [44, 992]},
        },
    )
    dep = one(docs, "Deployment")
    validate_strict(dep)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == f"registry.local/mono@{digest}"
    exprs = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"
    ]
    assert exprs[0]["values"] == ["75a3"] and exprs[1:] == [SPX, SPX]
    assert "podAntiAffinity" in pod["affinity"]
    mono = json.loads(arg_after(c["args"], "--additional-config"))["monodecode"]
    assert mono["backend"] == "triton" and mono["widths"] == [1, 4, 16] and mono["allow_jit"] is True
    assert mono["artifact_dir"] == "/opt/kernels"
    assert arg_after(c["args"], "--max-model-len") == "4096" and c["args"][-1] == "--enable-prefix-caching"
    assert arg_after(c["args"], "--served-model-name") == "qwen"
    assert c["startupProbe"]["failureThreshold"] == 16  # ceil(155 / 10)
    assert pod["securityContext"]["supplementalGroups"] == [44, 992]


def test_hostpath_source_and_scrape_annotations(tmp_path):
    docs = render(tmp_path, yaml.safe_load((CHART / "ci" / "hostpath-annotations-values.yaml").read_text()))
    for doc in docs:
        validate_strict(doc)
    pod = one(docs, "Deployment")["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert {"name": "model", "hostPath": {"path": "/data/models/llama-3.1-8b", "type": "Directory"}} in pod["spec"][
        "volumes"
    ]
    # hostPath is the documented exception to the restricted standard
    assert restricted_violations(pod["spec"]) == ["volume model uses ['hostPath']"]
    # an annotation scrape job's pod labelmap gives the series the label the alert rules select on
    assert labelmap_of_pod_labels(pod["metadata"]["labels"]).items() >= alert_target_selector().items()


@pytest.mark.parametrize("values_file", sorted(p.name for p in (CHART / "ci").glob("*-values.yaml")))
def test_ci_scenarios_render_valid_manifests(tmp_path, values_file):
    docs = render(tmp_path, yaml.safe_load((CHART / "ci" / values_file).read_text()))
    assert by_kind(docs, "Deployment")
    for doc in docs:
        validate_strict(doc)


# ---- bad values: one clear message naming the key ---------------------------------------------

BAD_VALUES = [
    ({"arch": "gfx90a"}, "at '/arch': value must be one of 'gfx942', 'gfx950'"),
    ({"vllm": {"tensorParallelSize": 3}}, "at '/vllm/tensorParallelSize': value must be one of 1, 2, 4, 8"),
    ({"monodecode": {"on_refusal": "ignore"}}, "at '/monodecode/on_refusal': value must be one of 'raise', 'degrade'"),
    ({"monodecode": {"backend": "cuda"}}, "at '/monodecode/backend'"),
    ({"monodecode": {"widths": []}}, "at '/monodecode/widths'"),
    ({"monodecode": {"widths": [1, 1]}}, "at '/monodecode/widths'"),
    ({"monodecode": {"widths": [0]}}, "at '/monodecode/widths/0'"),
    ({"monodecode": {"widht": [1]}}, "at '/monodecode': additional properties 'widht' not allowed"),
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    ({"image": {"digests": {"gfx942": "sha256:xyz"}}}, "at '/image/digests/gfx942'"),
    ({"nodeSelection": {"deviceIds": {"gfx942": ["0x74a1"]}}}, "at '/nodeSelection/deviceIds/gfx942/0'"),
    ({"vllm": {"gpuMemoryUtilization": 1.5}}, "at '/vllm/gpuMemoryUtilization'"),
    ({"vllm": {"shmSize": "lots"}}, "at '/vllm/shmSize'"),
    ({"rollout": {"strategy": "BlueGreen"}}, "at '/rollout/strategy'"),
    ({"rollout": {"maxUnavailable": 0}}, "at '/rollout/maxUnavailable'"),
    ({"model": {"source": "s3"}}, "at '/model/source'"),
    (
        {"prometheusRule": {"alerts": {"MonodecodeFailstop": {"for": "soon"}}}},
        "at '/prometheusRule/alerts/MonodecodeFailstop/for'",
    ),
    ({"prometheusRule": {"alerts": {"MonodecodeFailstop": {"severity": "page"}}}}, "severity"),
    ({"monodecode": {"widths": None}}, "at '/monodecode': missing property 'widths'"),
    ({"monodecode": {"max_failstops": 0}}, "at '/monodecode/max_failstops'"),
    ({"monodecode": {"failstop_dir": "/tmp"}}, "additional properties 'failstop_dir' not allowed"),
    ({"monodecode": {"onRefusal": "degrade"}}, "additional properties 'onRefusal' not allowed"),
    ({"resources": {"requests": {"cpu": -8}}}, "at '/resources/requests/cpu': minimum: got -8, want 0"),
    ({"resources": {"requests": {"cpu": "-8"}}}, "at '/resources/requests/cpu'"),
    ({"resources": {"limits": {"memory": -1}}}, "at '/resources/limits/memory'"),
    # the restricted Pod Security Standard
    ({"podSecurityContext": {"runAsUser": 0}}, "at '/podSecurityContext/runAsUser': minimum: got 0, want 1"),
    ({"podSecurityContext": {"runAsUser": -1}}, "at '/podSecurityContext/runAsUser'"),
    ({"podSecurityContext": {"runAsNonRoot": False}}, "at '/podSecurityContext/runAsNonRoot': value must be true"),
    ({"podSecurityContext": {"runAsNonRoot": None}}, "at '/podSecurityContext': missing property 'runAsNonRoot'"),
    ({"podSecurityContext": {"runAsGroup": 0}}, "at '/podSecurityContext/runAsGroup'"),
    (
        {"podSecurityContext": {"seccompProfile": {"type": "Unconfined"}}},
        "at '/podSecurityContext/seccompProfile/type'",
    ),
    ({"podSecurityContext": {"sysctls": [{"name": "kernel.shm_rmid_forced", "value": "0"}]}}, "'sysctls' not allowed"),
    ({"securityContext": {"privileged": True}}, "at '/securityContext/privileged': value must be false"),
    ({"securityContext": {"allowPrivilegeEscalation": True}}, "at '/securityContext/allowPrivilegeEscalation'"),
    ({"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}, "at '/securityContext/capabilities/add'"),
    ({"securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}, "at '/securityContext/capabilities/drop'"),
    ({"securityContext": {"runAsUser": 0}}, "at '/securityContext/runAsUser'"),
    ({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}, "at '/securityContext/seccompProfile/type'"),
    ({"securityContext": {"foo": "bar"}}, "at '/securityContext': additional properties 'foo' not allowed"),
    ({"rocm": {"deviceGroups": [0]}}, "at '/rocm/deviceGroups/0': minimum: got 0, want 1"),
    ({"allowUnrestrictedSecurityContext": "yes"}, "at '/allowUnrestrictedSecurityContext'"),
    ({"tests": {"timeoutSeconds": 5}}, "at '/tests/timeoutSeconds'"),
    # checks across values, done by the templates
    ({"monodecode": {"widths": [4, 2]}}, "monodecode.widths must be ascending, got [4,2]"),
    ({"monodecode": {"widths": [1, 8, 4]}}, "monodecode.widths must be ascending, got [1,8,4]"),
    (
        {"vllm": {"tensorParallelSize": 2}},
        "vllm.tensorParallelSize 2 with monodecode.on_refusal raise always crash-loops: mono decode refuses tensor "
        "parallelism (tp_shards) until it lands; set monodecode.on_refusal=degrade",
    ),
    (
        {"model": {"source": "hf", "pvc": {"claimName": "models"}}},
        "model.pvc.claimName is set but model.source is hf, which ignores it",
    ),
    (
        {"model": {"source": "pvc", "pvc": {"claimName": "m"}, "hostPath": {"path": "/data/m"}}},
        "model.hostPath.path is set but model.source is pvc, which ignores it",
    ),
    (
        {"prometheusRule": {"additionalRuleLabels": {"severity": "info"}}},
        "prometheusRule.additionalRuleLabels.severity is set, but every alert keeps its own severity",
    ),
    (
        {"vllm": {"extraArgs": ["--attention-backend", "ROCM_ATTN"]}},
        "vllm.extraArgs sets --attention-backend, which the chart sets to",
    ),
    ({"vllm": {"extraArgs": ["--attention-backend=ROCM_ATTN"]}}, "vllm.extraArgs sets --attention-backend"),
    (
        {"env": [{"name": "VLLM_KV_CACHE_LAYOUT", "value": "NHD"}]},
        "env sets VLLM_KV_CACHE_LAYOUT, which the chart sets",
    ),
    ({"podLabels": {"app.kubernetes.io/part-of": "shop"}}, "podLabels must not set app.kubernetes.io/part-of"),
    # labels the chart sets: a second value for one key fails the install (duplicate keys)
    (
        {"podLabels": {"app.kubernetes.io/name": "x"}},
        "podLabels must not set app.kubernetes.io/name: the chart sets it to vllm-monodecode and selects its pods",
    ),
    ({"podLabels": {"app.kubernetes.io/instance": "x"}}, "podLabels must not set app.kubernetes.io/instance"),
    ({"podLabels": {"monodecode.io/arch": "gfx950"}}, "podLabels must not set monodecode.io/arch"),
    # every flag the chart sets itself, with the value that sets it
    (
        {"vllm": {"extraArgs": ["--tensor-parallel-size", "8"]}},
        "vllm.extraArgs sets --tensor-parallel-size, which the chart sets: use vllm.tensorParallelSize "
        "(the pod's GPU request follows it)",
    ),
    ({"vllm": {"extraArgs": ["-tp=8"]}}, "vllm.extraArgs sets -tp, which the chart sets: use vllm.tensorParallelSize"),
    ({"vllm": {"extraArgs": ["--tensor_parallel_size", "8"]}}, "use vllm.tensorParallelSize"),
    ({"vllm": {"extraArgs": ["--tensor-parallel", "8"]}}, "vllm.extraArgs sets --tensor-parallel (argparse reads "),
    ({"vllm": {"extraArgs": ["--port", "9999"]}}, "vllm.extraArgs sets --port, which the chart sets: use vllm.port"),
    ({"vllm": {"extraArgs": ["--host=127.0.0.1"]}}, "vllm.extraArgs sets --host, which the chart sets"),
    ({"vllm": {"extraArgs": ["--served-model-name", "q"]}}, "use model.servedName"),
    ({"vllm": {"extraArgs": ["--additional-config", "{}"]}}, "use the monodecode values block"),
    ({"vllm": {"extraArgs": ["--max-model-len=4096"]}}, "use vllm.maxModelLen"),
    ({"vllm": {"extraArgs": ["--gpu-memory-utilization", "0.5"]}}, "use vllm.gpuMemoryUtilization"),
    ({"vllm": {"extraArgs": ["--dtype", "half"]}}, "use vllm.dtype"),
    ({"vllm": {"extraArgs": ["--block-size", "32"]}}, "use vllm.blockSize"),
    ({"vllm": {"extraArgs": ["--max-num-seqs", "8"]}}, "use vllm.maxNumSeqs"),
    ({"vllm": {"extraArgs": ["--revision", "main"]}}, "use model.hf.revision"),
    ({"vllm": {"extraArgs": ["--model", "x"]}}, "use model.source"),
    ({"vllm": {"extraArgs": ["--pipeline-parallel-size", "2"]}}, "vllm.extraArgs sets --pipeline-parallel-size"),
    ({"vllm": {"extraArgs": ["-dp", "2"]}}, "vllm.extraArgs sets -dp"),
    # resources Kubernetes would refuse at apply time
    (
        {"resources": {"requests": {"memory": "256Gi"}}},
        "resources.requests.memory (256Gi) is more than resources.limits.memory (192Gi)",
    ),
    (
        {"resources": {"requests": {"cpu": 8, "memory": "1Gi"}, "limits": {"cpu": "7500m", "memory": "1024Mi"}}},
        "resources.requests.cpu (8) is more than resources.limits.cpu (7500m)",
    ),
    (
        {"resources": {"requests": {"memory": "1.5G"}, "limits": {"memory": "1400Mi"}}},
        "resources.requests.memory (1.5G) is more than resources.limits.memory (1400Mi)",
    ),
    (
        {"replicaCount": 2, "model": {"hf": {"cache": {"type": "create"}}}},
        "replicaCount 2 with one created model cache claim that is ReadWriteOnce: pods on other nodes cannot "
        "mount it; set model.hf.cache.accessModes to [ReadWriteMany] (a shared cache), or run one pod",
    ),
    (
        {"replicaCount": 3, "model": {"hf": {"cache": {"type": "create", "accessModes": ["ReadWriteOncePod"]}}}},
        "replicaCount 3 with one created model cache claim that is ReadWriteOncePod",
    ),
    (
        {"monitoring": {"podMonitor": {"enabled": True}, "scrapeAnnotations": True}},
        "monitoring.podMonitor.enabled and monitoring.scrapeAnnotations are both true: every series would be "
        "scraped twice; enable one",
    ),
    (
        {"monitoring": {"serviceMonitor": {"enabled": True}, "scrapeAnnotations": True}},
        "monitoring.serviceMonitor.enabled and monitoring.scrapeAnnotations are both true",
    ),
    # drains and rollouts
    (
        {"terminationGracePeriodSeconds": 30},
        "terminationGracePeriodSeconds (30) is shorter than lifecycle.preStopSleepSeconds (10) + "
        "lifecycle.drainSeconds (45) + 5 s for vLLM to stop: the pod would be killed mid-drain; raise it to 60",
    ),
    (
        {"rollout": {"maxSurge": 1}},
        "rollout.maxSurge is set but rollout.strategy is Recreate, which ignores it",
    ),
    ({"rollout": {"maxSurge": -1}}, "at '/rollout/maxSurge'"),
    ({"lifecycle": {"drainSeconds": "30s"}}, "at '/lifecycle/drainSeconds'"),
    (
        {"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]},
        "at '/topologySpreadConstraints/0': missing property 'topologyKey'",
    ),
    ({"vllm": {"extraArgs": ["--shutdown-timeout=0"]}}, "use lifecycle.drainSeconds"),
    (
        {
            "rollout": {"strategy": "RollingUpdate", "maxSurge": 1},
            "model": {"hf": {"cache": {"type": "create"}}},
        },
        "replicaCount 1 + rollout.maxSurge 1 with one created model cache claim that is ReadWriteOnce",
    ),
    # alerts link an absolute runbook URL
    (
        {"prometheusRule": {"enabled": True}},
        "prometheusRule.runbookBaseUrl is empty: set the absolute URL where deploy/RUNBOOK.md is served",
    ),
    ({"rulesConfigMap": {"enabled": True}}, "prometheusRule.runbookBaseUrl is empty"),
    ({"prometheusRule": {"runbookBaseUrl": "wiki/runbook"}}, "at '/prometheusRule/runbookBaseUrl'"),
    # control characters (one per kind of string; tests/helm/test_chart_values_safety.py has them all)
    ({"model": {"source": "hostPath", "hostPath": {"path": "/data\n- name: x"}}}, "at '/model/hostPath/path'"),
    ({"priorityClassName": "high\nhostNetwork: true"}, "at '/priorityClassName'"),
    ({"model": {"source": "pvc", "pvc": {"claimName": "Models"}}}, "at '/model/pvc/claimName'"),
    (
        {"resources": {"limits": {"amd.com/gpu": "2"}}},
        "resources.limits must not set amd.com/gpu: the GPU count comes from vllm.tensorParallelSize",
    ),
    ({"model": {"source": "pvc"}}, "model.pvc.claimName is empty"),
    ({"model": {"source": "hostPath"}}, "model.hostPath.path is empty"),
    ({"model": {"hf": {"cache": {"type": "pvc"}}}}, "model.hf.cache.claimName is empty"),
    ({"nodeSelection": {"deviceIds": {"gfx942": []}}}, "nodeSelection.deviceIds.gfx942 is empty"),
    (
        {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}},
        "conflicts with nodeSelection",
    ),
    ({"monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}, "enable one"),
    (
        {"rollout": {"progressDeadlineSeconds": 600}},
        "rollout.progressDeadlineSeconds (600) is shorter than the startup budget",
    ),
    (
        {
            "prometheusRule": {
                "enabled": True,
                "runbookBaseUrl": RUNBOOK_URL,
                "alerts": {"MonodecodeFallbackRatio": {"disabled": True}},
            }
        },
        "prometheusRule.alerts.MonodecodeFallbackRatio: no such alert (alerts: MonodecodeFallbackRatioHigh,",
    ),
]


@pytest.mark.parametrize("values,message", BAD_VALUES, ids=[m[:48] for _, m in BAD_VALUES])
def test_bad_values_are_rejected(tmp_path, values, message):
    proc = render(tmp_path, values, check=False)
    assert proc.returncode != 0, f"accepted bad values {values}"
    assert message in proc.stderr, proc.stderr
    assert "goroutine" not in proc.stderr and "panic" not in proc.stderr


def test_monitoring_without_the_operator_crds_says_how_to_fix(tmp_path):
    proc = render(tmp_path, {"monitoring": {"serviceMonitor": {"enabled": True}}}, apis=[], check=False)
    assert proc.returncode != 0
    assert (
        "monitoring.serviceMonitor.enabled is true but the cluster has no monitoring.coreos.com/v1 ServiceMonitor "
        "(install the Prometheus Operator CRDs, or with `helm template` pass --api-versions "
        "monitoring.coreos.com/v1/ServiceMonitor)"
    ) in proc.stderr


# ---- one source of truth for rules and dashboard ------------------------------------------------


def test_packaged_chart_carries_deploy_files_byte_for_byte(tmp_path):
    helm("package", str(CHART), "-d", str(tmp_path))
    (pkg,) = tmp_path.glob("vllm-monodecode-*.tgz")
    with tarfile.open(pkg) as tar:
        names = tar.getnames()
        got = {n: tar.extractfile(n).read() for n in names if n.startswith("vllm-monodecode/files/")}
    assert got == {
        "vllm-monodecode/files/monodecode-alerts.yaml": RULES_SRC.read_bytes(),
        "vllm-monodecode/files/monodecode-dashboard.json": DASHBOARD_SRC.read_bytes(),
        **{f"vllm-monodecode/files/{f}": (CHART / "files" / f).read_bytes() for f in CHART_OWN_FILES},
    }
    assert "vllm-monodecode/values.schema.json" in names and "vllm-monodecode/templates/NOTES.txt" in names
    # the packaged chart renders on its own (no link back into the repository)
    out = helm(
        "template",
        "rel",
        str(pkg),
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        f"prometheusRule.runbookBaseUrl={RUNBOOK_URL}",
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
    ).stdout
    rule = one([d for d in yaml.safe_load_all(io.StringIO(out)) if d], "PrometheusRule")
    rendered = yaml.safe_dump(rule["spec"]["groups"]).replace(RUNBOOK_URL, "deploy/RUNBOOK.md")
    assert yaml.safe_load(rendered) == yaml.safe_load(RULES_SRC.read_text())["groups"]


def test_chart_files_link_to_deploy():
    for link, target in (("monodecode-alerts.yaml", RULES_SRC), ("monodecode-dashboard.json", DASHBOARD_SRC)):
        path = CHART / "files" / link
        assert path.is_symlink(), f"{path} must be a link to {target} (one source of truth)"
        assert path.resolve() == target.resolve()


def test_rule_overrides_change_only_for_severity_labels_and_runbook(tmp_path):
    docs = render(
        tmp_path,
        {
            "prometheusRule": {
                "enabled": True,
                "runbookBaseUrl": "https://wiki.example.com/ops/monodecode-runbook",
                "additionalRuleLabels": {"team": "inference"},
                "alerts": {
                    "MonodecodeDisabled": {"disabled": True},
                    "MonodecodeFallbackRatioHigh": {"for": "2s", "severity": "critical"},
                },
            },
            "rulesConfigMap": {"enabled": True},
        },
    )
    src_rules = [r for g in yaml.safe_load(RULES_SRC.read_text())["groups"] for r in g["rules"]]
    src = {r["alert"]: r for r in src_rules if "alert" in r}
    spec_groups = one(docs, "PrometheusRule")["spec"]["groups"]
    cm_groups = yaml.safe_load(one(docs, "ConfigMap", "-rules")["data"]["monodecode-alerts.yaml"])["groups"]
    assert spec_groups == cm_groups
    rendered_rules = [r for g in spec_groups for r in g["rules"]]
    # recording rules pass through as written, in their place before the alerts
    assert [r for r in rendered_rules if "record" in r] == [r for r in src_rules if "record" in r]
    rendered = {r["alert"]: r for r in rendered_rules if "alert" in r}
    assert set(rendered) == set(src) - {"MonodecodeDisabled"}
    for name, r in rendered.items():
        s = src[name]
        assert r["expr"] == s["expr"], f"{name}: the chart must not change expressions"
        assert r["labels"]["team"] == "inference"
        assert r["annotations"]["runbook_url"] == s["annotations"]["runbook_url"].replace(
            "deploy/RUNBOOK.md", "https://wiki.example.com/ops/monodecode-runbook"
        )
        assert r["annotations"]["summary"] == s["annotations"]["summary"]
        if name == "MonodecodeFallbackRatioHigh":
            assert r["for"] == "2s" and r["labels"]["severity"] == "critical"
        else:
            assert r.get("for") == s.get("for") and r["labels"]["severity"] == s["labels"]["severity"]


def test_notes_render_with_the_release(tmp_path):
    proc = helm(
        "install",
        "rel",
        str(CHART),
        "-n",
        "llm",
        "--dry-run=client",
        "--set",
        "vllm.tensorParallelSize=8",
        "--set",
        "arch=gfx950",
        "--set",
        "monodecode.on_refusal=degrade",
    )
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "8 x amd.com/gpu each, arch gfx950" in notes
    assert "amd.com/gpu.device-id in (75a0, 75a3, 75b0, 75b3)" in notes
    assert "helm test rel -n llm --logs" in notes
    assert "up to 1800s" in notes
    assert '"on_refusal":"degrade"' in notes and "--attention-backend" in notes


# ---- the chart's arguments through the image's entrypoint ---------------------------------------

ENTRYPOINT = REPO / "images" / "build" / "entrypoint.py"


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"monodecode": {"enabled": False}},
        {
            "model": {"source": "pvc", "pvc": {"claimName": "m", "path": "llama"}},
            "vllm": {"tensorParallelSize": 8},
            "monodecode": {"on_refusal": "degrade", "artifact_dir": "/mnt/kernels", "widths": [1, 8]},
        },
    ],
    ids=["default", "mono-off", "pvc-degrade-artifacts"],
)
def test_pod_arguments_through_the_image_entrypoint(tmp_path, values):
    """What the container runs: the image's entrypoint (dry run) turns the chart's args into
    `vllm serve` with the options MonoConfig accepts, the image's artifact dir filled in."""
    from monodecode.config import MonoConfig

    assert ENTRYPOINT.is_file(), f"{ENTRYPOINT.relative_to(REPO)} (the image's entrypoint the chart runs) is missing"
    c = one(render(tmp_path, values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {
        "PATH": os.environ.get("PATH", ""),
        "MONODECODE_ENTRYPOINT_PRINT": "1",
        "MONODECODE_ARTIFACT_DIR": "/opt/monodecode/artifacts",
        # what the ROCm image's torch makes the entrypoint detect (this venv's torch is CPU-only)
        "MONODECODE_SERVE_PLATFORM": "rocm",
    }
    env.update({e["name"]: e["value"] for e in c["env"] if "value" in e})
    proc = subprocess.run(
        [sys.executable, str(ENTRYPOINT), *c["args"]],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    planned = json.loads(proc.stdout)
    cmd = planned["argv"]
    assert cmd[:3] == ["vllm", "serve", c["args"][1]]
    # with mono decode on, vLLM gets the KV layout of the one attention backend the kernels read
    from monodecode.vllm_plugin.serving import serve_settings

    mono_on = values.get("monodecode", {}).get("enabled", True)
    for name, value in serve_settings("rocm").env.items():
        assert planned["env"].get(name) == (value if mono_on else None)
    mono = MonoConfig.from_additional_config(json.loads(arg_after(cmd, "--additional-config")))
    want = values.get("monodecode", {})
    assert mono.enabled is want.get("enabled", True)
    assert mono.on_refusal == want.get("on_refusal", "raise")
    assert mono.artifact_dir == want.get("artifact_dir", "/opt/monodecode/artifacts")
    assert mono.failstop_dir == "/var/lib/monodecode/failstop"
    assert arg_after(cmd, "--tensor-parallel-size") == str(values.get("vllm", {}).get("tensorParallelSize", 1))
    # every chart argument but the config reaches vllm unchanged
    chart_rest = [a for a in c["args"][2:]]
    i = chart_rest.index("--additional-config")
    del chart_rest[i : i + 2]
    assert cmd[5:] == chart_rest


def test_monitors_restore_vllm_metric_names_before_user_relabelings(tmp_path):
    """Prometheus 2.x gets `vllm_...` from prometheus_client 0.26's OpenMetrics output
    (tests/deploy/test_autoscaling_prometheus.py shows it with a real Prometheus); the monitors
    rename them back before the user's own relabelings run."""
    user = [{"action": "drop", "sourceLabels": ["__name__"], "regex": "python_.*"}]
    restore = {
        "action": "replace",
        "sourceLabels": ["__name__"],
        "regex": "vllm_(.+)",
        "targetLabel": "__name__",
        "replacement": "vllm:${1}",
    }
    for monitor in ("serviceMonitor", "podMonitor"):
        kind = monitor[0].upper() + monitor[1:]
        docs = render(tmp_path, {"monitoring": {monitor: {"enabled": True, "metricRelabelings": user}}})
        doc = one(docs, kind)
        validate_strict(doc)
        (endpoint,) = doc["spec"]["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
        assert endpoint["metricRelabelings"] == [restore, *user]
        off = render(tmp_path, {"monitoring": {monitor: {"enabled": True}, "restoreVllmMetricNames": False}})
        (endpoint,) = one(off, kind)["spec"]["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
        assert "metricRelabelings" not in endpoint
