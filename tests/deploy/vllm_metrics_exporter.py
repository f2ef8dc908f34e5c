"""vLLM's own metrics, served on 127.0.0.1: run with a vLLM venv's python (tests/deploy drive it).

``PrometheusStatLogger`` (what `vllm serve`'s API server registers) is built from a real
``VllmConfig`` of the embedded tiny model, so the names and labels (``model_name``, ``engine``)
are exactly vLLM's. The model argument (and --served-model-name) are the ones the chart passes.
Commands on stdin, one per line, each answered with ``OK`` once recorded:
``waiting N`` (the scheduler's queue), ``ttft SECONDS COUNT`` and ``itl SECONDS COUNT`` (latency
histogram observations).

Usage: python vllm_metrics_exporter.py PORT MODEL [SERVED_NAME]
"""

import os
import sys
from pathlib import Path

# stdout carries only the protocol (READY, OK): vLLM logs to stdout, so that goes to stderr
PROTOCOL = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))

from prometheus_client import start_http_server  # noqa: E402
from vllm.v1.metrics.loggers import PrometheusStatLogger  # noqa: E402
from vllm.v1.metrics.stats import IterationStats, SchedulerStats  # noqa: E402
from vllm_testlib import engine_config  # noqa: E402  (sets VLLM_TARGET_DEVICE=cpu first)


def main(port: int, model: str, served_name: str | None) -> None:
    kwargs = {"served_model_name": [served_name]} if served_name else {}
    logger = PrometheusStatLogger(engine_config(model, **kwargs), engine_indexes=[0])
    server, _ = start_http_server(port, addr="127.0.0.1")
    print("READY", file=PROTOCOL, flush=True)
    for line in sys.stdin:
        what, *args = line.split()
        if what == "waiting":
            logger.record(SchedulerStats(num_waiting_reqs=int(args[0])), None, engine_idx=0)
        else:
            stats = IterationStats()
            samples = [float(args[0])] * int(args[1])
            if what == "ttft":
                stats.time_to_first_tokens_iter = samples
            else:
                stats.inter_token_latencies_iter = samples
            logger.record(None, stats, engine_idx=0)
        print("OK", file=PROTOCOL, flush=True)
    server.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
