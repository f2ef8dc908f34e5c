#!/usr/bin/env python3
"""Python-environment helpers that run INSIDE the image build (stdlib + pip only).

The runtime must be added to the base image without touching what the base brings (ROCm's
torch, vLLM, AITER, ...). So the wheels stage asks pip which distributions a plain install of
``monodecode[extras]`` would add while every installed distribution is pinned to its installed
version, downloads exactly those, and the runtime stage installs them offline with --no-deps
and checks afterwards that no distribution of the base changed.

Subcommands:
  snapshot OUT                    installed distributions {name: version} as JSON
  constraints OUT                 the same as a pip constraints file (PEP 440 versions only)
  plan REPORT OUT                 pip --dry-run --report JSON -> requirement lines to download, each
                                  with the sha256 the index gave (pip then checks every download)
  lock WHEELDIR PREFIX OUT        a requirements file of every wheel in WHEELDIR (as PREFIX/NAME) with
                                  its sha256: what the runtime stage installs with --require-hashes
  undisturbed BEFORE AFTER        exit 1 naming every base distribution that changed or vanished
  image-info --arch A --profiles P --artifacts DIR --out FILE
                                  versions + baked artifact summary, read back by monodecode-ops build
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import platform
import re
import sys
import tempfile


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    out: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata.get("Name") if dist.metadata else None
        if name:
            out.setdefault(_norm(name), dist.version)
    return dict(sorted(out.items()))


def _write(path: str, text: str) -> None:
    # temp file + rename: a failed build step never leaves half a file behind
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _pep440(version: str) -> bool:
    try:
        from pip._vendor.packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - pip always vendors packaging
        return bool(re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version))
    try:
        Version(version)
        return True
    except InvalidVersion:
        return False


def cmd_snapshot(args: argparse.Namespace) -> int:
    _write(args.out, json.dumps(installed(), indent=1) + "\n")
    return 0


def cmd_constraints(args: argparse.Namespace) -> int:
    # Versions pip cannot parse (some distro-packaged eggs) cannot be pinned; pip leaves
    # such distributions alone anyway unless asked to replace them.
    lines = [f"{n}=={v}" for n, v in installed().items() if _pep440(v)]
    _write(args.out, "\n".join(lines) + "\n")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    with open(args.report) as f:
        report = json.load(f)
    reqs = []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name, version = meta.get("name"), meta.get("version")
        if not name or not version:
            print(f"pyenv plan: pip report entry without name/version: {item!r}", file=sys.stderr)
            return 1
        if _norm(name) == "monodecode":
            continue  # our own wheel is already in the wheelhouse
        archive = (item.get("download_info") or {}).get("archive_info") or {}
        sha256 = (archive.get("hashes") or {}).get("sha256")
        if not sha256 and str(archive.get("hash", "")).startswith("sha256="):
            sha256 = archive["hash"].split("=", 1)[1]
        if not sha256 or not re.fullmatch(r"[0-9a-f]{64}", sha256):
            print(
                f"pyenv plan: the package index gave no sha256 for {name}=={version}; "
                "downloads are hash-checked, so the index must publish hashes",
                file=sys.stderr,
            )
            return 1
        reqs.append(f"{name}=={version} --hash=sha256:{sha256}")
    _write(args.out, "".join(r + "\n" for r in reqs))
    names = " ".join(r.split(" ", 1)[0] for r in reqs)
    print(f"pyenv plan: the base lacks {len(reqs)} distribution(s): {names or '(none)'}")
    return 0


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cmd_lock(args: argparse.Namespace) -> int:
    wheels = sorted(n for n in os.listdir(args.wheeldir) if n.endswith(".whl"))
    if not wheels:
        print(f"pyenv lock: no wheels in {args.wheeldir}", file=sys.stderr)
        return 1
    lines = [f"{args.prefix.rstrip('/')}/{n} --hash=sha256:{_sha256(os.path.join(args.wheeldir, n))}" for n in wheels]
    _write(args.out, "".join(line + "\n" for line in lines))
    return 0


def cmd_undisturbed(args: argparse.Namespace) -> int:
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    changed = [f"{n} {v} -> {after.get(n, 'removed')}" for n, v in before.items() if after.get(n) != v]
    if changed:
        print("pyenv: installing the runtime changed the base image's packages: " + "; ".join(changed), file=sys.stderr)
        return 1
    added = sorted(set(after) - set(before))
    print(f"pyenv: base packages untouched; added {len(added)}: {' '.join(added)}")
    return 0


def _version_of(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def cmd_image_info(args: argparse.Namespace) -> int:
    manifest_path = os.path.join(args.artifacts, "manifest.json")
    with open(manifest_path, "rb") as f:
        manifest_bytes = f.read()
    manifest = json.loads(manifest_bytes)
    entries = manifest.get("artifacts", [])
    compilers = sorted({f"{e['compiler']['name']}={e['compiler']['version']}" for e in entries})
    info = {
        "schema": 1,
        "arch": args.arch,
        "profiles": [p for p in re.split(r"[,\s]+", args.profiles) if p],
        # the reference backend needs no artifacts and is always there
        "backends": sorted({e["backend"] for e in entries} | {"reference"}),
        "build_keys": sorted(e["build_key"] for e in entries),
        "manifest_digest": "sha256:" + hashlib.sha256(manifest_bytes).hexdigest(),
        "compilers": compilers,
        "precompile": args.precompile,
        "versions": {
            "python": platform.python_version(),
            "monodecode": _version_of("monodecode"),
            "torch": _version_of("torch"),
            "vllm": _version_of("vllm"),
            "flydsl": _version_of("flydsl"),
            "triton": _version_of("triton"),
        },
    }
    _write(args.out, json.dumps(info, indent=2, sort_keys=True) + "\n")
    print(json.dumps(info, sort_keys=True))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="pyenv.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("out")
    s.set_defaults(fn=cmd_snapshot)
    s = sub.add_parser("constraints")
    s.add_argument("out")
    s.set_defaults(fn=cmd_constraints)
    s = sub.add_parser("plan")
    s.add_argument("report")
    s.add_argument("out")
    s.set_defaults(fn=cmd_plan)
    s = sub.add_parser("lock")
    s.add_argument("wheeldir")
    s.add_argument("prefix")
    s.add_argument("out")
    s.set_defaults(fn=cmd_lock)
    s = sub.add_parser("undisturbed")
    s.add_argument("before")
    s.add_argument("after")
    s.set_defaults(fn=cmd_undisturbed)
    s = sub.add_parser("image-info")
    s.add_argument("--arch", required=True)
    s.add_argument("--profiles", required=True)
    s.add_argument("--artifacts", required=True)
    s.add_argument("--precompile", required=True, help="what baked the artifacts (a sentence)")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=cmd_image_info)
    args = p.parse_args()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
