"""``MonoDecode``: the runner's lifecycle inside one vLLM model instance (one TP rank).

The model override calls, in this order (the Kimi-K3 in-tree hook shape):

1. ``MonoDecode(vllm_config, config)`` in ``__init__``, before any weight is allocated;
2. ``build(model)`` from ``process_weights_after_loading`` (vLLM calls it after every quant
   method finished, before memory profiling, KV-cache allocation and graph capture): platform,
   ``Deployment`` from the real config, weight views, then ``Runner.start()`` (refusal vote,
   build, warm-up golden check per width, second vote): raise with every reason, or degrade;
3. ``plan(...)`` once per forward: the step decision from forward-context metadata (identical
   on all ranks). Eager and PIECEWISE steps run it every time; under a FULL graph it runs at
   capture only and the decision is baked into the graph (one per padded size);
4. ``before_logits(hidden)`` from ``compute_logits`` (eager every step, also after a graph
   replay): accounts the step, then the fail-stop check; a failed step returns no logits.

Accounting: steps are counted once per step, on TP rank 0 only (every rank takes the same
path, so counting on every rank would multiply the totals by the TP size); gauges (enabled,
warm-up, build info, fail-stops) come from every rank and are aggregated by the multiprocess
collector (``enabled`` = min over ranks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from monodecode.config import MonoConfig
from monodecode.errors import RefusalError
from monodecode.model.paged_kv import DecodeMetadata, PagedKVCache
from monodecode.runtime.runner import MONO, Runner, StepDecision
from monodecode.runtime.vote import StepInfo
from monodecode.services.platform import Platform, detect_platform
from monodecode.spec import reason_code
from monodecode.vllm_plugin.deployment import deployment_from_vllm_config, model_dims
from monodecode.vllm_plugin.step import KVLayoutError, decode_metadata, kv_reason_for_backend, kv_views, step_info
from monodecode.vllm_plugin.weights import WeightLayoutError, model_weights_from_vllm

log = logging.getLogger("monodecode.vllm")


class _StepCountsOff:
    """Metrics for TP ranks > 0: lifecycle gauges pass through, per-step series do not."""

    def __init__(self, metrics: Any):
        self._metrics = metrics

    def count_step(self, path: str, reason: str | None = None) -> None:
        pass

    def observe_step(self, path: str, seconds: float) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metrics, name)


@dataclass
class Plan:
    """A mono step: per-layer metadata and the KV views the kernels read and write."""

    decision: StepDecision
    metas: list[DecodeMetadata]
    kv: PagedKVCache


@dataclass
class _Binding:
    key: tuple = ()  # (data_ptr, numel) of every layer's cache: changes when vLLM re-binds
    kv: PagedKVCache | None = None


def _tp_group() -> tuple[int, int, Any]:
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        return group.rank_in_group, group.world_size, group.cpu_group
    except (AssertionError, ImportError):  # no distributed state (offline tools)
        return 0, 1, None


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class MonoDecode:
    def __init__(self, vllm_config: Any, config: MonoConfig, platform: Platform | None = None):
        self.vllm_config = vllm_config
        self.config = config
        self.platform = platform
        self.dims, self.dims_problem = model_dims(vllm_config)
        self.runner: Runner | None = None
        self.state = "off"
        self.reasons: list[str] = []
        self.metrics: Any = None
        self._binding = _Binding()
        self._attn_layers: list[Any] = []
        self._forward_ran = False
        self._last: StepDecision | None = None
        self._eager_counted = False

    # ---- startup ---------------------------------------------------------------------------

    def build(self, model: Any) -> None:
        """After weights load, before profiling and graph capture (every rank, same point)."""
        from monodecode.metrics import get_metrics

        device = next(model.parameters()).device
        if self.platform is None:
            self.platform = detect_platform(device.index if device.type == "cuda" else None)
        tp_rank, tp_size, group = _tp_group()
        deployment = deployment_from_vllm_config(self.vllm_config, self.platform, self.dims)
        metrics = get_metrics()
        self.metrics = metrics if tp_rank == 0 else _StepCountsOff(metrics)
        backbone = model.model
        self._attn_layers = [
            layer.self_attn.attn for layer in backbone.layers[backbone.start_layer : backbone.end_layer]
        ]

        weights = None
        if self.dims is not None:
            try:
                weights = model_weights_from_vllm(model, self.dims)
            except WeightLayoutError as e:
                deployment = replace(deployment, extra_reasons=deployment.extra_reasons + (f"weight_layout: {e}",))
        if self.dims is None:
            # nothing to build a runner for: refuse (or degrade) with the reasons we have
            self._refuse_without_runner(list(deployment.extra_reasons))
            return
        self.runner = Runner(
            self.config,
            self.dims,
            weights,
            self.platform,
            tp_rank,
            tp_size,
            group,
            deployment=deployment,
            metrics=self.metrics,
            block_size=deployment.block_size,
            weight_dtype=deployment.weight_dtype,
            kv_dtype="bf16",
        )
        self.runner.start()  # RefusalError (on_refusal=raise) propagates: vLLM refuses to start
        if self.runner.state == MONO:
            # the same backend on every rank, so every rank reaches the same verdict
            why = kv_reason_for_backend(self.runner.backend.name, self.runner.kernels)
            if why:
                self._disable(why)
        self.state = self.runner.state
        self.reasons = list(self.runner.reasons)
        if self.state == MONO:
            w = self.runner.warmup
            log.info(
                "mono decode active on rank %d: backend %s, widths %s, warm-up %.2f s, max |err| %.3g",
                tp_rank,
                self.runner.backend.name,
                list(self.config.widths),
                w.duration_s if w else 0.0,
                w.max_abs_error if w else 0.0,
            )
        else:
            log.warning("mono decode degraded to stock decode: %s", "; ".join(self.reasons))

    def _disable(self, reason: str) -> None:
        """A refusal found after ``Runner.start``: raise, or degrade every rank (voted)."""
        self.runner.refuse(reason)
        self.state = self.runner.state
        self.reasons = self.runner.reasons
        log.warning("mono decode degraded to stock decode: %s", "; ".join(self.reasons))

    def _refuse_without_runner(self, reasons: list[str]) -> None:
        if self.config.on_refusal == "raise":
            raise RefusalError(reasons)
        self.state = "degraded"
        self.reasons = reasons
        self.metrics.set_enabled(False)
        self.metrics.set_refusals(reason_code(r) for r in reasons)
        log.warning("mono decode degraded to stock decode: %s", "; ".join(reasons))

    # ---- per step --------------------------------------------------------------------------

    def _info(self, positions: torch.Tensor, intermediate_tensors: Any, inputs_embeds: Any) -> StepInfo:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        rows = int(positions.shape[-1])
        if intermediate_tensors is not None or inputs_embeds is not None:
            return StepInfo(num_rows=rows, has_metadata=False)  # PP stage input / prompt embeddings
        ctx = get_forward_context() if is_forward_context_available() else None
        return step_info(ctx, rows)

    def _kv(self) -> PagedKVCache:
        """Views of the bound KV caches, rebuilt when vLLM re-binds (profiling cache, then the
        real one); under graph capture the binding made by the eager warm-up pass is reused."""
        caches = [a.kv_cache for a in self._attn_layers]
        key = tuple((c.data_ptr(), c.numel()) for c in caches)
        if key != self._binding.key or self._binding.kv is None:
            a0 = self._attn_layers[0]
            kv = kv_views(caches, int(a0.num_kv_heads), int(a0.head_size), self.runner.kernels)
            self._binding = _Binding(key, kv)
        return self._binding.kv

    def _bound_kv(self) -> PagedKVCache | None:
        """``_kv()``, or None after degrading on a KV layout the kernels cannot read (the layout
        is the same on every rank, so every rank degrades at the same step)."""
        try:
            return self._kv()
        except KVLayoutError as e:
            self._disable(str(e))
            return None

    def plan(self, positions: torch.Tensor, intermediate_tensors: Any = None, inputs_embeds: Any = None) -> Plan | None:
        """This step's decision; a ``Plan`` for a mono step, None for the stock layers."""
        runner = self.runner
        if runner is None:
            return None
        info = self._info(positions, intermediate_tensors, inputs_embeds)
        kv = None
        if runner.decide(info):
            kv = self._bound_kv()  # may degrade (KV layout), which turns this step into a fallback
        capturing = _is_capturing()
        if capturing:
            decision = runner.capture_step(info)  # baked into the graph; counted at each replay
        else:
            decision = runner.begin_step(info)  # the same decision; counts (rank 0), times, arms drills
        self._forward_ran = True
        self._eager_counted = not capturing
        self._last = decision
        if not decision:
            return None
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
        metas: list[DecodeMetadata] = []
        built: dict[int, DecodeMetadata] = {}
        slot_maps = ctx.slot_mapping if isinstance(getattr(ctx, "slot_mapping", None), dict) else {}
        for attn in self._attn_layers:
            md = ctx.attn_metadata[attn.layer_name]
            if id(md) not in built:  # one per KV-cache group (Gemma: sliding vs full)
                built[id(md)] = decode_metadata(md, positions, slot_maps.get(attn.layer_name))
            metas.append(built[id(md)])
        return Plan(decision, metas, kv)

    def run_layers(self, plan: Plan, x: torch.Tensor) -> torch.Tensor:
        """The residual stream through every decoder layer on the kernels."""
        for layer, meta in enumerate(plan.metas):
            x = self.runner.forward_layer(layer, x, meta, plan.kv)
        return x

    def before_logits(self, hidden_states: torch.Tensor) -> None:
        """Accounting + fail-stop, once per step, before any logits exist."""
        runner = self.runner
        if runner is None:
            return
        if self._forward_ran:
            decision = self._last or StepDecision("fallback", "no_metadata")
        else:
            # our forward did not run: vLLM replayed a FULL graph captured with our decision
            decision = runner.account_replay(int(hidden_states.shape[0]))
        self._forward_ran = False
        # the health word is sticky, so it is read every step while mono decode runs; the
        # non-finite check applies only to steps the kernels produced
        runner.check_health_before_logits(decision, hidden_states)
        if self._eager_counted:
            runner.end_step(decision)
            self._eager_counted = False
