"""images/build-config/build-system.lock pins what pyproject.toml's [build-system] asks for.

The wheels stage builds the monodecode wheel with exactly these pins (hash-checked, no build
isolation); the image tests (test_images.py) run that build for real.
"""

from __future__ import annotations

import re

import tomllib
from cli_helpers import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = ROOT / "images" / "build-config" / "build-system.lock"
PIN = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)==(?P<version>\S+) --hash=sha256:(?P<sha>[0-9a-f]{64})$")


def pins() -> dict[str, Version]:
    out = {}
    for line in LOCK.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = PIN.match(line)
        assert m, f"not 'name==version --hash=sha256:<64 hex>': {line!r}"
        out[canonicalize_name(m["name"])] = Version(m["version"])
    return out


def test_every_build_requirement_is_pinned_within_its_range_and_nothing_else():
    requires = [
        Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    ]
    pinned = pins()
    assert set(pinned) == {canonicalize_name(r.name) for r in requires}
    for r in requires:
        version = pinned[canonicalize_name(r.name)]
        assert r.specifier.contains(version), f"{r.name}=={version} does not satisfy {r}"


def test_the_wheels_stage_builds_with_the_lock_and_without_isolation():
    script = (ROOT / "images" / "build" / "resolve-wheels.sh").read_text()
    assert '--require-hashes --target "$STAGE/backend" -r "$CONF/build-system.lock"' in script
    assert "--no-build-isolation" in script
