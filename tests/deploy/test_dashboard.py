"""The Grafana dashboard deploy/grafana/monodecode.json: structure, the panels the issue asks
for, PromQL that Prometheus parses, and only documented metric names.

(The end-to-end test in test_alerts_e2e.py also runs every panel query against a live
Prometheus scraping a runner.)
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml
from test_alerts_rules import base_metric, check_documented, promql_metric_names, promtool

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "monodecode.json"
GRAFANA_VARS = {"__rate_interval": "5m", "__interval": "1m", "namespace": ".*", "job": ".*", "pod": ".*"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows carry their panels
    return out


def queries(d: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target."""
    return [(p["title"], t["expr"]) for p in panels(d) if p["type"] != "row" for t in p["targets"]]


def promql_for_prometheus(expr: str) -> str:
    """Grafana's variables replaced by values Prometheus accepts."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: GRAFANA_VARS[m.group(1)], expr)


def test_dashboard_structure():
    d = dashboard()
    assert d["uid"] == "monodecode" and d["title"]
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for p in panels(d):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"{p['title']} is wider than the grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel at {(x, y)}"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert p.get("description"), f"{p['title']} has no description"
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "namespace", "job", "pod"} <= names


def test_dashboard_shows_what_the_issue_asks_for():
    qs = queries(dashboard())

    def panel_with(metric: str, grouped_by: str | None = None) -> bool:
        for _, e in qs:
            if metric in {base_metric(n) for n in promql_metric_names(e)}:
                if grouped_by is None or re.search(rf"by \([^)]*\b{grouped_by}\b", e):
                    return True
        return False

    assert panel_with("monodecode_steps_total", "path"), "mono vs fallback steps"
    assert panel_with("monodecode_fallback_steps_total", "reason"), "fallback reasons"
    assert panel_with("monodecode_step_duration_seconds", "path"), "step latency by path"
    assert panel_with("monodecode_warmup_duration_seconds") and panel_with("monodecode_warmup_max_abs_error"), "warm-up"
    assert panel_with("monodecode_failstop_total"), "fail-stops"
    assert panel_with("monodecode_shadow_checks_total") and panel_with("monodecode_shadow_max_abs_error"), "shadow"
    assert panel_with("vllm:inter_token_latency_seconds"), "vLLM inter-token latency"
    assert panel_with("gpu_gfx_activity", "pod"), "AMD device metrics exporter GPU activity, per pod"


def test_dashboard_uses_only_documented_metrics():
    d = dashboard()
    names = set()
    for _, e in queries(d):
        names |= promql_metric_names(e)
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", v["definition"])
            assert m, f"variable {v['name']}: {v['definition']}"
            names |= promql_metric_names(m.group(1))
    check_documented(names, "deploy/grafana/monodecode.json")


def test_dashboard_queries_parse(tmp_path):
    """promtool parses every panel query (as recording rules: the same PromQL parser)."""
    rules = [
        {"record": f"dashboard:q{i}", "expr": promql_for_prometheus(e)} for i, (_, e) in enumerate(queries(dashboard()))
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_reads_the_ratio_from_the_recording_rules():
    from test_alerts_rules import recorded

    used = {n for _, e in queries(dashboard()) for n in promql_metric_names(e) if n.startswith("instance:")}
    assert used, "the dashboard computes the mono share itself instead of reading the recording rules"
    assert used <= recorded(), f"the dashboard reads series no rule records: {sorted(used - recorded())}"
