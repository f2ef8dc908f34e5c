#!/usr/bin/env python3
"""Entry point of the monodecode images.

    (no arguments) | serve [MODEL] [vLLM args...]   vllm serve with mono decode enabled
    verify [args...]                                 monodecode-ops verify (node + self-test)
    monodecode-ops [args...]                         any monodecode-ops command
    anything else                                    run as given (bash, python3, ...)

``serve`` builds vLLM's ``--additional-config '{"monodecode": {...}}'``, validates the whole
additional config with the runtime's own ``MonoConfig.from_additional_config`` (a bad value is
one ``error:`` line and exit code 2, before vLLM starts), and runs ``vllm serve``: with mono decode
enabled under ``monodecode.runtime.supervise`` (signals forwarded; the exit status is vLLM's, or 70
when a worker fail-stopped during the run, which vLLM's API server reports as a clean exit 0, so the
container's last exit code tells), otherwise by replacing this process. The monodecode options come
from, later ones winning:

    the image's defaults       enabled = true (this image exists to run mono decode), and
                               MONODECODE_ARTIFACT_DIR (the baked artifacts, set by the image)
    MONODECODE_CONFIG          a JSON object with any option
    MONODECODE_<FIELD>         one option each, for every field of MonoConfig (MONODECODE_WIDTHS=1,2,4,
                               MONODECODE_ON_REFUSAL=degrade, MONODECODE_ALLOW_JIT=false, ...); empty = unset
    --additional-config JSON   its "monodecode" object (given at most once)

``MONODECODE_MODEL`` names the model when no MODEL argument is given. ``exit_on_failstop`` cannot
be turned off for ``serve`` (only in-process tests may keep running after a fail-stop).

With mono decode enabled, ``serve`` selects an attention backend + KV cache layout pair mono decode
supports on this platform, exactly ``monodecode.vllm_plugin.serving.serve_settings(platform,
backend)``: the platform's default pair (on ROCm AMD's recommended setting, AITER on:
``ROCM_AITER_FA``), or the pair of the ``--attention-backend`` the operator gives (on ROCm also
``ROCM_AITER_UNIFIED_ATTN``, or ``TRITON_ATTN`` with AITER off); it adds ``--attention-backend``
and the pair's environment (``VLLM_KV_CACHE_LAYOUT``, ``VLLM_ROCM_USE_AITER``). A backend outside
the platform's pairs, or an environment value that contradicts the pair, is an error. The platform is ``MONODECODE_SERVE_PLATFORM`` (rocm, cuda, cpu) or else what the
image's torch was built for. ``PROMETHEUS_MULTIPROC_DIR`` is a fresh directory made at every
start (inside the given ``PROMETHEUS_MULTIPROC_DIR``, or the temporary directory), so the workers'
monodecode series reach the API server's ``/metrics``; nothing the entrypoint did not create is
ever deleted (stale directories of earlier starts are cleared only under the private temporary
directory). ``MONODECODE_ENTRYPOINT_PRINT=1`` prints ``{"argv": [...], "env": {...}}`` instead.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence

EXIT_USER_ERROR = 2
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_INT = re.compile(r"[+-]?[0-9]{1,18}")
ENV_PREFIX = "MONODECODE_"
# Options the image's own ENV sets: defaults that MONODECODE_CONFIG may override.
IMAGE_DEFAULTS = ("artifact_dir",)
ADDITIONAL_CONFIG = ("--additional-config", "--additional_config")
ATTENTION_BACKEND = ("--attention-backend", "--attention_backend")
PLATFORMS = ("rocm", "cuda", "cpu")
METRICS_DIR_PREFIX = "monodecode-metrics-"
METRICS_DIR_MARKER = ".monodecode-entrypoint"  # in every metrics directory this script made


class EntrypointError(ValueError):
    """A bad argument or environment value: printed as one line."""


def _shown(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise EntrypointError(f"{name} must be true or false, got {_shown(value)}")


def _int(name: str, value: str) -> int:
    if not _INT.fullmatch(value.strip()):
        raise EntrypointError(f"{name} must be an integer, got {_shown(value)}")
    return int(value.strip())


def _float(name: str, value: str) -> float:
    try:
        return float(value.strip())
    except ValueError:
        raise EntrypointError(f"{name} must be a number, got {_shown(value)}") from None


def _widths(name: str, value: str) -> list[int]:
    items = value.replace(" ", "").split(",")
    if not all(_INT.fullmatch(w) for w in items):
        raise EntrypointError(f"{name} must be comma-separated integers, got {_shown(value)}")
    return [int(w) for w in items]


def load_json(name: str, text: str) -> object:
    """The runtime's reader of outside JSON (``monodecode.jsonio``): bad syntax, nesting, huge or
    non-finite numbers are one line."""
    try:
        from monodecode.errors import MonodecodeError
        from monodecode.jsonio import parse_json
    except ImportError as e:  # the image always has monodecode; this guards a broken install
        raise EntrypointError(f"monodecode is not importable in this image: {e}") from None
    try:
        return parse_json(text, name)
    except MonodecodeError as e:
        raise EntrypointError(str(e)) from None


def _json_object(name: str, text: str) -> dict:
    value = load_json(name, text)
    if not isinstance(value, dict):
        raise EntrypointError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def _config_fields() -> dict[str, str]:
    """MonoConfig's fields -> how an environment string becomes that field's value."""
    import dataclasses
    import typing

    try:
        from monodecode.config import MonoConfig
    except ImportError as e:  # the image always has monodecode; this guards a broken install
        raise EntrypointError(f"monodecode is not importable in this image: {e}") from None
    hints = typing.get_type_hints(MonoConfig)
    kinds = {}
    for f in dataclasses.fields(MonoConfig):
        hint = hints[f.name]
        if hint is bool:
            kinds[f.name] = "bool"
        elif hint is int:
            kinds[f.name] = "int"
        elif hint is float:
            kinds[f.name] = "float"
        elif typing.get_origin(hint) is tuple and typing.get_args(hint)[:1] == (int,):
            kinds[f.name] = "ints"
        elif hint is str or set(typing.get_args(hint)) == {str, type(None)}:
            kinds[f.name] = "str"
        else:  # any other type: the variable holds its JSON value
            kinds[f.name] = "json"
    return kinds


def _from_env(name: str, text: str, kind: str) -> object:
    if kind == "bool":
        return _bool(name, text)
    if kind == "int":
        return _int(name, text)
    if kind == "float":
        return _float(name, text)
    if kind == "ints":
        return _widths(name, text)
    if kind == "json":
        return load_json(name, text)
    return text


def monodecode_section(env: Mapping[str, str]) -> dict:
    """The ``monodecode`` options from the environment (validated later, with the rest)."""
    fields = _config_fields()

    def env_value(field: str) -> object:
        name = ENV_PREFIX + field.upper()
        return _from_env(name, env[name], fields[field])

    section: dict = {"enabled": True}
    for field in IMAGE_DEFAULTS:
        if env.get(ENV_PREFIX + field.upper()):
            section[field] = env_value(field)
    text = env.get(ENV_PREFIX + "CONFIG", "")
    if text.strip():
        section.update(_json_object(ENV_PREFIX + "CONFIG", text))
    for field in fields:
        if field not in IMAGE_DEFAULTS and env.get(ENV_PREFIX + field.upper()):
            section[field] = env_value(field)
    return section


def _split_additional_config(args: Sequence[str]) -> tuple[list[str], dict | None]:
    """Remove ``--additional-config X`` / ``--additional-config=X`` from ``args``; return it parsed."""
    rest: list[str] = []
    found: dict | None = None
    i = 0
    while i < len(args):
        a = args[i]
        flag = next((f for f in ADDITIONAL_CONFIG if a == f or a.startswith(f + "=")), None)
        if flag is None:
            rest.append(a)
            i += 1
            continue
        if a == flag:
            if i + 1 >= len(args):
                raise EntrypointError("--additional-config needs a JSON object argument")
            text, i = args[i + 1], i + 2
        else:
            text, i = a.split("=", 1)[1], i + 1
        if found is not None:
            raise EntrypointError("--additional-config is given twice; put every option in one JSON object")
        found = _json_object("--additional-config", text)
    return rest, found


def _validate(additional: dict) -> None:
    # The runtime's own validation of what vLLM will get, so the image and the plugin agree.
    try:
        from monodecode.config import MonoConfig
        from monodecode.errors import MonodecodeError
    except ImportError as e:
        raise EntrypointError(f"monodecode is not importable in this image: {e}") from None
    try:
        cfg = MonoConfig.from_additional_config(additional)
    except MonodecodeError as e:
        raise EntrypointError(str(e)) from None
    if not cfg.exit_on_failstop:
        raise EntrypointError(
            "monodecode option 'exit_on_failstop' is false: serve always exits on a fail-stop "
            "(false is for in-process tests only)"
        )


def serve_platform(env: Mapping[str, str]) -> str:
    """rocm, cuda or cpu: ``MONODECODE_SERVE_PLATFORM``, else what this image's torch is built for."""
    given = env.get(ENV_PREFIX + "SERVE_PLATFORM", "").strip()
    if given:
        if given not in PLATFORMS:
            raise EntrypointError(
                f"{ENV_PREFIX}SERVE_PLATFORM must be one of {', '.join(PLATFORMS)}, got {_shown(given)}"
            )
        return given
    try:
        import torch
    except ImportError:
        return "cpu"
    if getattr(torch.version, "hip", None):
        return "rocm"
    return "cuda" if getattr(torch.version, "cuda", None) else "cpu"


def _option_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def serve_settings_for(args: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The arguments to add and the environment to set so vLLM runs an attention backend + KV
    layout pair mono decode supports here (``serving.serve_settings``: the one the operator's
    ``--attention-backend`` names, else the platform's default); an unsupported backend or a
    conflicting environment value is an ``EntrypointError``."""
    from monodecode.errors import MonodecodeError
    from monodecode.vllm_plugin.serving import serve_settings

    platform = serve_platform(env)
    given = _option_value(args, ATTENTION_BACKEND)
    try:
        settings = serve_settings(platform, given)
    except MonodecodeError as e:
        raise EntrypointError(f"--attention-backend: {e} (or disable mono decode)") from None
    add_args = list(settings.args) if given is None else []
    add_env = {}
    for key, value in settings.env.items():
        if env.get(key) not in (None, value):
            raise EntrypointError(
                f"{key}={_shown(env[key])}: mono decode on {platform} with {settings.attention_backend} needs "
                f"{key}={value} (unset it, or disable mono decode)"
            )
        add_env[key] = value
    return add_args, add_env


def serve_command(args: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` command line for ``serve [MODEL] [args...]`` and the environment it adds."""
    rest, additional = _split_additional_config(list(args))
    if rest and not rest[0].startswith("-"):
        model, rest = rest[0], rest[1:]
    else:
        model = env.get(ENV_PREFIX + "MODEL", "")
    if not model:
        raise EntrypointError("no model: pass it as the first argument of serve or set MONODECODE_MODEL")
    additional = dict(additional or {})
    user_section = additional.get("monodecode", {})
    if not isinstance(user_section, dict):
        raise EntrypointError(f"--additional-config: 'monodecode' must be a JSON object, got {_shown(user_section)}")
    additional["monodecode"] = {**monodecode_section(env), **user_section}
    _validate(additional)
    add_env: dict[str, str] = {}
    if additional["monodecode"].get("enabled"):
        add_args, add_env = serve_settings_for(rest, env)
        rest = [*rest, *add_args]
    try:
        text = json.dumps(additional, sort_keys=True)
    except (RecursionError, ValueError):
        raise EntrypointError("--additional-config is nested too deeply") from None
    cmd = ["vllm", "serve", model, "--additional-config", text, *rest]
    if any("\0" in a for a in cmd):
        raise EntrypointError("an argument contains a NUL byte")
    return cmd, add_env


def fresh_multiprocess_dir(env: Mapping[str, str]) -> str:
    """A new, empty PROMETHEUS_MULTIPROC_DIR for this start. Made inside the given directory (whose
    contents are never touched) or the temporary directory; only there are directories of earlier
    starts that this script made (its marker file inside) cleared of their ``*.db`` files."""
    given = env.get("PROMETHEUS_MULTIPROC_DIR", "")
    parent = given or tempfile.gettempdir()
    try:
        if given:
            if not os.path.isabs(given) or "\0" in given:
                raise EntrypointError(f"PROMETHEUS_MULTIPROC_DIR must be an absolute path, got {_shown(given)}")
            os.makedirs(given, exist_ok=True)
        else:
            _clear_earlier_starts(parent)
        path = tempfile.mkdtemp(prefix=METRICS_DIR_PREFIX, dir=parent)
        with open(os.path.join(path, METRICS_DIR_MARKER), "w") as f:
            f.write("made by the monodecode image entrypoint for one container start\n")
    except OSError as e:
        raise EntrypointError(
            f"PROMETHEUS_MULTIPROC_DIR: cannot prepare a directory in {parent}: {e.strerror}"
        ) from None
    return path


def _clear_earlier_starts(parent: str) -> None:
    for old in glob.glob(os.path.join(glob.escape(parent), METRICS_DIR_PREFIX + "*")):
        marker = os.path.join(old, METRICS_DIR_MARKER)
        if os.path.islink(old) or not os.path.isfile(marker):
            continue  # not one of ours
        for db in glob.glob(os.path.join(glob.escape(old), "*.db")):
            if os.path.isfile(db) and not os.path.islink(db):
                os.unlink(db)
        os.unlink(marker)
        try:
            os.rmdir(old)
        except OSError:
            pass  # something else is in it: left alone


def command_for(argv: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """What to run for ``argv``, and the environment it adds."""
    args = list(argv)
    if not args or args[0] == "serve" or args[0].startswith("-"):
        return serve_command(args[1:] if args and args[0] == "serve" else args, env)
    if args[0] == "verify":
        return ["monodecode-ops", "verify", *args[1:]], {}
    return args, {}


def _error_line(message: str) -> str:
    # one line, printable on any stderr encoding
    text = " ".join(str(message).split())[:2000]
    return "error: " + text.encode("ascii", "backslashreplace").decode("ascii")


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    environ = os.environ if environ is None else environ
    try:
        cmd, env_add = command_for(argv, environ)
        if environ.get(ENV_PREFIX + "ENTRYPOINT_PRINT") == "1":
            # what would run; for checking a deployment's arguments
            print(json.dumps({"argv": cmd, "env": env_add}))
            return 0
        exe = shutil.which(cmd[0])
        if exe is None:
            hint = " (this image's base has no vLLM; `serve` needs a vLLM base image)" if cmd[0] == "vllm" else ""
            raise EntrypointError(f"{cmd[0]}: command not found{hint}")
        if cmd[:2] == ["vllm", "serve"]:
            env_add["PROMETHEUS_MULTIPROC_DIR"] = fresh_multiprocess_dir(environ)
    except EntrypointError as e:
        print(_error_line(str(e)), file=sys.stderr)
        return EXIT_USER_ERROR
    sys.stdout.flush()
    failstop_dir = _supervised_failstop_dir(cmd)
    if failstop_dir is not None:
        from monodecode.runtime.supervise import run_supervised

        return run_supervised([exe, *cmd[1:]], {**environ, **env_add}, failstop_dir)
    os.execve(exe, cmd, {**environ, **env_add})
    return 127  # not reached


def _supervised_failstop_dir(cmd: Sequence[str]) -> str | None:
    """The fail-stop directory of a ``vllm serve`` with mono decode enabled (None: nothing to watch)."""
    if cmd[:2] != ["vllm", "serve"] or "--additional-config" not in cmd:
        return None
    from monodecode.config import MonoConfig

    cfg = MonoConfig.from_additional_config(json.loads(cmd[cmd.index("--additional-config") + 1]))
    return cfg.failstop_dir if cfg.enabled else None


if __name__ == "__main__":
    sys.exit(main())
