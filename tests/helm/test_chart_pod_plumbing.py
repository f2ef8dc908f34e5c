"""Pod plumbing: extra volumes, mounts and sidecars, runtimeClassName, scratch size limits and
ephemeral-storage, and a shared ReadWriteMany model cache for several replicas."""

from __future__ import annotations

import pytest
from test_helm_chart import one, render, restricted_violations, validate_strict

SIDECAR = {"name": "log-shipper", "image": "registry.local/shipper:1.0", "args": ["--follow"]}


def _pod(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def test_extra_volumes_mounts_sidecars_and_runtime_class(tmp_path):
    values = {
        "extraVolumes": [{"name": "certs", "secret": {"secretName": "corp-ca"}}],
        "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/corp", "readOnly": True}],
        "extraContainers": [SIDECAR],
        "runtimeClassName": "rocm",
    }
    dep = one(render(tmp_path, values), "Deployment")
    validate_strict(dep)
    pod = dep["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "rocm"
    vllm, sidecar = pod["containers"]
    assert vllm["name"] == "vllm" and vllm["volumeMounts"][-1] == values["extraVolumeMounts"][0]
    assert pod["volumes"][-1] == values["extraVolumes"][0]
    # the sidecar gets the chart's restricted securityContext, so the pod stays restricted
    assert sidecar == {**SIDECAR, "securityContext": vllm["securityContext"]}
    assert restricted_violations(pod) == []


def test_scratch_volumes_have_size_limits_and_ephemeral_storage_renders(tmp_path):
    values = {
        "resources": {
            "requests": {"ephemeral-storage": "30Gi"},
            "limits": {"ephemeral-storage": "130Gi", "memory": "192Gi"},
        },
        "scratch": {"tmpSizeLimit": "2Gi", "cacheSizeLimit": "24Gi"},
    }
    pod = _pod(render(tmp_path, values))
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tmp"]["emptyDir"] == {"sizeLimit": "2Gi"}
    assert volumes["cache"]["emptyDir"] == {"sizeLimit": "24Gi"}
    assert volumes["failstop"]["emptyDir"] == {"sizeLimit": "16Mi"}
    assert volumes["model"]["emptyDir"] == {"sizeLimit": "100Gi"}
    resources = pod["containers"][0]["resources"]
    assert resources["requests"]["ephemeral-storage"] == "30Gi" and resources["limits"]["ephemeral-storage"] == "130Gi"


def test_shared_read_write_many_cache_for_several_replicas(tmp_path):
    values = {
        "replicaCount": 3,
        "model": {"hf": {"cache": {"type": "create", "accessModes": ["ReadWriteMany"], "storageClass": "nfs"}}},
    }
    docs = render(tmp_path, values)
    pvc = one(docs, "PersistentVolumeClaim")
    validate_strict(pvc)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "nfs"
    dep = one(docs, "Deployment")
    assert dep["spec"]["replicas"] == 3
    model = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
    assert model == {"name": "model", "persistentVolumeClaim": {"claimName": pvc["metadata"]["name"]}}


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {"extraVolumes": [{"name": "cache", "emptyDir": {}}]},
            "extraVolumes has a volume named cache, a name the chart uses",
        ),
        (
            {"extraVolumeMounts": [{"name": "x", "mountPath": "/models/"}]},
            "extraVolumeMounts mounts x at /models/, where the chart mounts its own volume",
        ),
        ({"extraVolumeMounts": [{"name": "x", "mountPath": "/tmp"}]}, "where the chart mounts its own volume"),
        ({"extraContainers": [{"name": "vllm", "image": "x"}]}, "extraContainers has a container named vllm"),
        (
            {"extraContainers": [{**SIDECAR, "securityContext": {"privileged": True}}]},
            "at '/extraContainers/0/securityContext",
        ),
        ({"extraContainers": [{"name": "side"}]}, "at '/extraContainers/0': missing property 'image'"),
        ({"runtimeClassName": "ROCm"}, "at '/runtimeClassName'"),
        ({"scratch": {"tmpSizeLimit": "lots"}}, "at '/scratch/tmpSizeLimit'"),
        (
            {"resources": {"limits": {"ephemeral-storage": "50Gi", "memory": "192Gi"}}},
            "resources.limits.ephemeral-storage (50Gi) is below the size limits of the pod's disk emptyDirs "
            "(cache 20Gi + failstop 16Mi + tmp 4Gi + model 100Gi)",
        ),
        (
            {"resources": {"requests": {"ephemeral-storage": "200Gi"}, "limits": {"ephemeral-storage": "150Gi"}}},
            "resources.requests.ephemeral-storage (200Gi) is more than resources.limits.ephemeral-storage (150Gi)",
        ),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_bad_plumbing_values(tmp_path, values, message):
    proc = render(tmp_path, values, check=False)
    assert proc.returncode != 0, f"accepted {values}"
    assert message in proc.stderr, proc.stderr
