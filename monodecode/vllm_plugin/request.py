"""Was mono decode requested? Read from the ``VllmConfig`` vLLM hands every model.

Three switches, all carried by the config (so they are hashed into vLLM's compile-cache key and
reach every worker, unlike environment variables or argv):

- ``--monokernel`` (``KernelConfig.monokernel``, vLLM 0.33's flag for its in-tree mono decodes);
- ``--additional-config '{"monodecode": {...}}'`` (every option, validated by ``MonoConfig``);
- ``--additional-config '{"decode_backend": "latency_specialized"}'`` (vLLM 0.33's switch for
  specialized decode), an alias of ``enabled``.

An explicit ``"enabled": false`` in the ``monodecode`` section wins over both flags. A bad option
is a ``ConfigError`` (one line): a typo fails the startup instead of silently serving stock.
"""

from __future__ import annotations

from typing import Any

from monodecode.config import MonoConfig


def mono_config_for(vllm_config: Any) -> MonoConfig:
    """The validated ``MonoConfig`` of this vLLM deployment (``enabled`` False when not asked)."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    kernel_config = getattr(vllm_config, "kernel_config", None)
    monokernel = bool(getattr(kernel_config, "monokernel", False))
    return MonoConfig.from_additional_config(additional, monokernel=monokernel)


def is_served_target(vllm_config: Any, prefix: str = "") -> bool:
    """True for the model ``vllm serve`` serves; False for a speculative-decoding draft model
    built in the same process (vLLM builds it from a copy of the config whose ``model_config``
    is the draft's, under the ``draft_model`` prefix). Mono decode applies to the target only."""
    if prefix.startswith("draft_model"):
        return False
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) != "draft_model":
        return True  # n-gram, EAGLE, MTP, ...: no second model of a class this plugin overrides
    return vllm_config.model_config is not getattr(spec, "draft_model_config", None)
