"""End to end: a real Prometheus on 127.0.0.1 loads the chart's alert rules, scrapes a live
runner's exporter, and the fallback alert fires once the runner falls back.

The runner is monodecode's own (tiny model, reference backend, widths 1 and 2) doing real decode
steps in a thread: 2 rows per step run the mono path, 4 rows exceed the widest width and fall
back (`rows_exceed_width`). The rules are rendered by the chart (the same file as
deploy/prometheus/); the only test override is MonodecodeFallbackRatioHigh's `for:` (15m -> 2s,
through the chart's `prometheusRule.alerts.<name>.for`), the expression is the shipped one.
Prometheus scrapes and evaluates every second. Everything is stopped at the end.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_dashboard import dashboard, promql_for_prometheus, queries
from test_helm_chart import CHART, RULES_SRC, RUNBOOK_URL, helm, one

ALERT = "MonodecodeFallbackRatioHigh"
FIRE_WITHIN_S = 90  # bound on: ratio crosses 50% + for: 2s + evaluation and scrape intervals
JOB = "vllm-monodecode"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    # 30 s: on CI's 2 cores under a 24-row vLLM load, Prometheus's API once took over 5 s to answer
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def wait_for(what: str, predicate, timeout_s: float, interval_s: float = 0.5, on_timeout=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}\n{on_timeout()}")
        time.sleep(interval_s)


class SteppingRunner:
    """A started Runner with its exporter, stepping in a thread with a settable row count."""

    def __init__(self, tmp: Path):
        import torch
        from prometheus_client import CollectorRegistry

        from monodecode.config import MonoConfig
        from monodecode.metrics import MonoMetrics, start_exporter
        from monodecode.model.dims import load_dims
        from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
        from monodecode.model.tiny import ensure_tiny_model
        from monodecode.model.weights import load_weights
        from monodecode.runtime.runner import Runner
        from monodecode.services.platform import detect_platform

        model_dir = ensure_tiny_model()
        dims = load_dims(model_dir)
        weights = load_weights(model_dir, dims)
        self.registry = CollectorRegistry()
        metrics = MonoMetrics(registry=self.registry)
        config = MonoConfig.from_dict(
            {
                "enabled": True,
                "backend": "reference",
                "widths": [1, 2],
                "failstop_dir": str(tmp / "failstop"),
                "termination_log": str(tmp / "termination-log"),
                "exit_on_failstop": False,
            }
        )
        self.runner = Runner(config, dims, weights, detect_platform(), metrics=metrics).start()
        assert self.runner.state == "mono", self.runner.reasons
        alloc = BlockAllocator(16, 16)
        for row in range(4):
            alloc.append_slots(row, 5)
        self.kv = PagedKVCache.allocate(dims, 16, 16)
        self.batches = {rows: (torch.arange(1, rows + 1), alloc.decode_metadata(list(range(rows)))) for rows in (2, 4)}
        self.rows = 2
        self.decisions: dict[str, int] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.exporter = start_exporter(0, "127.0.0.1", registry=self.registry)
        self._thread = threading.Thread(target=self._loop, name="stepping-runner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                ids, meta = self.batches[self.rows]
                self.runner.decode_step(ids, meta, self.kv)
                key = self.runner.last_decision.reason or self.runner.last_decision.path
                self.decisions[key] = self.decisions.get(key, 0) + 1
                self._stop.wait(0.02)  # ~40 steps/s: light on a shared 2-core machine
        except BaseException as e:  # surfaced by the test
            self.error = e

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.exporter.stop()


class Prometheus:
    """Prometheus on 127.0.0.1 scraping one target every second as a monodecode pod (namespace
    e2e, pod runner-0, the chart's part-of label), with `rules` loaded when given and the
    metric_relabel_configs a monitor would set."""

    def __init__(
        self, tmp: Path, rules: Path | None, target_port: int, port: int | None = None, metric_relabel_configs=()
    ):
        exe = shutil.which("prometheus")
        if not exe:
            pytest.fail(
                "prometheus is not installed: the Debian package prometheus is in scripts/apt-packages.txt (make test)"
            )
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": [str(rules)] if rules else [],
            "scrape_configs": [
                {
                    "job_name": JOB,
                    "metric_relabel_configs": list(metric_relabel_configs),
                    "static_configs": [
                        {
                            "targets": [f"127.0.0.1:{target_port}"],
                            # what the chart's podTargetLabels (or a pod labelmap) put on the target
                            "labels": {
                                "namespace": "e2e",
                                "pod": "runner-0",
                                "app_kubernetes_io_part_of": "monodecode",
                            },
                        }
                    ],
                }
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    exe,
                    f"--config.file={tmp / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        wait_for("Prometheus to be ready", self._ready, 60, on_timeout=self.tail)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with {self.proc.returncode}\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def query(self, promql: str) -> list[dict]:
        body = get_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def alerts(self, name: str) -> list[dict]:
        return [a for a in get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"] if a["labels"]["alertname"] == name]

    def rule_health(self) -> dict[str, str]:
        groups = get_json(f"{self.url}/api/v1/rules")["data"]["groups"]
        return {r["name"]: r["health"] for g in groups for r in g["rules"]}

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def runner(tmp_path):
    r = SteppingRunner(tmp_path)
    yield r
    r.stop()


@pytest.fixture
def chart_rules(tmp_path) -> Path:
    """The rules as the chart renders them (plain rules file ConfigMap), `for` shortened."""
    out = helm(
        "template",
        "rel",
        str(CHART),
        "--set",
        "rulesConfigMap.enabled=true",
        "--set",
        f"prometheusRule.alerts.{ALERT}.for=2s",
        "--set",
        f"prometheusRule.runbookBaseUrl={RUNBOOK_URL}",
    ).stdout
    cm = one([d for d in yaml.safe_load_all(out) if d], "ConfigMap", "-rules")
    rules = yaml.safe_load(cm["data"]["monodecode-alerts.yaml"])
    shipped = {
        r.get("alert", r.get("record")): r for g in yaml.safe_load(RULES_SRC.read_text())["groups"] for r in g["rules"]
    }
    for g in rules["groups"]:
        for r in g["rules"]:
            name = r.get("alert", r.get("record"))
            assert r["expr"] == shipped[name]["expr"]
            assert r.get("for") == ("2s" if name == ALERT else shipped[name].get("for"))
    path = tmp_path / "monodecode-alerts.yaml"
    path.write_text(cm["data"]["monodecode-alerts.yaml"])
    return path


@pytest.fixture
def prometheus(tmp_path, runner, chart_rules):
    prom = Prometheus(tmp_path, chart_rules, runner.exporter.port)
    yield prom
    prom.stop()


def test_fallback_alert_fires_on_a_live_runner(prometheus, runner):
    prom = prometheus
    # mono phase: data flows, every rule evaluates cleanly, and the fallback alert stays quiet
    wait_for(
        "two scrapes of the runner",
        lambda: prom.query(f'sum(rate(monodecode_steps_total{{job="{JOB}"}}[1m])) > 0'),
        60,
        on_timeout=prom.tail,
    )
    assert prom.query('up{job="%s"}' % JOB)[0]["value"][1] == "1"
    wait_for(
        "every rule to be evaluated",
        lambda: set(prom.rule_health().values()) == {"ok"},
        30,
        on_timeout=lambda: f"{prom.rule_health()}\n{prom.tail()}",
    )
    time.sleep(4)  # four evaluations of the 2s-for rule on mono-only data
    assert prom.alerts(ALERT) == [], "fallback alert active while every step ran the mono path"
    assert runner.decisions.get("mono", 0) > 0 and runner.decisions.get("rows_exceed_width", 0) == 0

    # fallback phase: 4 rows per step exceed the widest built width (2)
    runner.rows = 4
    t0 = time.monotonic()
    firing = wait_for(
        f"{ALERT} to fire",
        lambda: [a for a in prom.alerts(ALERT) if a["state"] == "firing"],
        FIRE_WITHIN_S,
        on_timeout=lambda: f"alerts: {prom.alerts(ALERT)}\nrunner: {runner.decisions}\n{prom.tail()}",
    )
    fired_after = time.monotonic() - t0
    assert runner.error is None, runner.error
    (alert,) = firing
    assert alert["labels"] == {
        "alertname": ALERT,
        "severity": "warning",
        "job": JOB,
        "namespace": "e2e",
        "pod": "runner-0",
        "instance": f"127.0.0.1:{runner.exporter.port}",
    }
    assert float(alert["value"]) > 0.5
    assert alert["annotations"]["runbook_url"] == f"{RUNBOOK_URL}#monodecodefallbackratiohigh"
    assert runner.decisions.get("rows_exceed_width", 0) > 0
    print(f"{ALERT} fired {fired_after:.1f}s after the runner started falling back; steps: {runner.decisions}")

    # the other alerts see a healthy, enabled runner
    for quiet in ("MonodecodeDisabled", "MonodecodeDegraded", "MonodecodeFailstop", "MonodecodeMetricsAbsent"):
        assert prom.alerts(quiet) == [], quiet

    # every dashboard query runs against the live data; the monodecode panels show series
    empty_expected = ("Fail-stops", "Last fail-stop", "Build and refusals", "Inter-token latency", "GPU activity")
    for title, expr in queries(dashboard()):
        result = prom.query(promql_for_prometheus(expr))
        if not title.startswith(empty_expected):
            assert result, f"dashboard panel {title!r} shows nothing for a live runner: {expr}"
