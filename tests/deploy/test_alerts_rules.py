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
    "kube_pod_container_status_last_terminated_exitcode": "kube-state-metrics",
    "kube_pod_container_status_restarts_total": "kube-state-metrics",
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
    for name in sorted(names - recorded()):
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


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def alerts() -> list[dict]:
    return [r for r in rules() if "alert" in r]


def _expanded(expr: str) -> str:
    """``expr`` followed by the expressions of every recording rule it reads, recursively."""
    records = {r["record"]: r["expr"] for r in rules() if "record" in r}
    out, seen = expr, set()
    while True:
        more = [name for name in records if name in out and name not in seen]
        if not more:
            return out
        for name in more:
            seen.add(name)
            out += "\n" + records[name]


def recorded() -> set[str]:
    """Names of the recording rules (series the alerts and the dashboard may read)."""
    return {r["record"] for r in rules() if "record" in r}


def test_promtool_check_rules():
    proc = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_promtool_unit_tests_pass():
    assert RULE_TESTS, "no promtool unit tests in deploy/prometheus/tests/"
    proc = subprocess.run(
        [promtool(), "test", "rules", *map(str, RULE_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# (what is broken in the rules, the original text, its broken form, the test case that must fail)
RULE_BREAKS = [
    ("threshold 70%", "ratio_rate10m > 0.5\n", "ratio_rate10m > 0.7\n", "fallback ratio 2/3 from rows_exceed_width"),
    ("no traffic guard", ") >= 0.1\n", ") >= 0\n", "fallback ratio stays quiet"),
    (
        "degraded steps counted",
        '|disabled|degraded|width_dropped"}',
        '|disabled|width_dropped"}',
        "fallback ratio stays quiet",
    ),
    ("dropped widths counted", '|degraded|width_dropped"}', '|degraded"}', "widths dropped at warm-up"),
    (
        "ratio over all steps",
        "/\n          (instance:monodecode_mono_steps:rate10m + instance:monodecode_eligible_fallback_steps:rate10m)",
        "/\n          sum by (namespace, pod, job, instance) (rate(monodecode_steps_total[10m]))",
        "prefill-heavy pod",
    ),
    (
        "ratio per job",
        "sum by (namespace, pod, job, instance) (rate(monodecode_fallback_steps_total{reason!~",
        "sum by (namespace, job) (rate(monodecode_fallback_steps_total{reason!~",
        "fallback ratio 2/3",
    ),
    ("latency threshold in ms", "p99_rate10m > 0.2\n", "p99_rate10m > 200\n", "p99 inter-token latency of 300 ms"),
    ("latency without traffic guard", "count:rate10m >= 1\n", "count:rate10m >= 0\n", "slow but idle"),
    ("any exit code", "== 70\n", "> 0\n", "other exit codes"),
    ("exits of any container", '{container="vllm"}', "", "other exit codes"),
    ("no step-rate band", "> 0.8 *", "> 0 *", "a load shift"),
    ("shadow passes alert", 'result="fail"', 'result=~"fail|pass"', "passing shadow checks"),
    (
        "job-name selector",
        'up{app_kubernetes_io_part_of="monodecode"}) == 1',
        'up{job=~".*monodecode.*"}) == 1',
        "annotation scrape job",
    ),
]


@pytest.mark.parametrize("what,good,bad,case", RULE_BREAKS, ids=[b[0] for b in RULE_BREAKS])
def test_promtool_unit_tests_catch_a_broken_rule(tmp_path, what, good, bad, case):
    """Each property of the rules is load-bearing: breaking it fails a named unit test."""
    text = RULES.read_text()
    assert good in text, f"{what}: {good!r} is no longer in the rules (update RULE_BREAKS)"
    (tmp_path / "tests").mkdir()
    (tmp_path / RULES.name).write_text(text.replace(good, bad))
    check = subprocess.run([promtool(), "check", "rules", str(tmp_path / RULES.name)], capture_output=True, text=True)
    assert check.returncode == 0, f"{what}: the broken rules do not even load: {check.stdout}{check.stderr}"
    # only the groups named like the case (promtool spends about 9 s of CPU on all 26 groups)
    for t in RULE_TESTS:
        doc = yaml.safe_load(t.read_text())
        doc["tests"] = [g for g in doc["tests"] if case in g.get("name", "")]
        if doc["tests"]:
            (tmp_path / "tests" / t.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    picked = sorted((tmp_path / "tests").iterdir())
    assert picked, f"{what}: no unit test group is named like {case!r}"
    proc = subprocess.run([promtool(), "test", "rules", *map(str, picked)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, f"{what}: the unit tests still pass"
    failed = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip().startswith("name:")]
    assert any(case in line for line in failed), f"{what}: expected {case!r} to fail, failed: {failed}"


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
        "MonodecodeFailstopExit",
        "MonodecodeShadowCheckFailed",
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


def test_recording_rules_are_named_level_metric_operations():
    """level:metric:operations (Prometheus' convention): the level names the aggregation kept,
    the metric part has no colon, the operations say what was done."""
    import re

    assert recorded(), "no recording rules"
    for r in rules():
        if "record" in r:
            assert re.fullmatch(r"instance:[a-z][a-z0-9_]*:[a-z0-9_]+", r["record"]), r["record"]
            assert "sum by (namespace, pod, job, instance" in r["expr"] or "instance:" in r["expr"], r["record"]
    # the alerts and the dashboard read the ratios through them
    fallback = next(a for a in alerts() if a["alert"] == "MonodecodeFallbackRatioHigh")
    assert "instance:monodecode_eligible_fallback_steps:ratio_rate10m" in fallback["expr"]
    assert "rate(" not in fallback["expr"], "the alert recomputes what a recording rule records"


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
    for r in rules():
        names |= promql_metric_names(r["expr"])
    assert any(n.startswith("monodecode_") for n in names)
    check_documented(names, "deploy/prometheus/monodecode-alerts.yaml")


def test_unit_tests_pass_against_the_chart_rendered_rules(tmp_path):
    """The PrometheusRule the chart renders passes the same promtool unit tests."""
    from test_helm_chart import RUNBOOK_URL, helm, one  # the chart tests' helm runner

    out = helm(
        "template",
        "rel",
        str(REPO / "helm" / "vllm-monodecode"),
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        f"prometheusRule.runbookBaseUrl={RUNBOOK_URL}",
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
    ).stdout
    rule = one([d for d in yaml.safe_load_all(out) if d], "PrometheusRule")
    (tmp_path / "tests").mkdir()
    rendered = yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False)
    assert f"runbook_url: {RUNBOOK_URL}#" in rendered and "runbook_url: deploy/" not in rendered
    # the unit tests expect the file's repository-relative links
    (tmp_path / RULES.name).write_text(rendered.replace(RUNBOOK_URL, "deploy/RUNBOOK.md"))
    for t in RULE_TESTS:
        shutil.copy(t, tmp_path / "tests" / t.name)
    for cmd in (
        ["check", "rules", str(tmp_path / RULES.name)],
        ["test", "rules", *[str(tmp_path / "tests" / t.name) for t in RULE_TESTS]],
    ):
        proc = subprocess.run([promtool(), *cmd], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- reason codes and label values are the runtime's ---------------------------------------------


def _label_values(label: str, metric: str | None = None) -> set[str]:
    """Values of `label` in the unit tests' input series (of `metric` only, when given)."""
    values = set()
    for t in RULE_TESTS:
        for case in yaml.safe_load(t.read_text())["tests"]:
            for series in case.get("input_series", []):
                name = series["series"].split("{", 1)[0]
                if metric is None or name == metric:
                    values |= set(re.findall(rf'\b{label}="([^"]*)"', series["series"]))
    return values


def _runbook_section(title: str) -> str:
    m = re.search(rf"^## {title}\s*$(.*?)(?=^## |\Z)", RUNBOOK.read_text(), re.M | re.S)
    assert m, f"RUNBOOK.md has no section {title}"
    return m.group(1)


def _bullet_codes(section: str) -> set[str]:
    """Backticked words that start a bullet or follow a bullet's leading codes."""
    codes = set()
    for bullet in re.split(r"^- ", section, flags=re.M)[1:]:
        lead = bullet.split(":", 1)[0]
        codes |= set(re.findall(r"`([a-z_]+)`", lead))
    return codes


def test_test_data_uses_the_runtimes_codes():
    from monodecode.metrics import FAILSTOP_SITES
    from monodecode.reasons import FallbackReason, RefusalReason

    fallback = _label_values("reason", "monodecode_fallback_steps_total")
    refusal = _label_values("reason", "monodecode_refusal_info")
    sites = _label_values("site")
    assert fallback and refusal and sites
    assert fallback <= {r.value for r in FallbackReason}, fallback - {r.value for r in FallbackReason}
    assert refusal <= {r.value for r in RefusalReason}, refusal - {r.value for r in RefusalReason}
    assert sites <= set(FAILSTOP_SITES), sites - set(FAILSTOP_SITES)
    assert _label_values("result", "monodecode_shadow_checks_total") == {"pass", "fail"}


def test_rule_reason_filters_are_fallback_codes():
    from monodecode.reasons import FallbackReason

    exprs = "\n".join(a["expr"] for a in alerts())
    for regex in re.findall(r'reason!?=~?"([^"]*)"', exprs):
        for code in regex.split("|"):
            assert code in {r.value for r in FallbackReason}, f"rules filter on unknown fallback reason {code!r}"


def test_runbook_covers_every_reason_code_and_only_those():
    from monodecode.reasons import FallbackReason, RefusalReason

    # the reasons MonodecodeFallbackRatioHigh does not count, from its expression and the recording
    # rules it reads: the runbook names each where it says what the ratio counts, and has no "what
    # to do" bullet for them
    expr = _expanded(next(a["expr"] for a in alerts() if a["alert"] == "MonodecodeFallbackRatioHigh"))
    excluded = set(re.search(r'reason!~"([^"]+)"', expr).group(1).split("|"))
    section = _runbook_section("MonodecodeFallbackRatioHigh")
    means = section.split("**Check**", 1)[0]
    assert {r for r in excluded if f"`{r}`" not in means} == set(), "the runbook's ratio omits an excluded reason"
    fallback = _bullet_codes(section)
    assert fallback == {r.value for r in FallbackReason} - excluded
    refusal = _bullet_codes(_runbook_section("MonodecodeDegraded"))
    assert refusal == {r.value for r in RefusalReason}, (
        f"missing: {sorted({r.value for r in RefusalReason} - refusal)}; unknown: "
        f"{sorted(refusal - {r.value for r in RefusalReason})}"
    )
    failstop = set(re.findall(r"`([a-z_]+)`", _runbook_section("MonodecodeFailstop")))
    from monodecode.metrics import FAILSTOP_SITES

    assert set(FAILSTOP_SITES) <= failstop


def test_runbook_graph_mode_advice_matches_the_runtime():
    """FULL is refused at start; the fallback advice names the modes that run mono steps."""
    from monodecode.spec import GRAPH_MODES_OK

    advice = _runbook_section("MonodecodeFallbackRatioHigh")
    advice = advice[advice.index("`graph_mode`") :].split("\n- ", 1)[0]
    named = set(re.findall(r"\b(FULL_AND_PIECEWISE|FULL_DECODE_ONLY|PIECEWISE|FULL|NONE)\b", advice))
    recommended = {m for m in named if m.lower() in GRAPH_MODES_OK and m != "FULL"}
    assert recommended == {"FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"}
    assert "`FULL` is refused" in advice
    assert "full" in GRAPH_MODES_OK or "refused" in advice


def test_runbook_names_the_kube_prometheus_alerts_for_crash_loops_and_scrapes():
    section = _runbook_section("MonodecodeFailstopExit")
    for alert in ("KubePodCrashLooping", "TargetDown", "KubePodNotReady"):
        assert f"**`{alert}`**" in section
