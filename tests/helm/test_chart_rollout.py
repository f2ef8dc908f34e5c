"""Rollouts and drains: the preStop hook and vLLM's drain fit in the grace period, pods spread
over topology domains, and a RollingUpdate surges only when asked to."""

from __future__ import annotations

from test_helm_chart import arg_after, one, render, validate_strict


def _pod(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def test_default_pod_stops_routing_then_drains_within_the_grace_period(tmp_path):
    docs = render(tmp_path, {})
    validate_strict(one(docs, "Deployment"))
    pod = _pod(docs)
    (c,) = pod["containers"]
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == ["sleep", "10"]
    drain = int(arg_after(c["args"], "--shutdown-timeout"))
    assert drain == 45
    # the kubelet's grace period covers the preStop hook and SIGTERM -> SIGKILL
    assert int(sleep[1]) + drain + 5 <= pod["terminationGracePeriodSeconds"] == 60


def test_drain_can_be_switched_off(tmp_path):
    pod = _pod(render(tmp_path, {"lifecycle": {"preStopSleepSeconds": 0, "drainSeconds": 0}}))
    (c,) = pod["containers"]
    assert "lifecycle" not in c and "--shutdown-timeout" not in c["args"]


def test_long_drain_with_a_long_grace_period(tmp_path):
    values = {"terminationGracePeriodSeconds": 330, "lifecycle": {"preStopSleepSeconds": 25, "drainSeconds": 300}}
    pod = _pod(render(tmp_path, values))
    assert arg_after(pod["containers"][0]["args"], "--shutdown-timeout") == "300"
    assert pod["terminationGracePeriodSeconds"] == 330


def test_topology_spread_selects_the_release_pods(tmp_path):
    own = {"matchLabels": {"team": "a"}}
    values = {
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"},
            {
                "maxSkew": 2,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": own,
            },
        ]
    }
    docs = render(tmp_path, values)
    dep = one(docs, "Deployment")
    validate_strict(dep)
    zone, host = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert zone["labelSelector"] == {"matchLabels": dep["spec"]["selector"]["matchLabels"]}
    assert zone["topologyKey"] == "topology.kubernetes.io/zone" and zone["maxSkew"] == 1
    assert host["labelSelector"] == own
    assert "topologySpreadConstraints" not in _pod(render(tmp_path, {}))


def test_rolling_update_surges_only_when_asked(tmp_path):
    values = {"rollout": {"strategy": "RollingUpdate", "maxSurge": 1, "maxUnavailable": 1}, "replicaCount": 4}
    dep = one(render(tmp_path, values), "Deployment")
    validate_strict(dep)
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 1}}
    # a shared (ReadWriteMany) created cache is fine with a surge pod
    values["model"] = {"hf": {"cache": {"type": "create", "accessModes": ["ReadWriteMany"]}}}
    assert one(render(tmp_path, values), "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
