"""Values that would render but break a cluster.

- every string value reaches the manifests as one quoted YAML scalar (a newline, `: ` or "true"
  cannot add keys or change a type), checked with the schema switched off so the templates alone
  are tested;
- the schema refuses control characters in every string value the templates render as a scalar;
- image.repository follows the OCI distribution reference grammar and a bad one is explained.
"""

from __future__ import annotations

import json

import pytest
import yaml
from test_helm_chart import CHART, MONITORING_APIS, helm, one, render

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())

# Strings the templates check themselves before rendering (so an injected value never renders):
# the image grammar check, the request <= limit check, and names resource names are made from.
CHECKED_BY_TEMPLATES = ("image.repository", "nameOverride", "fullnameOverride", "resources.")
# Rendered through toYaml/toJson (always quoted), or only used as a template branch (enums).
NOT_SCALARS = {"monodecode"}


def _schema_at(path: list[str]) -> dict:
    node = SCHEMA
    for key in path:
        while "$ref" in node:
            node = SCHEMA["definitions"][node["$ref"].split("/")[-1]]
        props = node.get("properties", {})
        node = props[key] if key in props else node.get("additionalProperties", {})
    while "$ref" in node:
        node = SCHEMA["definitions"][node["$ref"].split("/")[-1]]
    return node


def string_paths(values: dict = DEFAULTS, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """values.yaml's free-text string leaves (not enums, not the toJson'd monodecode block)."""
    out = []
    for key, value in values.items():
        path = (*prefix, key)
        if path[0] in NOT_SCALARS:
            continue
        if isinstance(value, dict):
            out += string_paths(value, path)
        elif isinstance(value, str) and "enum" not in _schema_at(list(path)):
            out.append(path)
    return out


def _set(values: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        values = values.setdefault(key, {})
    values[path[-1]] = value


def _scalars(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield k
            yield from _scalars(v)
    elif isinstance(node, list):
        for v in node:
            yield from _scalars(v)
    else:
        yield node


# Renders that between them use every string value (each source, each arch, digest or tag, every
# monitoring object); values a scenario would refuse as ignored are left at their defaults there.
EXTRA_APIS = [
    "keda.sh/v1alpha1/ScaledObject",
    "custom.metrics.k8s.io/v1beta1",
    "inference.networking.k8s.io/v1/InferencePool",
]
MONITORING_ON = {"prometheusRule": {"enabled": True}, "rulesConfigMap": {"enabled": True}}
SCENARIOS = {
    "hf-create-gfx942-servicemonitor": {
        "arch": "gfx942",
        "model": {"source": "hf", "hf": {"cache": {"type": "create"}}},
        "image": {"digests": {"gfx942": "", "gfx950": ""}},
        "monitoring": {"serviceMonitor": {"enabled": True}},
        "grafanaDashboard": {"enabled": True},
        "autoscaling": {"enabled": True, "kind": "keda", "maxReplicas": 1, "latency": {"enabled": True}},
        "ingress": {"enabled": True, "hosts": [{"host": "llm.example.com", "paths": [{"path": "/v1"}]}]},
        "router": {"inferencePool": {"enabled": True}},
        **MONITORING_ON,
    },
    "hf-pvc-gfx950-digest-podmonitor": {
        "arch": "gfx950",
        "model": {"source": "hf", "hf": {"cache": {"type": "pvc"}}},
        "monitoring": {"podMonitor": {"enabled": True}},
        "autoscaling": {"enabled": True, "kind": "hpa"},
    },
    "pvc-gfx950-tag": {"arch": "gfx950", "model": {"source": "pvc"}, "image": {"digests": {"gfx950": ""}}},
    "hostPath": {"model": {"source": "hostPath"}},
}
SOURCE_ONLY = {
    ("model", "hf", "cache", "claimName"): "hf-pvc",
    ("model", "hf", "cache", "storageClass"): "hf-create",
    ("model", "pvc", "claimName"): "pvc",
    ("model", "pvc", "path"): "pvc",
    ("model", "hostPath", "path"): "hostPath",
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def test_string_paths_cover_the_known_injection_sites():
    found = {".".join(p) for p in string_paths()}
    for path in (
        "model.hostPath.path",
        "model.pvc.claimName",
        "model.hf.cache.claimName",
        "model.hf.tokenSecret.name",
        "model.hf.tokenSecret.key",
        "nodeSelection.deviceIdLabel",
        "nodeSelection.partition.label",
        "priorityClassName",
        "gpuResourceName",
        "model.mountPath",
        "vllm.shmSize",
    ):
        assert path in found, path


def test_every_string_value_renders_as_one_scalar(tmp_path):
    """Each string value, set to text with a newline, `: ` and a leading `true`, arrives intact as
    (part of) one scalar in at least one scenario, and adds no key anywhere: no parse error, no
    boolean. The schema is skipped, so this is the templates' quoting alone."""
    markers = {}
    arrived: set[str] = set()
    for scenario, overrides in SCENARIOS.items():
        values: dict = {}
        for i, path in enumerate(string_paths()):
            dotted = ".".join(path)
            if dotted.startswith(CHECKED_BY_TEMPLATES) or not scenario.startswith(SOURCE_ONLY.get(path, scenario)):
                continue
            markers[dotted] = f"true\ninjected{i}: x #"
            _set(values, path, markers[dotted])
        values = _merge(values, overrides)
        values["podAnnotations"] = {"a": "true\ninjectedA: x"}
        values["nodeSelector"] = {"pool": "true\ninjectedN: x"}
        vf = tmp_path / f"{scenario}.yaml"
        vf.write_text(yaml.safe_dump(values))
        args = ["template", "rel", str(CHART), "-n", "llm", "-f", str(vf), "--skip-schema-validation"]
        for api in [*MONITORING_APIS, *EXTRA_APIS]:
            args += ["--api-versions", api]
        docs = [d for d in yaml.safe_load_all(helm(*args).stdout) if d]  # a parse error fails here
        texts = [s for d in docs for s in _scalars(d) if isinstance(s, str)]
        injected = [s for s in texts if s.startswith("injected")]
        assert not injected, f"{scenario}: a value added keys {injected}"
        arrived |= {p for p, m in markers.items() if any(m in t for t in texts)}
    lost = sorted(set(markers) - arrived)
    assert not lost, f"these values did not arrive as one string in any scenario: {lost}"


def test_a_true_claim_name_stays_a_string(tmp_path):
    docs = render(tmp_path, {"model": {"source": "pvc", "pvc": {"claimName": "true"}}})
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"]["claimName"] == "true"


def test_schema_refuses_control_characters_in_every_string(tmp_path):
    """One render with every free-text string holding a newline: the schema names each of them."""
    values: dict = {}
    paths = string_paths()
    for path in paths:
        _set(values, path, "a\nb")
    values["podLabels"] = {"team": "a\tb"}
    values["vllm"] = {**values.get("vllm", {}), "extraArgs": ["--x\n"]}
    values["env"] = [{"name": "A\x00", "value": "1"}]
    proc = render(tmp_path, values, check=False)
    assert proc.returncode != 0
    missing = [p for p in paths if f"at '/{'/'.join(p)}'" not in proc.stderr]
    assert not missing, f"the schema accepts a newline in {missing}:\n{proc.stderr}"
    for where in ("/podLabels/team", "/vllm/extraArgs/0", "/env/0/name"):
        assert f"at '{where}'" in proc.stderr, where


@pytest.mark.parametrize(
    "repository",
    [
        "vllm-monodecode",
        "registry.example.com/ml/vllm-monodecode",
        "registry.local:5000/team/x",
        "localhost/x",
        "LOCALHOST:5000/a/b",
        "Registry.Example.com/a__b/c-d/e.f",
        "[fe80::1]:5000/x",
        "docker.io/library/busybox",
    ],
)
def test_valid_image_repositories_render(tmp_path, repository):
    docs = render(tmp_path, {"image": {"repository": repository}})
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"].startswith(repository + ":")


BAD_REPOSITORIES = [
    ("UPPER/Case/../..//x", 'path component "Case" is not valid'),
    ("host/x:1.0", 'ends in the tag ":1.0": set the tag with image.tags.gfx942'),
    ("host/x@sha256:" + "a" * 64, "carries a digest: set it with image.digests.gfx942"),
    ("registry.example.com//x", "has an empty path component"),
    ("registry.example.com/x/", "has an empty path component"),
    ("ml/x_-y", 'path component "x_-y" is not valid'),
    ("ml/.x", 'path component ".x" is not valid'),
    ("bad_host.com/x", 'registry host "bad_host.com" is not valid'),
    ("registry.example.com:port/x", 'registry host "registry.example.com:port" is not valid'),
    ("a/" + "b" * 255, "is longer than 255 characters"),
]


@pytest.mark.parametrize("repository,message", BAD_REPOSITORIES, ids=[r[:24] for r, _ in BAD_REPOSITORIES])
def test_bad_image_repositories_are_explained(tmp_path, repository, message):
    proc = render(tmp_path, {"image": {"repository": repository}}, check=False)
    assert proc.returncode != 0, f"accepted image.repository {repository!r}"
    assert f'image.repository "{repository}"' in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "pattern" not in proc.stderr, "a raw regex message"
