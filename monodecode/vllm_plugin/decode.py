"""``MonoDecode``: the runner's lifecycle inside one vLLM model instance (one TP rank).

The model override calls, in this order (the Kimi-K3 in-tree hook shape):

1. ``MonoDecode(vllm_config, config)`` and ``attach(model)`` in ``__init__``, before any weight
   is allocated: the decoder's attention layers get a hook on ``bind_kv_cache`` (the method
   vLLM's model runner calls on every layer when it initializes the KV cache); on vLLM's CPU
   platform the linear layers keep the weight vLLM loaded (``_cpu_skip_gemm_dispatch``);
2. ``build(model)`` from ``process_weights_after_loading`` (vLLM calls it after every quant
   method finished, before memory profiling, KV-cache allocation and graph capture): the vLLM
   version, platform, ``Deployment`` from the real config, the attention backend, weight views,
   then ``Runner.start()`` (refusal vote, build, warm-up golden check per width, second vote):
   raise with every reason, or degrade;
3. ``on_kv_bound()`` when vLLM has bound every layer's KV cache (profiling cache, then the real
   one), before any forward that could reach the kernels: backend, resolved layout, cache spec
   and tensor strides are checked from vLLM's objects (``binding.bind``) and the views built;
   a refusal here is raised (or degraded, voted) at start-up, never inside a forward; at the
   first binding, the width policy times the kernels against vLLM's own layers
   (``stock.VllmStockBench``, freed before vLLM goes on);
4. ``plan(...)`` once per forward: the step decision from forward-context metadata (identical
   on all ranks; metadata of a class the bound backend does not build is no metadata). Eager
   and PIECEWISE steps run it every time; under a FULL graph it runs at capture only and the
   decision is baked into the graph (one per padded size);
5. ``before_logits(hidden)`` from ``compute_logits`` (eager every step, also after a graph
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
from monodecode.errors import RefusalError, exception_line
from monodecode.model.paged_kv import DecodeMetadata, PagedKVCache
from monodecode.runtime.runner import MONO, Runner, StepDecision
from monodecode.runtime.vote import StepInfo
from monodecode.services.platform import Platform, detect_platform
from monodecode.spec import reason_code
from monodecode.vllm_plugin import startup_scopes, stock
from monodecode.vllm_plugin.binding import BindError, Binding, backend_reason, bind, layer_backend, metadata_allowed
from monodecode.vllm_plugin.cpu_kv import StagedKV
from monodecode.vllm_plugin.deployment import deployment_from_vllm_config, model_dims
from monodecode.vllm_plugin.step import decode_metadata, run_kernel_layers, step_info
from monodecode.vllm_plugin.versions import version_reason
from monodecode.vllm_plugin.weights import WeightCopies, WeightLayoutError, model_weights_from_vllm

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
    """A mono step: per-layer metadata and the KV the kernels read and write (vLLM's cache
    through strided views, or on the CPU platform staged per layer)."""

    decision: StepDecision
    metas: list[DecodeMetadata]
    kv: PagedKVCache | None
    staged: StagedKV | None = None


# the decoder's linear layers (vLLM's fused projections) the kernels read
_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


class _BindHook:
    """Stands in for one attention layer's ``bind_kv_cache``: vLLM's binding, then ours."""

    def __init__(self, attn: Any, mono: MonoDecode):
        self._vllm_bind = attn.bind_kv_cache
        self._attn = attn
        self._mono = mono

    def __call__(self, kv_cache: Any) -> None:
        self._vllm_bind(kv_cache)
        self._mono.layer_bound(self._attn)


def _tp_group() -> tuple[int, int, Any]:
    try:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        return group.rank_in_group, group.world_size, group.cpu_group
    except (AssertionError, ImportError):  # no distributed state (offline tools)
        return 0, 1, None


def _serves_requests() -> bool:
    """False for vLLM's profile, dummy, warm-up and capture forwards: they are not steps, are not
    counted and never fire a fault drill. Every step vLLM's scheduler runs carries metadata (a
    dict per layer, or a list of them when micro-batched), whatever its backend; start-up passes
    may carry it too (a FULL-graph warm-up builds it), so they are told apart by the vLLM method
    running them (``startup_scopes``)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available() or startup_scopes.in_startup_scope():
        return False
    return bool(getattr(get_forward_context(), "attn_metadata", None))


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class MonoDecode:
    def __init__(self, vllm_config: Any, config: MonoConfig, platform: Platform | None = None):
        self.vllm_config = vllm_config
        self.config = config
        self.platform = platform
        self.dims, _ = model_dims(vllm_config)  # the problem, if any, is a refusal reason of the deployment
        self.runner: Runner | None = None
        self.state = "off"
        self.reasons: list[str] = []
        self.metrics: Any = None
        self._binding: Binding | None = None
        self._attn_layers: list[Any] = []
        self._unbound: set[int] = set()
        self._stock: stock.VllmStockLayer | None = None
        self.vllm_agreement: str | None = None  # what the start-up comparison with vLLM's layers measured
        self.weight_copy_bytes = 0  # row-major copies of AITER-preshuffled weights (this rank)
        self._backend_name: str | None = None
        self._forward_ran = False
        self._last: StepDecision | None = None
        self._eager_counted = False

    # ---- startup ---------------------------------------------------------------------------

    def attach(self, model: Any) -> None:
        """At model construction: hook the attention layers' KV binding; on vLLM's CPU platform
        keep the loaded weights (no second copy). Nothing when the vLLM version is unsupported:
        ``build`` refuses before anything of vLLM's is touched."""
        if version_reason() is not None:
            return
        from vllm.platforms import current_platform

        startup_scopes.install()

        backbone = model.model
        layers = list(backbone.layers)[backbone.start_layer : backbone.end_layer]
        self._attn_layers = [layer.self_attn.attn for layer in layers]
        self._backend_name = layer_backend(self._attn_layers[0]) if self._attn_layers else None
        for attn in self._attn_layers:
            attn.bind_kv_cache = _BindHook(attn, self)
        self._unbound = {id(a) for a in self._attn_layers}
        if current_platform.is_cpu():
            # vLLM's CPU linear method would pack each weight for oneDNN / AMX and free the loaded
            # matrix; its own switch (used for MLA's kv_b_proj) keeps the matrix and computes
            # vLLM's stock GEMMs with torch.nn.functional.linear on it: one copy, read by both paths
            for layer in layers:
                for parent, name in _LINEARS:
                    setattr(getattr(getattr(layer, parent), name), "_cpu_skip_gemm_dispatch", True)

    def build(self, model: Any) -> None:
        """After weights load, before profiling and graph capture (every rank, same point)."""
        from monodecode.metrics import get_metrics

        tp_rank, tp_size, group = _tp_group()
        metrics = get_metrics()
        self.metrics = metrics if tp_rank == 0 else _StepCountsOff(metrics)
        why = version_reason()
        if why:
            self._refuse_without_runner([why])
            return
        device = next(model.parameters()).device
        if self.platform is None:
            self.platform = detect_platform(device.index if device.type == "cuda" else None)
        deployment = deployment_from_vllm_config(self.vllm_config, self.platform, self.dims)
        why = backend_reason(self.platform.kind, self._attn_layers)
        if why:
            deployment = replace(deployment, extra_reasons=deployment.extra_reasons + (why,))

        weights = None
        if self.dims is not None:
            copies = WeightCopies()
            try:
                weights = model_weights_from_vllm(model, self.dims, copies)
            except WeightLayoutError as e:
                deployment = replace(deployment, extra_reasons=deployment.extra_reasons + (f"weight_layout: {e}",))
            else:
                self.weight_copy_bytes = copies.bytes
                if copies.bytes:
                    # counted by vLLM's memory profiling (it runs after this), so the KV cache shrinks by it
                    log.info(
                        "mono decode keeps row-major copies of %d AITER-preshuffled weights on rank %d "
                        "(the kernels read row-major): %.1f MiB of GPU memory (%s)",
                        len(copies.names),
                        tp_rank,
                        copies.bytes / 2**20,
                        ", ".join(copies.names[:4]) + (", ..." if len(copies.names) > 4 else ""),
                    )
        if self.dims is None:
            # nothing to build a runner for: refuse (or degrade) with the reasons we have
            self._refuse_without_runner(list(deployment.extra_reasons))
            return
        stock_layer = None
        if weights is not None and stock.available(self.platform.kind):
            # vLLM's own decoder layers, once vLLM bound its cache: the start-up check's other side,
            # the width timing's stock step, and on CPU the shadow check's stock side
            self._stock = stock.VllmStockLayer(
                model, self.vllm_config, self._attn_layers, staged_cpu=self.platform.kind == "cpu"
            )
            stock_layer = self._shadow_stock_layer
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
            stock_layer=stock_layer,
            defer_width_timing=True,  # its stock step is vLLM's layers on the bound backend: on_kv_bound
        )
        self.runner.start()  # RefusalError (on_refusal=raise) propagates: vLLM refuses to start
        self.state = self.runner.state
        self.reasons = list(self.runner.reasons)
        if self.state == MONO:
            w = self.runner.warmup
            log.info(
                "mono decode active on rank %d: backend %s, vLLM attention %s, widths %s, warm-up %.2f s, max |err| %.3g",
                tp_rank,
                self.runner.backend.name,
                self._backend_name,
                list(self.config.widths),
                w.duration_s if w else 0.0,
                w.max_abs_error if w else 0.0,
            )
        else:
            log.warning("mono decode degraded to stock decode: %s", "; ".join(self.reasons))

    def _shadow_stock_layer(self, layer: int, x: Any, meta: DecodeMetadata, kv: PagedKVCache) -> Any:
        """The shadow check's stock side: vLLM's layer where it runs on the runner's plain K/V (its
        CPU platform, bound), else the reference layer: on GPUs vLLM's layer would need the step's
        context copied out of a cache of many GiB at every check (the width timing never uses
        this: its stock step is ``stock.VllmStockBench``)."""
        if self._stock is not None and self._stock.bound and self._stock.staged_cpu:
            return self._stock(layer, x, meta, kv)
        from monodecode.model.reference import decode_layer

        return decode_layer(self.dims, layer, self.runner.weights.layers[layer], x, meta, kv)

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

    # ---- KV binding (vLLM's initialize_kv_cache) -------------------------------------------

    def layer_bound(self, attn: Any) -> None:
        """vLLM bound ``attn``'s cache; once every layer is bound, check and bind them all."""
        self._unbound.discard(id(attn))
        if not self._unbound:
            self._unbound = {id(a) for a in self._attn_layers}
            self.on_kv_bound()

    def on_kv_bound(self) -> None:
        """Check vLLM's KV cache against the kernels and build the views (every rank at the same
        point of start-up: a refusal raises out of vLLM's KV initialization, or degrades, voted)."""
        runner = self.runner
        if runner is None or runner.state != MONO:
            return
        try:
            self._binding = bind(self.platform.kind, self._attn_layers, self.vllm_config, runner.kernels)
        except BindError as e:
            self._binding = None
            self._disable(str(e))
            return
        why = measured = None
        unavailable = f"this vLLM build has no {self.platform.kind} attention kernels to run vLLM's decoder layers"
        if self._stock is not None:
            cfg = self.config
            self.vllm_agreement = None
            try:
                self._stock.bind()
                why, measured = stock.stock_check(
                    runner, self._stock, self.dims.num_layers, self.dims.hidden_size, cfg.warmup_atol, cfg.warmup_rtol
                )
            except Exception as e:  # vLLM's side could not run here; the kernels passed the golden check
                unavailable = f"vLLM's decoder layers could not run ({exception_line(e, 200)})"
                log.warning(
                    "mono decode could not run vLLM's own decoder layers (attention %s) to compare with at start-up "
                    "(%s); the golden check against the reference stands alone",
                    self._backend_name,
                    exception_line(e, 200),
                )
        if why:
            unavailable = "the kernels were refused at binding"
        # every rank times (or not) at this point, before any refusal is applied: the timing votes
        self._time_widths(unavailable if measured is None or why else None)
        if self._stock is not None and (why or measured is None or not self._stock.staged_cpu):
            # only the CPU shadow check keeps running vLLM's layers: on GPUs, on a refusal or when
            # they could not run, their builder's buffers are freed here
            self._stock.unbind()
        if why:
            self._binding = None
            self._disable(why)
            return
        if measured:
            self.vllm_agreement = measured
            log.info(
                "mono decode matches vLLM's own decoder layers (attention %s) on its KV layout: %s",
                self._backend_name,
                measured,
            )
        if runner.state != MONO:  # no width beat vLLM's stock step
            self._binding = None
            self.state, self.reasons = runner.state, runner.reasons
            log.warning("mono decode degraded to stock decode: %s", "; ".join(self.reasons))
            return
        log.info(
            "mono decode bound vLLM's KV cache: attention %s, layout %s, %s",
            self._backend_name,
            self.vllm_config.cache_config.kv_cache_layout,
            "staged per step (CPU attention packing)" if self._binding.cpu_layers else "read in place",
        )

    def _time_widths(self, unavailable: str | None) -> None:
        """The width policy's timing against vLLM's own layers on the bound backend (before they
        are unbound on GPUs), or, where they cannot run (``unavailable`` says why), every width
        served untimed. A failure setting the timing up is reported the same way."""
        runner = self.runner
        bench = None
        if unavailable is None:
            try:
                bench = stock.VllmStockBench(
                    self._stock,
                    runner.kernels.forward_layer,
                    self.dims.hidden_size,
                    int(self.vllm_config.model_config.max_model_len),
                    forward_step=runner.kernels.forward_step,
                )
            except Exception as e:
                unavailable = f"vLLM's decoder layers could not be set up for timing ({exception_line(e, 200)})"
        runner.time_widths(bench, unavailable)

    # ---- per step --------------------------------------------------------------------------

    def _info(self, positions: torch.Tensor, intermediate_tensors: Any, inputs_embeds: Any) -> StepInfo:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        rows = int(positions.shape[-1])
        if intermediate_tensors is not None or inputs_embeds is not None or self._binding is None:
            # PP stage input / prompt embeddings / no KV cache bound yet (profile runs)
            return StepInfo(num_rows=rows, has_metadata=False)
        ctx = get_forward_context() if is_forward_context_available() else None
        return step_info(ctx, rows, lambda md: metadata_allowed(self._backend_name, md))

    def plan(self, positions: torch.Tensor, intermediate_tensors: Any = None, inputs_embeds: Any = None) -> Plan | None:
        """This step's decision; a ``Plan`` for a mono step, None for the stock layers."""
        runner = self.runner
        if runner is None:
            return None
        info = self._info(positions, intermediate_tensors, inputs_embeds)
        real = _serves_requests()
        capturing = _is_capturing()
        if capturing:
            decision = runner.capture_step(info)  # baked into the graph; counted at each replay
        else:
            # the same decision; a real step counts (rank 0), is timed and may fire a fault drill
            decision = runner.begin_step(info, real=real)
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
        binding = self._binding
        if binding.cpu_layers is not None:
            return Plan(decision, metas, None, StagedKV(binding.cpu_layers, metas))
        return Plan(decision, metas, binding.kv)

    def run_layers(self, plan: Plan, x: torch.Tensor) -> torch.Tensor:
        """The residual stream through every decoder layer on the kernels."""
        runner = self.runner
        return run_kernel_layers(
            runner.forward_layer, x, plan.metas, plan.kv, plan.staged, forward_step=runner.forward_step
        )

    def before_logits(self, hidden_states: torch.Tensor) -> None:
        """Accounting + fail-stop, once per step, before any logits exist."""
        runner = self.runner
        if runner is None:
            return
        if self._forward_ran:
            decision = self._last or StepDecision("fallback", "no_metadata")
        elif startup_scopes.in_startup_scope():
            return  # a start-up pass computing logits of a graph it replayed: not a step
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
