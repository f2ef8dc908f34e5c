"""Model-class overrides: subclasses of vLLM's own Llama, Qwen3 and Gemma 3 classes.

Mono decode off (not requested, or a speculative-decoding draft model): ``__new__`` hands construction back to vLLM's class, so the
object vLLM serves *is* a ``LlamaForCausalLM`` (etc.): same modules, same forward, nothing of
ours on the path. Mono decode on: the subclass adds four hooks and nothing else:

- ``__init__``: validate the options, create ``MonoDecode`` and attach it to the decoder layers
  (no weights touched; on vLLM's CPU platform the linear layers keep their loaded weight);
- ``process_weights_after_loading``: build + warm up the runner (after load, before capture);
- ``forward``: one decision per step; a mono step runs the embedding, every decoder layer on the
  kernels and the final norm; any other step calls vLLM's own ``forward`` unchanged;
- ``compute_logits`` (and ``compute_logits_local`` where vLLM's class has it): accounting and
  the fail-stop check first.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from monodecode.vllm_plugin.decode import MonoDecode
from monodecode.vllm_plugin.request import is_served_target, mono_config_for


def _mono_requested(vllm_config: Any, prefix: str) -> bool:
    """Mono decode was asked for and this model is the served target (never a draft model)."""
    return mono_config_for(vllm_config).enabled and is_served_target(vllm_config, prefix)


class MonoDecodeMixin:
    """Put first in the bases, before the vLLM class it extends."""

    _stock_class: type
    mono: MonoDecode | None

    def __new__(cls, *, vllm_config: Any, prefix: str = "", **kwargs: Any):
        if "_stock_class" in cls.__dict__ and not _mono_requested(vllm_config, prefix):
            # not an instance of cls, so Python skips cls.__init__: the result is purely stock.
            # (Subclasses vLLM derives from ours, e.g. the pooling adapters, construct normally
            # and stay stock through ``mono = None``.)
            return cls._stock_class(vllm_config=vllm_config, prefix=prefix, **kwargs)
        return super().__new__(cls)

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.mono = None
        if _mono_requested(vllm_config, prefix):
            self.mono = MonoDecode(vllm_config, mono_config_for(vllm_config))
            self.mono.attach(self)

    def process_weights_after_loading(self) -> None:
        parent = getattr(super(), "process_weights_after_loading", None)
        if parent is not None:
            parent()
        if self.mono is not None:
            self.mono.build(self)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        plan = None if self.mono is None else self.mono.plan(positions, intermediate_tensors, inputs_embeds)
        if plan is None:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        x = self.model.embed_input_ids(input_ids)
        x = self.mono.run_layers(plan, x)
        return self.model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor):
        if self.mono is not None:
            self.mono.before_logits(hidden_states)
        return super().compute_logits(hidden_states)


class LocalLogitsMixin:
    """For the classes that have vLLM's vocab-local logits path (LocalArgmaxMixin)."""

    def compute_logits_local(self, hidden_states: torch.Tensor):
        if self.mono is not None:
            self.mono.before_logits(hidden_states)
        return super().compute_logits_local(hidden_states)


class MonoLlamaForCausalLM(MonoDecodeMixin, LocalLogitsMixin, LlamaForCausalLM):
    _stock_class = LlamaForCausalLM


class MonoQwen3ForCausalLM(MonoDecodeMixin, LocalLogitsMixin, Qwen3ForCausalLM):
    _stock_class = Qwen3ForCausalLM


class MonoGemma3ForCausalLM(MonoDecodeMixin, Gemma3ForCausalLM):
    _stock_class = Gemma3ForCausalLM
