"""vLLM integration: the ``vllm.general_plugins`` entry point and model-class overrides.

vLLM calls ``register()`` in every process it starts (API server, engine core, workers, the
registry's model-inspection subprocess), before any configuration exists: the API server loads
general plugins while it builds its argument parser, the engine core and the workers load them
before the ``VllmConfig`` they were handed is made current. So a general plugin cannot tell at
load time whether mono decode was requested (``--additional-config`` from the Python API or a
``--config`` YAML leaves no trace in argv or the environment); tests/vllm/test_plugin_loader.py
shows this on the real loader.

Therefore ``register()`` always registers the overrides, and each override decides in its
constructor, from the ``VllmConfig`` vLLM passes to every model: when mono decode is not
requested, construction is handed back to vLLM's own class, so the model object vLLM runs is an
instance of vLLM's class (``type(model) is LlamaForCausalLM``) and serving is exactly stock.
``VLLM_PLUGINS`` (vLLM's own allow-list) turns the plugin off entirely.

This module imports nothing heavy at import time: vLLM imports it in every process.
"""

from __future__ import annotations

import logging

# HF architecture -> our override (a subclass of vLLM's class for that architecture).
OVERRIDES: dict[str, str] = {
    "LlamaForCausalLM": "monodecode.vllm_plugin.models:MonoLlamaForCausalLM",
    "Qwen3ForCausalLM": "monodecode.vllm_plugin.models:MonoQwen3ForCausalLM",
    "Gemma3ForCausalLM": "monodecode.vllm_plugin.models:MonoGemma3ForCausalLM",
}


class _ToVllmLog(logging.Handler):
    """Hands each ``monodecode`` record to the handlers vLLM's ``vllm`` logger has *when the record
    is logged*: vLLM (re)configures its logging in every process it starts, sometimes after the
    plugins loaded, and replaces its handlers when it does. Without vLLM handlers (its logging
    configuration off) the root logger's handlers get the record."""

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger("vllm").handlers or logging.getLogger().handlers
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def attach_log_handler() -> None:
    """Send ``monodecode`` log lines into vLLM's log (vLLM configures only its ``vllm`` logger,
    so without this they never reach ``vllm serve``'s output). Re-entrant."""
    ours = logging.getLogger("monodecode")
    if not any(isinstance(h, _ToVllmLog) for h in ours.handlers):
        ours.addHandler(_ToVllmLog())
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.DEBUG)  # vLLM's handlers filter by VLLM_LOGGING_LEVEL
    ours.propagate = False


def register() -> None:
    """Entry point of ``vllm.general_plugins``: register the overrides (re-entrant) and route
    monodecode's log lines into vLLM's log."""
    from vllm.model_executor.models.registry import ModelRegistry

    attach_log_handler()

    for arch, target in OVERRIDES.items():
        current = ModelRegistry.models.get(arch)
        module, _, cls = target.partition(":")
        if getattr(current, "module_name", None) == module and getattr(current, "class_name", None) == cls:
            continue  # already ours: registering again would only drop vLLM's resolution cache entry
        ModelRegistry.register_model(arch, target)
