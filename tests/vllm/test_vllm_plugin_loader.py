"""vLLM's own plugin loader finds and runs our ``vllm.general_plugins`` entry point.

Each case runs in a fresh interpreter: ``load_general_plugins`` runs once per process, exactly
as in vLLM's API server, engine core and worker processes.
"""

from __future__ import annotations

import json
import os
import subprocess

from vllm_testlib import PYTHON, REPO

OURS = {
    "LlamaForCausalLM": "monodecode.vllm_plugin.models:MonoLlamaForCausalLM",
    "Qwen3ForCausalLM": "monodecode.vllm_plugin.models:MonoQwen3ForCausalLM",
    "Gemma3ForCausalLM": "monodecode.vllm_plugin.models:MonoGemma3ForCausalLM",
}

_PROBE = """
import json, sys
from importlib.metadata import entry_points
from vllm.model_executor.models.registry import ModelRegistry
import vllm.plugins as plugins

def resolved():
    return {a: f"{m.module_name}:{m.class_name}" for a in %(archs)r for m in [ModelRegistry.models[a]]}

before = resolved()
plugins.load_general_plugins()
after = resolved()
# re-entrant: vLLM may load plugins again in the same process; our register() twice is a no-op
import monodecode.vllm_plugin as p
p.register(); p.register()
again = resolved()
heavy = sorted(m for m in sys.modules if m.startswith("monodecode.vllm_plugin."))
print(json.dumps({"eps": [f"{e.name}={e.value}" for e in entry_points(group="vllm.general_plugins")],
                  "before": before, "after": after, "again": again, "loaded": plugins.plugins_loaded,
                  "plugin_modules_imported": heavy}))
"""


def _probe(env_extra: dict | None = None) -> dict:
    env = {**os.environ, **(env_extra or {})}
    out = subprocess.run(
        [PYTHON, "-c", _PROBE % {"archs": list(OURS)}], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loader_finds_and_runs_our_entry_point():
    got = _probe()
    assert "monodecode=monodecode.vllm_plugin:register" in got["eps"]
    assert got["loaded"] is True
    # vLLM's in-tree classes before, ours after the loader ran our register()
    for arch, ours in OURS.items():
        assert got["before"][arch].startswith("vllm.model_executor.models."), got["before"][arch]
        assert got["after"][arch] == ours
        assert got["again"][arch] == ours
    # import-safe: registering imports no model code (classes are resolved lazily by vLLM)
    assert got["plugin_modules_imported"] == []


def test_vllm_plugins_allow_list_turns_us_off():
    got = _probe({"VLLM_PLUGINS": "some_other_plugin"})
    for arch in OURS:
        assert got["after"][arch] == got["before"][arch]
        assert got["after"][arch].startswith("vllm.model_executor.models.")


_LOAD_TIME = """
import json, os, sys
import monodecode.vllm_plugin as p
seen = []
real = p.register
def spy():
    from vllm.config import get_current_vllm_config_or_none
    seen.append({"config": get_current_vllm_config_or_none() is not None,
                 "argv_mentions_monodecode": any("monodecode" in a for a in sys.argv),
                 "env_mentions_monodecode": any("monodecode" in v.lower() for v in os.environ.values())})
    real()
p.register = spy
from vllm.engine.arg_utils import EngineArgs
args = EngineArgs(model=%(model)r, dtype="bfloat16", max_model_len=128, enforce_eager=True,
                  skip_tokenizer_init=True, additional_config={"monodecode": {"enabled": True}})
cfg = args.create_engine_config()
print(json.dumps({"seen": seen, "requested_in_config": cfg.additional_config}))
"""


def test_plugin_cannot_see_the_request_at_load_time(model_dirs):
    """Why register() always registers: when vLLM runs general plugins (here from EngineArgs, as
    in `LLM(..., additional_config=...)`), no VllmConfig exists yet and neither argv nor the
    environment carries the request; only the finished config does."""
    env = {k: v for k, v in os.environ.items() if "monodecode" not in v.lower()}
    out = subprocess.run(
        [PYTHON, "-c", _LOAD_TIME % {"model": str(model_dirs["llama"])}],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seen"] == [{"config": False, "argv_mentions_monodecode": False, "env_mentions_monodecode": False}]
    assert got["requested_in_config"] == {"monodecode": {"enabled": True}}
