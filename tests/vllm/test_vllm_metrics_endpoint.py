"""Where the runner's series can be scraped: vLLM's own API server app (``build_app``, the app
`vllm serve` runs) on 127.0.0.1, next to vLLM's ``vllm:`` series, with a separate process in
the role of a vLLM worker running our model override (real vLLM loader, mono decode on, one
mono step and one fallback step).

Proof of both directions:
- with ``PROMETHEUS_MULTIPROC_DIR`` set for the server and its workers (as `vllm serve` children
  inherit it), the worker's ``monodecode_*`` series appear on the server's /metrics;
- without it they do not (each process keeps its own registry), so the deployment must set it:
  vLLM 0.33 creates the directory itself only for ``--api-server-count`` > 1.
``monodecode-ops verify --endpoint`` (the CLI from the main venv, what `helm test` runs) checks
the same page: it passes in the first case and fails in the second.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_testlib import PYTHON, REPO, free_port

# the operator CLI lives in the main venv (Makefile: $(VENV), default .venv next to .venv-vllm)
OPS_CLI = REPO / os.environ.get("MONODECODE_MAIN_VENV", ".venv") / "bin" / "monodecode-ops"

SERVER = """
import sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.app import build_app
from vllm.v1.metrics.loggers import PrometheusStatLogger
import uvicorn

model_dir, port = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, %(testdir)r)
from vllm_testlib import make_serve_arg_parser
args = make_serve_arg_parser().parse_args(
    ["--model", model_dir, "--skip-tokenizer-init", "--max-model-len", "256", "--enforce-eager"])
cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
PrometheusStatLogger(cfg, engine_indexes=[0])  # vLLM's own series, as the API server registers them
app = build_app(args, supported_tasks=("generate",), model_config=cfg.model_config)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
"""

WORKER = """
import sys, torch
sys.path.insert(0, %(testdir)r)
from vllm_testlib import bind_vllm_kv, engine_config, init_one_rank, load_model
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

opts = {"enabled": True, "backend": "reference", "widths": [1, 2], "failstop_dir": %(tmp)r + "/fs",
        "termination_log": %(tmp)r + "/term", "exit_on_failstop": False}
cfg = engine_config(%(model)r, compilation_config={"custom_ops": ["none"]}, additional_config={"monodecode": opts})
init_one_rank(cfg)
model = load_model(cfg)
bind_vllm_kv(model, cfg)
names = [layer.self_attn.attn.layer_name for layer in model.model.layers]
md = CPUAttentionMetadata(num_actual_tokens=1, max_query_len=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                          max_seq_len=3, seq_lens=torch.tensor([3], dtype=torch.int32),
                          block_table=torch.tensor([[0]], dtype=torch.int32), slot_mapping=torch.tensor([2]),
                          scheduler_metadata=None)
with set_current_vllm_config(cfg):
    with set_forward_context({n: md for n in names}, cfg, num_tokens=1):
        model.compute_logits(model(torch.tensor([5]), torch.tensor([2])))   # a mono step
    # a prefill step: decided and counted as a fallback (its stock forward needs vLLM's CPU
    # attention kernels, which the CUDA wheel lacks, so only the decision and the logits run)
    prefill = CPUAttentionMetadata(num_actual_tokens=2, max_query_len=2,
                                   query_start_loc=torch.tensor([0, 2], dtype=torch.int32), max_seq_len=2,
                                   seq_lens=torch.tensor([2], dtype=torch.int32),
                                   block_table=torch.tensor([[1]], dtype=torch.int32), slot_mapping=torch.tensor([128, 129]),
                                   scheduler_metadata=None)
    with set_forward_context({n: prefill for n in names}, cfg, num_tokens=2):
        assert model.mono.plan(torch.tensor([0, 1])) is None
    model.compute_logits(torch.zeros(2, model.config.hidden_size, dtype=torch.bfloat16))
print("WORKER-DONE", model.mono.state, flush=True)
"""


def _scrape(port: int, server: subprocess.Popen, log: Path, timeout_s: float = 240.0) -> str:
    """The server's /metrics page once it listens; a server that exits or never listens fails the
    test with the tail of its log (its output goes to a file: a pipe nobody reads until the end
    can fill and stall it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return r.read().decode()
        except OSError as e:
            code = server.poll()
            if code is not None or time.monotonic() > deadline:
                state = f"exited with {code}" if code is not None else f"not listening after {timeout_s:.0f} s"
                pytest.fail(f"the API server {state} ({e}); its log ends:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)


def _series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.mark.parametrize("multiproc", [True, False], ids=["multiproc-dir", "no-multiproc-dir"])
def test_runner_series_on_vllm_api_server_metrics(multiproc, model_dirs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    if multiproc:
        mp = tmp_path / "prom"
        mp.mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(mp)
    port = free_port()
    model = str(model_dirs["gemma3"])
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [PYTHON, "-c", SERVER % {"testdir": str(REPO / "tests" / "vllm")}, model, str(port)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # the server listening before the worker starts: the worker's gloo sockets take ports of
        # their own, and the server's, chosen but not yet bound, could be one of them
        _scrape(port, server, log)
        worker = subprocess.run(
            [PYTHON, "-c", WORKER % {"testdir": str(REPO / "tests" / "vllm"), "tmp": str(tmp_path), "model": model}],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert worker.returncode == 0, worker.stderr[-3000:]
        assert "WORKER-DONE mono" in worker.stdout
        series = _series(_scrape(port, server, log))
        verify = subprocess.run(
            [str(OPS_CLI), "verify", "--no-self-test", "--json", "--endpoint", f"http://127.0.0.1:{port}/metrics"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert any(name.startswith("vllm:") for name in series), "vLLM's own series missing"
    ours = {name: v for name, v in series.items() if name.startswith("monodecode_")}
    endpoint = next(c for c in json.loads(verify.stdout)["checks"] if c["name"] == "endpoint")
    if not multiproc:
        assert ours == {}
        assert verify.returncode != 0 and endpoint["status"] == "fail", verify.stdout
        return
    assert verify.returncode == 0 and endpoint["status"] == "pass", verify.stdout
    assert "steps mono 1 / fallback 1" in endpoint["detail"]
    assert ours['monodecode_steps_total{path="mono"}'] == 1.0
    assert ours['monodecode_steps_total{path="fallback"}'] == 1.0
    assert ours['monodecode_fallback_steps_total{reason="prefill"}'] == 1.0
    assert ours["monodecode_enabled"] == 1.0
    assert ours['monodecode_step_duration_seconds_count{path="mono"}'] == 1.0
    assert ours["monodecode_warmup_duration_seconds"] > 0
    build = [name for name in ours if name.startswith("monodecode_build_info{")]
    assert len(build) == 1 and 'backend="reference"' in build[0] and 'arch="cpu"' in build[0]
