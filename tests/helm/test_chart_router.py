"""Behind a router: llm-d's inference scheduler (an InferencePool over the release's pods, an
HTTPRoute to the pool) or the vLLM production-stack router (pod labels for its k8s discovery).

The metrics routers read are checked against vLLM's own logger in
tests/deploy/test_autoscaling_prometheus.py (ROUTER_METRICS).
"""

from __future__ import annotations

import pytest
from test_helm_chart import MONITORING_APIS, one, render, validate_strict

POOL_API = "inference.networking.k8s.io/v1/InferencePool"
APIS = [*MONITORING_APIS, POOL_API, "gateway.networking.k8s.io/v1/HTTPRoute"]
LLMD_LABELS = {"llm-d.ai/inferenceServing": "true", "llm-d.ai/model": "qwen3-8b"}


def test_llm_d_inference_pool_selects_the_serving_pods_on_the_vllm_port(tmp_path):
    values = {
        "router": {
            "podLabels": LLMD_LABELS,
            "inferencePool": {"enabled": True, "endpointPicker": {"name": "qwen-epp"}},
        },
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "inference-gateway"}]},
        "apiKey": {"existingSecret": "llm-key"},
    }
    docs = render(tmp_path, values, apis=APIS)
    pool = one(docs, "InferencePool")
    validate_strict(pool)
    dep = one(docs, "Deployment")
    validate_strict(dep)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items() and LLMD_LABELS.items() <= selector.items()
    assert selector.items() >= dep["spec"]["selector"]["matchLabels"].items(), "only this release's pods"
    assert pool["spec"]["targetPorts"] == [{"number": container["ports"][0]["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "qwen-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    # the picker scrapes /metrics and waits for Ready pods: neither is behind the API key
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # the route goes through the pool (the picker chooses the pod), not straight to the Service
    route = one(docs, "HTTPRoute")
    validate_strict(route)
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]


def test_production_stack_router_labels(tmp_path):
    """The production-stack router discovers engines by a pod label selector and asks each pod's
    /v1/models for its model: the labels land on the pods, and the served name is vLLM's."""
    values = {
        "router": {"podLabels": {"model": "qwen3-8b", "environment": "prod"}},
        "model": {"servedName": "qwen3-8b"},
    }
    docs = render(tmp_path, values)
    dep = one(docs, "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["model"] == "qwen3-8b" and labels["environment"] == "prod"
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--served-model-name") + 1] == "qwen3-8b"
    assert not [d for d in docs if d["kind"] == "InferencePool"]


@pytest.mark.parametrize(
    "values,apis,message",
    [
        (
            {"router": {"inferencePool": {"enabled": True}}},
            APIS,
            "router.inferencePool.endpointPicker.name is empty: name the Service of llm-d's inference scheduler",
        ),
        (
            {"router": {"inferencePool": {"enabled": True, "endpointPicker": {"name": "epp"}}}},
            MONITORING_APIS,
            "router.inferencePool.enabled is true but the cluster has no inference.networking.k8s.io/v1 InferencePool "
            "(install the Gateway API Inference Extension CRDs",
        ),
        (
            {"router": {"podLabels": {"app.kubernetes.io/instance": "other"}}},
            APIS,
            "router.podLabels must not set app.kubernetes.io/instance: the chart sets it to rel and selects its pods",
        ),
        (
            {"podLabels": {"model": "a"}, "router": {"podLabels": {"model": "b"}}},
            APIS,
            "podLabels and router.podLabels both set model: set it in one of them",
        ),
        ({"router": {"inferencePool": {"endpointPicker": {"failureMode": "Open"}}}}, APIS, "at '/router/inferencePool"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_bad_router_values(tmp_path, values, apis, message):
    proc = render(tmp_path, values, apis=apis, check=False)
    assert proc.returncode != 0, f"accepted {values}"
    assert message in proc.stderr, proc.stderr
