#!/usr/bin/env python3
"""Entry point of the monodecode images.

    (no arguments) | serve [MODEL] [vLLM args...]   vllm serve with mono decode enabled
    verify [args...]                                 monodecode-ops verify (node + self-test)
    monodecode-ops [args...]                         any monodecode-ops command
    anything else                                    run as given (bash, python3, ...)

``serve`` builds vLLM's ``--additional-config '{"monodecode": {...}}'`` from the environment,
validates it with the runtime's own ``MonoConfig`` (a bad value is one ``error:`` line and exit
code 2, before vLLM starts), and replaces this process with ``vllm serve`` so signals and the
exit status are vLLM's own. Environment (later rows override earlier ones):

    MONODECODE_CONFIG       JSON object with any monodecode option
    MONODECODE_ENABLED      true|false (default true: this image exists to run mono decode)
    MONODECODE_BACKEND      auto|flydsl|triton|reference
    MONODECODE_ON_REFUSAL   raise|degrade
    MONODECODE_WIDTHS       comma-separated step widths, e.g. 1,2,4,8
    MONODECODE_ALLOW_JIT    true|false
    MONODECODE_ARTIFACT_DIR the baked artifacts (set by the image)
    MONODECODE_MODEL        the model when no MODEL argument is given

Options given in an explicit ``--additional-config`` argument win over all of these.

``serve`` also prepares vLLM's environment for mono decode: ``PROMETHEUS_MULTIPROC_DIR`` is a
fresh, empty directory at every container start (a new temporary one, or the given one with
stale ``*.db`` files of an earlier container removed), so the workers' monodecode series reach
the API server's ``/metrics``; ``VLLM_KV_CACHE_LAYOUT=LBNHC`` (the token-major KV layout the
kernels read) unless set, when mono decode is enabled.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence

EXIT_USER_ERROR = 2
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class EntrypointError(ValueError):
    """A bad argument or environment value: printed as one line."""


def _bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise EntrypointError(f"{name} must be true or false, got {value!r}")


def _widths(name: str, value: str) -> list[int]:
    try:
        return [int(w) for w in value.replace(" ", "").split(",") if w]
    except ValueError:
        raise EntrypointError(f"{name} must be comma-separated integers, got {value!r}") from None


def _json_object(name: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise EntrypointError(f"{name} is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise EntrypointError(f"{name} must be a JSON object")
    return value


def monodecode_section(env: Mapping[str, str]) -> dict:
    """The ``monodecode`` options from the environment (not yet validated)."""
    section: dict = {}
    text = env.get("MONODECODE_CONFIG", "").strip()
    if text:
        section.update(_json_object("MONODECODE_CONFIG", text))
    section.setdefault("enabled", True)
    if "MONODECODE_ENABLED" in env:
        section["enabled"] = _bool("MONODECODE_ENABLED", env["MONODECODE_ENABLED"])
    if env.get("MONODECODE_BACKEND"):
        section["backend"] = env["MONODECODE_BACKEND"]
    if env.get("MONODECODE_ON_REFUSAL"):
        section["on_refusal"] = env["MONODECODE_ON_REFUSAL"]
    if env.get("MONODECODE_WIDTHS"):
        section["widths"] = _widths("MONODECODE_WIDTHS", env["MONODECODE_WIDTHS"])
    if "MONODECODE_ALLOW_JIT" in env:
        section["allow_jit"] = _bool("MONODECODE_ALLOW_JIT", env["MONODECODE_ALLOW_JIT"])
    if env.get("MONODECODE_ARTIFACT_DIR") and "artifact_dir" not in section:
        section["artifact_dir"] = env["MONODECODE_ARTIFACT_DIR"]
    return section


def _validate(section: dict, where: str) -> dict:
    # The runtime's own validation, so the image and the vLLM plugin agree on every option.
    try:
        from monodecode.config import MonoConfig
        from monodecode.errors import MonodecodeError
    except ImportError as e:  # the image always has monodecode; this guards a broken install
        raise EntrypointError(f"monodecode is not importable in this image: {e}") from None
    try:
        MonoConfig.from_dict(section, where=where)
    except MonodecodeError as e:
        raise EntrypointError(str(e)) from None
    return section


def _split_additional_config(args: Sequence[str]) -> tuple[list[str], dict | None]:
    """Remove ``--additional-config X`` / ``--additional-config=X`` from ``args``; return it parsed."""
    rest: list[str] = []
    found: dict | None = None
    i = 0
    while i < len(args):
        a = args[i]
        text = None
        if a == "--additional-config":
            if i + 1 >= len(args):
                raise EntrypointError("--additional-config needs a JSON object argument")
            text, i = args[i + 1], i + 2
        elif a.startswith("--additional-config="):
            text, i = a.split("=", 1)[1], i + 1
        else:
            rest.append(a)
            i += 1
            continue
        found = _json_object("--additional-config", text)
    return rest, found


def serve_command(args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The ``vllm serve`` command line for ``serve [MODEL] [args...]``."""
    rest, additional = _split_additional_config(list(args))
    if rest and not rest[0].startswith("-"):
        model, rest = rest[0], rest[1:]
    else:
        model = env.get("MONODECODE_MODEL", "")
    if not model:
        raise EntrypointError("no model: pass it as the first argument of serve or set MONODECODE_MODEL")
    additional = dict(additional or {})
    user_section = additional.get("monodecode") or {}
    if not isinstance(user_section, dict):
        raise EntrypointError("--additional-config: 'monodecode' must be a JSON object")
    section = {**monodecode_section(env), **user_section}
    additional["monodecode"] = _validate(section, "monodecode options")
    return ["vllm", "serve", model, "--additional-config", json.dumps(additional, sort_keys=True), *rest]


def serve_environment(cmd: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """Variables ``vllm serve`` needs for mono decode that are not set yet (no side effects)."""
    if cmd[:2] != ["vllm", "serve"]:
        return {}
    add: dict[str, str] = {}
    section = json.loads(cmd[cmd.index("--additional-config") + 1]).get("monodecode", {})
    if section.get("enabled") and not env.get("VLLM_KV_CACHE_LAYOUT"):
        add["VLLM_KV_CACHE_LAYOUT"] = "LBNHC"
    return add


def fresh_multiprocess_dir(env: Mapping[str, str]) -> str:
    """An empty PROMETHEUS_MULTIPROC_DIR for this container start."""
    given = env.get("PROMETHEUS_MULTIPROC_DIR")
    try:
        if not given:
            return tempfile.mkdtemp(prefix="monodecode-metrics-")
        os.makedirs(given, exist_ok=True)
        for stale in glob.glob(os.path.join(given, "*.db")):  # series of an earlier container
            os.unlink(stale)
    except OSError as e:
        raise EntrypointError(
            f"PROMETHEUS_MULTIPROC_DIR: cannot prepare {given or tempfile.gettempdir()}: {e.strerror}"
        ) from None
    return given


def command_for(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    args = list(argv)
    if not args or args[0] == "serve" or args[0].startswith("-"):
        return serve_command(args[1:] if args and args[0] == "serve" else args, env)
    if args[0] == "verify":
        return ["monodecode-ops", "verify", *args[1:]]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cmd = command_for(argv, os.environ)
        env_add = serve_environment(cmd, os.environ)
        if os.environ.get("MONODECODE_ENTRYPOINT_PRINT") == "1":
            # what would run; for checking a deployment's arguments
            print(json.dumps({"argv": cmd, "env": env_add}))
            return 0
        exe = shutil.which(cmd[0])
        if exe is None:
            hint = " (this image's base has no vLLM; `serve` needs a vLLM base image)" if cmd[0] == "vllm" else ""
            raise EntrypointError(f"{cmd[0]}: command not found{hint}")
        if cmd[:2] == ["vllm", "serve"]:
            env_add["PROMETHEUS_MULTIPROC_DIR"] = fresh_multiprocess_dir(os.environ)
    except EntrypointError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    sys.stdout.flush()
    os.execve(exe, cmd, {**os.environ, **env_add})
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
