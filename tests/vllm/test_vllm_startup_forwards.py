"""vLLM's start-up forwards are not steps (issue 13, item 7), on vLLM's real worker classes.

A FULL-graph warm-up pass, vLLM 0.33's model-runner v2 kernel warm-up and a data-parallel idle
batch run the model with real attention metadata before (or between) scheduled steps; counted as
steps, they inflate the mono totals and consume armed fault drills before any request arrives.
The engine test drives vLLM's own ``_dummy_run`` with ``force_attention`` (what the FULL-graph
warm-up calls) in a real in-process engine, then serves a real request.
"""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import pytest
from vllm_testlib import needs_engine, run_child

# the worker and model-runner classes vLLM picks on GPU (V1 and V2 runner), ROCm and CPU
_CLASSES = {
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner": ("_dummy_run", "capture_model", "profile_run"),
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner": ("_dummy_run", "capture_model"),
    "vllm.v1.worker.gpu_worker.Worker": ("compile_or_warm_up_model", "determine_available_memory"),
    "vllm.v1.worker.cpu_worker.CPUWorker": ("compile_or_warm_up_model",),
}


def _cls(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_this_vllms_start_up_methods_exist_and_are_wrapped_without_changing_them():
    """Guards against a vLLM release renaming a method: the wrap would silently cover nothing."""
    from monodecode.vllm_plugin import startup_scopes

    before = {(p, m): inspect.signature(getattr(_cls(p), m)) for p, methods in _CLASSES.items() for m in methods}
    startup_scopes.install()
    startup_scopes.install()  # idempotent: no double wrap
    for (path, method), signature in before.items():
        fn = getattr(_cls(path), method)
        assert getattr(fn, "__monodecode_not_serving__", False), f"{path}.{method} not wrapped"
        assert not getattr(fn.__wrapped__, "__monodecode_not_serving__", False), f"{path}.{method} wrapped twice"
        assert inspect.signature(fn) == signature


def test_the_scope_nests_and_ends_with_the_method_even_when_it_raises():
    from monodecode.vllm_plugin import startup_scopes

    class Runner:
        def _dummy_run(self, inner=None):
            seen = startup_scopes.in_startup_scope()
            if inner:
                return seen, inner()
            raise RuntimeError("boom")

    Runner._dummy_run = startup_scopes._not_serving(Runner._dummy_run)
    r = Runner()
    assert r._dummy_run(inner=lambda: r._dummy_run(inner=startup_scopes.in_startup_scope)) == (True, (True, True))
    with pytest.raises(RuntimeError):
        r._dummy_run()
    assert not startup_scopes.in_startup_scope()


ENGINE = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, %(testdir)r)
from vllm import SamplingParams
from vllm_testlib import in_process_engine, mono_options

model, tmp = sys.argv[1], sys.argv[2]
llm, model_runner = in_process_engine(model, mono_options(Path(tmp)))
runner = model_runner.model.mono.runner
counts = {"after_start": [runner.steps, runner.mono_steps]}
for n in (1, 2, 4):  # what vLLM's FULL-graph warm-up runs before each capture
    model_runner._dummy_run(n, force_attention=True, uniform_decode=True)
counts["after_dummy_runs"] = [runner.steps, runner.mono_steps]
out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
counts["after_request"] = [runner.steps, runner.mono_steps]
counts["tokens"] = len(out[0].outputs[0].token_ids)
print("COUNTS " + json.dumps(counts))
""" % {"testdir": str(Path(__file__).parent)}


@needs_engine
def test_dummy_runs_with_attention_metadata_are_not_counted_in_a_real_engine(model_dirs, tmp_path):
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "MONODECODE_FAULT": ""}
    counts, _ = run_child(["-c", ENGINE, str(model_dirs["gemma3"]), str(tmp_path)], "COUNTS ", env)
    assert counts["after_start"] == [0, 0]
    assert counts["after_dummy_runs"] == [0, 0]
    # one prefill step (a fallback), then a mono step per further token
    assert counts["tokens"] == 4
    assert counts["after_request"] == [4, 3]
