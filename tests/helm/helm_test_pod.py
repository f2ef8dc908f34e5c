"""Run the chart's `helm test` pod command here, as the pod would: busybox applets only, the
pod's API_KEY, a base URL in place of the Service's (tests/helm and tests/e2e use it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

APPLETS = ("sh", "wget", "awk", "grep", "sed", "sleep", "date", "timeout", "head", "printf", "cat", "[")


def busybox_path(tmp: Path) -> str:
    """A PATH of busybox applets only (what the test pod's busybox image has): GNU-only options
    in the script fail here as they would in the pod."""
    busybox = shutil.which("busybox")
    if not busybox:
        pytest.fail("busybox is not installed: the Debian package busybox is in scripts/apt-packages.txt (make test)")
    bin_dir = tmp / "busybox-bin"
    bin_dir.mkdir(exist_ok=True)
    for applet in APPLETS:
        link = bin_dir / applet
        if not link.exists():
            link.symlink_to(busybox)
    return str(bin_dir)


def run_helm_test_pod(docs: list[dict], base: str, tmp: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The rendered test pod's command against `base`; a Secret's API_KEY reads "secret-key"."""
    (pod,) = [d for d in docs if d["kind"] == "Pod" and d["metadata"]["name"].endswith("-verify")]
    c = pod["spec"]["containers"][0]
    command = list(c["command"])
    assert command[4].startswith("http://"), command[4]
    command[4] = base
    pod_env = {e["name"]: "secret-key" for e in c.get("env", []) if e["name"] == "API_KEY"}
    full_env = {"PATH": busybox_path(tmp), **pod_env, **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=full_env)
