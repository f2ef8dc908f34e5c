"""Autoscaling, off by default: a KEDA ScaledObject or an autoscaling/v2 HPA on vLLM's queue.

Rendered objects are validated strictly (KEDA: cloudcoil's model when installed, else
crd_schemas/); the queries parse with promtool. tests/deploy/test_autoscaling_prometheus.py runs
them against a real Prometheus scraping vLLM's own metrics logger.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import jsonschema
import pytest
import yaml
from test_helm_chart import CHART, MONITORING_APIS, by_kind, crd_schema, one, render, validate_strict

KEDA_API = "keda.sh/v1alpha1/ScaledObject"
ADAPTER_API = "custom.metrics.k8s.io/v1beta1"
APIS = [*MONITORING_APIS, KEDA_API, ADAPTER_API]
KEDA = {"enabled": True, "kind": "keda", "keda": {"serverAddress": "http://prometheus-operated.monitoring.svc:9090"}}


def keda_values(**autoscaling) -> dict:
    return {"autoscaling": {**KEDA, **autoscaling}}


def promtool_check(exprs: list[str], tmp_path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: the Debian package prometheus is in scripts/apt-packages.txt"
    rules = {"groups": [{"name": "q", "rules": [{"record": f"q:{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_off_by_default(tmp_path):
    docs = render(tmp_path, {}, apis=APIS)
    assert not by_kind(docs, "ScaledObject") and not by_kind(docs, "HorizontalPodAutoscaler")
    assert one(docs, "Deployment")["spec"]["replicas"] == 1


def test_keda_scales_on_this_models_queue(tmp_path):
    values = keda_values(
        minReplicas=2, maxReplicas=6, waitingPerPod=3, keda={**KEDA["keda"], "authenticationRef": "prom"}
    )
    values["model"] = {"hf": {"id": "meta-llama/Llama-3.1-8B-Instruct"}}
    docs = render(tmp_path, values, apis=APIS)
    so = one(docs, "ScaledObject")
    validate_strict(so)
    dep = one(docs, "Deployment")
    assert "replicas" not in dep["spec"], "the autoscaler owns the replica count"
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 6)
    (queue,) = spec["triggers"]
    assert queue["type"] == "prometheus" and queue["metricType"] == "AverageValue"
    assert queue["metadata"] == {
        "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
        "query": 'sum(vllm:num_requests_waiting{namespace="llm",model_name="meta-llama/Llama-3.1-8B-Instruct"})',
        "threshold": "3",
    }
    assert queue["authenticationRef"] == {"name": "prom"}
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 60
    assert behavior["scaleUp"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 180}]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 900
    promtool_check([queue["metadata"]["query"]], tmp_path)


def test_keda_latency_trigger_and_served_name(tmp_path):
    values = keda_values(
        latency={"enabled": True, "metric": "inter_token_latency", "quantile": 0.95, "thresholdSeconds": 0.05}
    )
    values["model"] = {"servedName": 'odd "name" \\ here'}
    so = one(render(tmp_path, values, apis=APIS), "ScaledObject")
    validate_strict(so)
    queue, latency = so["spec"]["triggers"]
    selector = 'namespace="llm",model_name="odd \\"name\\" \\\\ here"'
    assert queue["metadata"]["query"] == f"sum(vllm:num_requests_waiting{{{selector}}})"
    assert latency["metricType"] == "Value"
    assert latency["metadata"]["query"] == (
        f"histogram_quantile(0.95, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket{{{selector}}}[5m])))"
    )
    assert latency["metadata"]["threshold"] == "0.05"
    promtool_check([queue["metadata"]["query"], latency["metadata"]["query"]], tmp_path)


def test_model_name_follows_the_model_argument(tmp_path):
    """vLLM labels its metrics with --served-model-name, else with the model argument."""
    values = keda_values()
    values["model"] = {"source": "pvc", "pvc": {"claimName": "models", "path": "/qwen3-8b/"}}
    docs = render(tmp_path, values, apis=APIS)
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    query = one(docs, "ScaledObject")["spec"]["triggers"][0]["metadata"]["query"]
    assert args[1] == "/models/qwen3-8b" and f'model_name="{args[1]}"' in query


def test_hpa_scales_on_the_adapters_per_pod_metric(tmp_path):
    values = {"autoscaling": {"enabled": True, "kind": "hpa", "maxReplicas": 3, "waitingPerPod": 2.5}}
    docs = render(tmp_path, values, apis=APIS)
    hpa = one(docs, "HorizontalPodAutoscaler")
    validate_strict(hpa)
    assert not by_kind(docs, "ScaledObject") and "replicas" not in one(docs, "Deployment")["spec"]
    spec = hpa["spec"]
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 3)
    assert spec["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm_num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "2.5"},
            },
        }
    ]
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 900
    # the adapter rule the chart's docs point to serves that name
    adapter = yaml.safe_load((CHART.parents[1] / "deploy" / "examples" / "prometheus-adapter-rules.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["name"]["as"] == "vllm_num_requests_waiting"


@pytest.mark.parametrize(
    "autoscaling,apis,message",
    [
        (
            KEDA,
            MONITORING_APIS,
            "autoscaling.enabled with autoscaling.kind keda is true but the cluster has no keda.sh/v1alpha1 "
            "ScaledObject (install KEDA, or with `helm template` pass --api-versions keda.sh/v1alpha1/ScaledObject)",
        ),
        (
            {"enabled": True, "kind": "hpa"},
            MONITORING_APIS,
            "autoscaling.enabled with autoscaling.kind hpa is true but the cluster has no custom.metrics.k8s.io "
            "v1beta1 (install the Prometheus adapter",
        ),
        ({**KEDA, "minReplicas": 0}, APIS, "at '/autoscaling/minReplicas': minimum: got 0, want 1"),
        (
            {**KEDA, "minReplicas": 3, "maxReplicas": 2},
            APIS,
            "autoscaling.maxReplicas (2) is below autoscaling.minReplicas (3)",
        ),
        ({"enabled": True, "kind": "keda"}, APIS, "autoscaling.keda.serverAddress is empty"),
        ({**KEDA, "keda": {"serverAddress": "prometheus:9090"}}, APIS, "at '/autoscaling/keda/serverAddress'"),
        (
            {"enabled": True, "kind": "hpa", "latency": {"enabled": True}},
            APIS,
            "autoscaling.latency.enabled needs autoscaling.kind keda",
        ),
        ({**KEDA, "latency": {"metric": "ttft"}}, APIS, "at '/autoscaling/latency/metric'"),
        ({**KEDA, "waitingPerPod": 0}, APIS, "at '/autoscaling/waitingPerPod'"),
        (
            {**KEDA, "scaleUp": {"stabilizationWindowSeconds": -1}},
            APIS,
            "at '/autoscaling/scaleUp/stabilizationWindowSeconds'",
        ),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_bad_autoscaling_values(tmp_path, autoscaling, apis, message):
    proc = render(tmp_path, {"autoscaling": autoscaling}, apis=apis, check=False)
    assert proc.returncode != 0, f"accepted {autoscaling}"
    assert message in proc.stderr, proc.stderr


def test_autoscaled_replicas_count_for_the_created_cache(tmp_path):
    values = keda_values(maxReplicas=3)
    values["model"] = {"hf": {"cache": {"type": "create"}}}
    proc = render(tmp_path, values, apis=APIS, check=False)
    assert proc.returncode != 0
    assert "autoscaling.maxReplicas 3 with one created model cache claim that is ReadWriteOnce" in proc.stderr


def test_shipped_scaled_object_schema_refuses_unknown_fields():
    """The fallback schema (used without cloudcoil's KEDA models) accepts the rendered shape only."""
    schema = crd_schema("keda.sh/v1alpha1", "ScaledObject")
    good = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "x"},
        "spec": {"scaleTargetRef": {"name": "x"}, "triggers": [{"type": "prometheus", "metadata": {"query": "1"}}]},
    }
    jsonschema.validate(good, schema)
    for bad in (
        {**good, "spec": {**good["spec"], "minReplicas": 1}},
        {**good, "spec": {**good["spec"], "triggers": [{"type": "prometheus", "metadata": {"threshold": 5}}]}},
        {**good, "spec": {**good["spec"], "triggers": [{"type": "prometheus", "metadata": {}, "metric": "x"}]}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    json.dumps(schema)
