"""The alert rules in deploy/prometheus/: promtool check + unit tests, conventions, runbook,
and every metric name they use is one the project documents (README "## Metrics").

The same unit tests also run against the rules as the chart renders them, so the chart cannot
drift from the shipped file.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "monodecode-alerts.yaml"
RULE_TESTS = sorted((REPO / "deploy" / "prometheus" / "tests").glob("*.test.yaml"))
RUNBOOK = REPO / "deploy" / "RUNBOOK.md"
README = REPO / "README.md"
# Series from outside monodecode that rules or dashboards may use (name -> who exports it).
EXTERNAL_METRICS = {
    "up": "Prometheus (per scrape target)",
    "vllm:inter_token_latency_seconds": "vLLM (/metrics)",
    "gpu_gfx_activity": "AMD device metrics exporter",
}

# ---- PromQL metric names -------------------------------------------------------------------------

_PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "inf",
    "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (Grafana variables allowed).

    Drops strings, label matchers, grouping clauses, range/offset durations, numbers, function
    names (an identifier followed by '(') and keywords; what is left are series names.
    """
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\$\{?\w+\}?", "1m", e)  # $__rate_interval, $namespace
    e = re.sub(r"\{[^{}]*\}", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group(0)
        rest = e[m.end() :].lstrip()
        if rest.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue
        if re.fullmatch(r"\d+[smhdwy]", e[m.start() - 1 : m.end()] if m.start() else word):
            continue
        names.add(word)
    return names


def base_metric(name: str) -> str:
    """A histogram's _bucket/_sum/_count series -> the histogram's name."""
    return re.sub(r"_(bucket|sum|count)$", "", name) if name.startswith(("monodecode_", "vllm:")) else name


def readme_metrics() -> set[str]:
    """Metric names of the README's "## Metrics" table (first column, in backticks)."""
    text = README.read_text()
    m = re.search(r"^## Metrics\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, 'README.md has no "## Metrics" section (the runner documents its metric names there)'
    names = set()
    for line in m.group(1).splitlines():
        cell = re.match(r"\|\s*`([a-z_:]+)(?:\{[^`]*\})?`", line.strip())
        if cell:
            names.add(cell.group(1))
    assert names, 'README "## Metrics" has no table rows with `metric_name` in the first column'
    return names


def check_documented(names: set[str], where: str) -> None:
    """Every monodecode series is in the README table and exported by monodecode.metrics."""
    from monodecode.metrics import METRICS

    documented = readme_metrics()
    for name in sorted(names):
        base = base_metric(name)
        if base.startswith("monodecode_"):
            assert base in documented, f"{where} uses {name}, which README '## Metrics' does not list"
            assert base in METRICS, f"{where} uses {name}, which monodecode.metrics does not export"
        else:
            assert base in EXTERNAL_METRICS, (
                f"{where} uses {name}: neither a monodecode metric nor a known external one"
            )


def test_metric_name_extraction():
    expr = (
        'sum by (namespace, job) (rate(monodecode_steps_total{path="mono", job=~"$job"}[$__rate_interval] offset 5m))'
        " / on (job) group_left histogram_quantile(0.9, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[5m])))"
        ' unless absent(up{job=~".*monodecode.*"}) > 1.5 * time()'
    )
    assert promql_metric_names(expr) == {"monodecode_steps_total", "vllm:inter_token_latency_seconds_bucket", "up"}


# ---- the rules file ----------------------------------------------------------------------------


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.fail(
            "promtool is not installed: the Debian package prometheus is in scripts/apt-packages.txt (make test)"
        )
    return found


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_rules():
    proc = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in proc.stdout


def test_promtool_unit_tests_pass():
    assert RULE_TESTS, "no promtool unit tests in deploy/prometheus/tests/"
    proc = subprocess.run(
        [promtool(), "test", "rules", *map(str, RULE_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_can_fail(tmp_path):
    """The unit tests notice a changed threshold (so passing them means something)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / RULES.name).write_text(RULES.read_text().replace(") > 0.5\n", ") > 0.7\n", 1))
    for t in RULE_TESTS:
        shutil.copy(t, tmp_path / "tests" / t.name)
    proc = subprocess.run(
        [promtool(), "test", "rules", *[str(tmp_path / "tests" / t.name) for t in RULE_TESTS]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "MonodecodeFallbackRatioHigh" in proc.stdout + proc.stderr


def test_every_alert_is_tested_firing_and_quiet():
    fired, quiet = set(), set()
    for t in RULE_TESTS:
        for case in yaml.safe_load(t.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - fired == set(), f"alerts never tested firing: {sorted(names - fired)}"
    assert names - quiet == set(), f"alerts never tested quiet: {sorted(names - quiet)}"
    assert (fired | quiet) - names == set(), f"tests name unknown alerts: {sorted((fired | quiet) - names)}"


def test_issue_alerts_are_all_there():
    names = {a["alert"] for a in alerts()}
    for wanted in (
        "MonodecodeFallbackRatioHigh",
        "MonodecodeDegraded",
        "MonodecodeDisabled",
        "MonodecodeFailstop",
        "MonodecodeStepLatencyRegression",
        "MonodecodeMetricsAbsent",
    ):
        assert wanted in names


def runbook_anchors() -> set[str]:
    """GitHub-style anchors of the runbook's headings."""
    anchors = set()
    for line in RUNBOOK.read_text().splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            anchors.add(re.sub(r"[^a-z0-9 _-]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_alert_conventions(alert):
    assert alert["labels"]["severity"] in ("critical", "warning", "info")
    ann = alert["annotations"]
    assert set(ann) == {"summary", "description", "runbook_url"}
    assert ann["summary"].strip() and ann["description"].strip()
    path, _, anchor = ann["runbook_url"].partition("#")
    assert path == "deploy/RUNBOOK.md" and anchor == alert["alert"].lower()
    assert anchor in runbook_anchors(), f"RUNBOOK.md has no section for {alert['alert']}"
    assert alert["alert"].startswith("Monodecode")


def test_rules_use_only_documented_metrics():
    names = set()
    for a in alerts():
        names |= promql_metric_names(a["expr"])
    assert any(n.startswith("monodecode_") for n in names)
    check_documented(names, "deploy/prometheus/monodecode-alerts.yaml")


def test_unit_tests_pass_against_the_chart_rendered_rules(tmp_path):
    """The PrometheusRule the chart renders passes the same promtool unit tests."""
    from test_helm_chart import helm, one  # the chart tests' helm runner

    out = helm(
        "template",
        "rel",
        str(REPO / "helm" / "vllm-monodecode"),
        "--set",
        "prometheusRule.enabled=true",
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
    ).stdout
    rule = one([d for d in yaml.safe_load_all(out) if d], "PrometheusRule")
    (tmp_path / "tests").mkdir()
    (tmp_path / RULES.name).write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    for t in RULE_TESTS:
        shutil.copy(t, tmp_path / "tests" / t.name)
    for cmd in (
        ["check", "rules", str(tmp_path / RULES.name)],
        ["test", "rules", *[str(tmp_path / "tests" / t.name) for t in RULE_TESTS]],
    ):
        proc = subprocess.run([promtool(), *cmd], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
