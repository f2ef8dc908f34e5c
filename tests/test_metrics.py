"""Metrics: exact names (and the README table), real HTTP scrapes of the loopback exporter after
scripted steps, multiprocess aggregation, and one-line errors for a busy or bad port."""

import os
import re
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from monodecode.errors import MonodecodeError
from monodecode.metrics import FAILSTOP_SITES, FALLBACK_REASONS, METRICS, MonoMetrics, start_exporter

# small torch ops on one thread (2 shared CI cores; see conftest)
pytestmark = pytest.mark.usefixtures("torch_one_thread")

README = Path(__file__).resolve().parent.parent / "README.md"


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, out


@pytest.fixture
def served():
    reg = CollectorRegistry()
    m = MonoMetrics(reg)
    exp = start_exporter(0, registry=reg)
    yield m, exp
    exp.stop()


def test_exporter_binds_loopback_and_serves_exact_names(served):
    m, exp = served
    assert exp.host == "127.0.0.1" and exp.url == f"http://127.0.0.1:{exp.port}/metrics" and exp.port > 0
    assert exp.server.server_address[0] == "127.0.0.1"
    m.set_refusals(["no_artifact"])
    m.set_build("reference", "cpu", "k" * 64, "0.1.0")
    text, _ = scrape(exp.url)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name, (kind, _, _) in METRICS.items():
        assert types.get(name) == kind, name
    # prometheus-client adds *_created gauges for counters/histograms unless the process disables them
    assert {n for n in types if n.startswith("monodecode_") and not n.endswith("_created")} == set(METRICS)


def test_scripted_steps_scraped_over_http(served):
    m, exp = served
    for _ in range(3):
        m.count_step("mono")
        m.observe_step("mono", 0.002)
    for reason in ("prefill", "prefill", "rows_exceed_width", "graph_mode"):
        m.count_step("fallback", reason)
        m.observe_step("fallback", 0.03)
    m.set_enabled(True)
    m.set_warmup(1.5, 0.0078125)
    m.set_failstop_history({"wait_timeout": 2}, 1_700_000_000.0)
    m.set_failstop_history({"wait_timeout": 2}, 1_700_000_000.0)  # re-export does not double count
    m.count_failstop("nonfinite", 1_700_000_100.0)
    _, s = scrape(exp.url)
    assert s[("monodecode_steps_total", (("path", "mono"),))] == 3
    assert s[("monodecode_steps_total", (("path", "fallback"),))] == 4
    assert s[("monodecode_fallback_steps_total", (("reason", "prefill"),))] == 2
    for r in FALLBACK_REASONS:
        assert ("monodecode_fallback_steps_total", (("reason", r),)) in s  # every reason exists, at 0 if unused
    assert s[("monodecode_fallback_steps_total", (("reason", "mixed_batch"),))] == 0
    assert s[("monodecode_step_duration_seconds_count", (("path", "fallback"),))] == 4
    assert s[("monodecode_step_duration_seconds_bucket", (("le", "0.0025"), ("path", "mono")))] == 3
    assert s[("monodecode_step_duration_seconds_bucket", (("le", "0.0025"), ("path", "fallback")))] == 0
    assert s[("monodecode_enabled", ())] == 1
    assert s[("monodecode_warmup_duration_seconds", ())] == 1.5
    assert s[("monodecode_warmup_max_abs_error", ())] == 0.0078125
    assert s[("monodecode_failstop_total", (("site", "wait_timeout"),))] == 2
    assert s[("monodecode_failstop_total", (("site", "nonfinite"),))] == 1
    assert s[("monodecode_last_failstop_timestamp_seconds", ())] == 1_700_000_100.0
    with pytest.raises(ValueError):
        m.count_step("fallback", "bogus")
    with pytest.raises(ValueError):
        m.count_step("sideways")


def test_runner_steps_scraped_over_http(served, tmp_path):
    from monodecode.config import MonoConfig
    from monodecode.model.profiles import profile_dims
    from monodecode.model.weights import random_weights
    from monodecode.runtime.runner import Runner
    from monodecode.services.platform import Platform
    from monodecode_ops.selfcheck import run_scenario

    m, exp = served
    dims = profile_dims("tiny")
    cfg = MonoConfig(enabled=True, widths=(1, 2, 4, 8), failstop_dir=str(tmp_path))
    r = Runner(cfg, dims, random_weights(dims, seed=3), Platform("cpu", "cpu", "cpu", 2), metrics=m, faults=()).start()
    res = run_scenario(r)
    _, s = scrape(exp.url)
    exp_counts = res.expected_counts()
    assert exp_counts["mono"] > 0 and exp_counts["fallback"] > 0
    for p in ("mono", "fallback"):
        assert s[("monodecode_steps_total", (("path", p),))] == exp_counts[p]
    for reason in FALLBACK_REASONS:
        assert s[("monodecode_fallback_steps_total", (("reason", reason),))] == exp_counts.get(reason, 0)
    assert s[("monodecode_enabled", ())] == 1
    assert (
        s[
            (
                "monodecode_build_info",
                (("arch", "cpu"), ("backend", "reference"), ("build_key", r.build_key), ("version", "0.1.0")),
            )
        ]
        == 1
    )


def test_port_in_use_and_bad_ports_are_one_line_errors():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(MonodecodeError, match=f"metrics port {port} on 127.0.0.1 is already in use"):
            start_exporter(port, registry=CollectorRegistry())
    finally:
        sock.close()
    for bad in (-1, 70000, "80", True):
        with pytest.raises(MonodecodeError, match="metrics port must be an integer between 0 and 65535"):
            start_exporter(bad, registry=CollectorRegistry())


CHILD = textwrap.dedent(
    """
    import sys
    from monodecode.metrics import MonoMetrics
    m = MonoMetrics()
    role = sys.argv[1]
    if role == "rank0":
        m.set_enabled(True)
        for _ in range(3):
            m.count_step("mono")
        m.set_warmup(2.0, 0.01)
    else:
        m.set_enabled(False)
        m.count_step("fallback", "degraded")
        m.count_step("fallback", "degraded")
        m.set_warmup(3.0, 0.02)
        m.set_failstop_history({"wait_timeout": 1}, 1234.0)
    """
)


def test_multiprocess_mode_aggregates_processes(tmp_path, monkeypatch):
    mp = tmp_path / "prom"
    mp.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(mp), "PATH": "/usr/bin:/bin"}
    for role in ("rank0", "rank1"):
        subprocess.run([sys.executable, "-c", CHILD, role], env=env, check=True, timeout=60)
    assert len(list(mp.glob("*.db"))) >= 2  # each process wrote its own files
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp))
    exp = start_exporter(0)
    try:
        _, s = scrape(exp.url)
    finally:
        exp.stop()
    assert s[("monodecode_steps_total", (("path", "mono"),))] == 3
    assert s[("monodecode_steps_total", (("path", "fallback"),))] == 2
    assert s[("monodecode_fallback_steps_total", (("reason", "degraded"),))] == 2
    assert s[("monodecode_enabled", ())] == 0  # min over processes: one rank is degraded
    assert s[("monodecode_warmup_duration_seconds", ())] == 3.0  # max
    assert s[("monodecode_failstop_total", (("site", "wait_timeout"),))] == 1
    assert s[("monodecode_last_failstop_timestamp_seconds", ())] == 1234.0


def test_readme_table_is_the_contract():
    text = README.read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(monodecode_[a-z_]+)` \| (\w+) \| ([^|]*) \|", section, re.M)
    table = {name: (kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    assert table == {name: (kind, labels) for name, (kind, labels, _) in METRICS.items()}
    for value in FALLBACK_REASONS + FAILSTOP_SITES:
        assert f"`{value}`" in section


MULTIPROC_CHILD = """
import sys
from prometheus_client import CollectorRegistry
from monodecode.metrics import MonoMetrics
m = MonoMetrics(CollectorRegistry())
m.set_refusals(["no_artifact", "lora"])      # a refused start ...
m.set_build("flydsl", "gfx942", "k1", "0.1.0")
m.set_refusals(["kv_layout"])                 # ... then a degrade at binding replaces the reasons
m.set_build("reference", "cpu", "k2", "0.1.0")
if sys.argv[1] == "recovered":
    m.set_refusals([])                        # mono decode runs: no reason left
"""


@pytest.mark.parametrize("case", ["replaced", "recovered"])
def test_refusal_info_has_no_stale_reasons_under_multiprocess_collection(tmp_path, case):
    """What vLLM's API server serves under PROMETHEUS_MULTIPROC_DIR: the aggregate of every
    process's files, read here by prometheus-client's real MultiProcessCollector after the writer
    process exited. Replaced reasons and a replaced build must read 0, not their old 1."""
    from prometheus_client import multiprocess

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", MULTIPROC_CHILD, case], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    live = {
        s.labels["reason"]
        for fam in reg.collect()
        if fam.name == "monodecode_refusal_info"
        for s in fam.samples
        if s.value == 1
    }
    assert live == ({"kv_layout"} if case == "replaced" else set())
    builds = {
        s.labels["backend"]
        for fam in reg.collect()
        if fam.name == "monodecode_build_info"
        for s in fam.samples
        if s.value
    }
    assert builds == {"reference"}
