"""The per-rank mono-decode runner: refusal -> build -> warm-up -> per-step decision -> dispatch
-> health.

``start()`` (once, after weights load and before graph capture):

1. fail-stop history: read this rank's marker, export it, apply the N-in-window rule;
2. pick the backend (``config.backend`` or the best available), compute the build key, look up
   the baked artifact (``no_artifact`` / checksum reasons) and collect every refusal reason from
   ``monodecode.spec``; all ranks vote (MIN) so they agree before anything collective is built;
3. build every width, then warm up: one golden decode per width on the model's real weights and
   shapes, every layer compared with the reference; max abs error and durations recorded; a
   failure is a refusal reason; all ranks vote again;
4. ``on_refusal``: ``raise`` -> ``RefusalError`` with every reason; ``degrade`` -> stock decode,
   ``monodecode_enabled 0`` and one ``monodecode_refusal_info{reason}`` per reason.

Per step: ``begin_step(StepInfo)`` decides from metadata identical on all ranks and counts the
step; the caller runs the mono path as one ``forward_step`` where the kernels have a whole-step
launch, else ``forward_layer`` per layer (stock layers otherwise),
calls ``check_health_before_logits`` (fail-stop) and ``end_step``. ``decode_step`` is that loop
for the reference model (what ``monodecode-ops verify`` and the tests drive).

The runner owns its state: callers read it through properties and change it only through verbs
(``begin_step(info, real=False)`` for warm-up forwards, ``capture_step`` / ``account_replay``
for FULL graphs, ``request_disable`` + ``revote`` / ``degrade`` / ``refuse`` after start).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import monodecode
from monodecode.config import MonoConfig
from monodecode.errors import ArtifactError, RefusalError, exception_line
from monodecode.kernels import registry
from monodecode.kernels.base import BuildRequest, DecodeKernels, KernelBackend, kernel_layers, smallest_width
from monodecode.kernels.health import HealthFault, decode_health
from monodecode.reasons import RefusalReason, reason_code
from monodecode.runtime.failstop import FailStopEvent, FailStopRecorder
from monodecode.runtime.vote import RankVote, StepInfo
from monodecode.runtime.width_policy import (
    STOCK_UNAVAILABLE,
    LayerBench,
    StockBench,
    TimingRun,
    WidthTiming,
    choose_widths,
    kv_budget_bytes,
    time_widths,
    timing_table,
)
from monodecode.services.artifacts import ArtifactStore, baked_manifest_digest
from monodecode.services.faults import Fault, faults_from_env, unreachable_drills
from monodecode.services.platform import Platform
from monodecode.spec import Deployment, refusal_reasons

log = logging.getLogger("monodecode.runtime")

OFF, MONO, DEGRADED = "off", "mono", "degraded"
# startup vote levels (MIN over ranks): refuse < degrade-only (crash-loop guard) < ok
_REFUSE, _DEGRADE_ONLY, _OK = 0, 1, 2
_DEGRADE_ONLY_CODES = {RefusalReason.failstop_loop.value, RefusalReason.slower_than_stock.value}
_KNOWN_REFUSAL_CODES = {r.value for r in RefusalReason}


def _unpoisoned(mono: Any, ref: Any) -> tuple[Any, Any]:
    """Both paths' KV caches (fp32) with the slots NaN in both zeroed: the golden inputs' poisoned
    slots, which neither path writes. A NaN on one side only stays (and fails)."""
    import torch

    both = torch.isnan(mono) & torch.isnan(ref)
    return torch.where(both, 0.0, mono.float()), torch.where(both, 0.0, ref.float())


def _level(reasons: list[str]) -> int:
    if not reasons:
        return _OK
    if all(reason_code(r) in _DEGRADE_ONLY_CODES for r in reasons):
        return _DEGRADE_ONLY
    return _REFUSE


STEP_GRAPH_MODES_OK = ("none", "full", "full_decode_only")
# warm-up's bound on a whole-step launch against the reference step (relative Frobenius error of
# the final residual and of each layer's K/V): the kernels' numerics tests' bound on stacked layers
STEP_REL_TOLERANCE = 5e-2


@dataclass(frozen=True)
class StepDecision:
    path: str  # mono | fallback
    reason: str | None = None  # fallback reason (metric label)
    width: int | None = None  # built width the rows are padded to (mono only)
    step: int = -1
    real: bool = True  # False for warm-up and capture forwards: never counted

    def __bool__(self) -> bool:
        return self.path == "mono"


@dataclass
class WidthCheck:
    width: int
    max_abs_error: float
    tolerance: float
    worst_layer: int
    duration_s: float
    health: int = 0
    within_tolerance: bool = True  # every layer within its own tolerance
    # the kernels' whole-step launch (``forward_step``) over every layer against the reference
    # step, where they have one: its relative error (final residual and every layer's K/V) and tolerance
    step_error: float | None = None
    step_tolerance: float = 0.0

    @property
    def step_within_tolerance(self) -> bool:
        return self.step_error is None or self.step_error <= self.step_tolerance

    @property
    def passed(self) -> bool:
        return self.health == 0 and self.within_tolerance and self.step_within_tolerance


@dataclass
class WarmupReport:
    widths: list[WidthCheck] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def max_abs_error(self) -> float:
        return max((w.max_abs_error for w in self.widths), default=0.0)

    @property
    def passed(self) -> bool:
        return bool(self.widths) and all(w.passed for w in self.widths)

    def failure(self) -> str | None:
        for w in self.widths:
            if w.health:
                fault = decode_health(w.health)
                return f"warmup_failed: width {w.width} set the health word ({fault.describe() if fault else w.health})"
            if not w.within_tolerance:
                return (
                    f"warmup_failed: width {w.width} differs from the reference by {w.max_abs_error:.4g} "
                    f"at layer {w.worst_layer} (tolerance {w.tolerance:.4g})"
                )
            if not w.step_within_tolerance:
                return (
                    f"warmup_failed: width {w.width}'s one launch over every layer (forward_step) differs from "
                    f"the reference step by {w.step_error:.4g} relative (tolerance {w.step_tolerance:.4g})"
                )
        return None


class Runner:
    def __init__(
        self,
        config: MonoConfig,
        dims: Any,
        weights: Any,
        platform: Platform,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        *,
        deployment: Deployment | None = None,
        metrics: Any = None,
        block_size: int = 16,
        weight_dtype: str | None = None,
        kv_dtype: str = "bf16",
        faults: tuple[Fault, ...] | None = None,
        stock_layer: Callable[[int, Any, Any, Any], Any] | None = None,
        defer_width_timing: bool = False,
        max_model_len: int | None = None,
    ):
        """``stock_layer(layer, x, meta, kv)`` is the stock path of one decoder layer (the vLLM
        plugin passes vLLM's own on its CPU platform); default: the reference layer on
        ``weights``. The shadow check compares with it, and without ``defer_width_timing`` the
        width policy times it against the kernels at ``start``. With ``defer_width_timing`` the
        caller times the widths later with ``time_widths`` (the vLLM plugin, once vLLM bound its
        KV cache: its stock step needs the bound backend); no step is served before that.
        ``max_model_len`` (default: the model's position limit) bounds the contexts timed."""
        self._config = config
        self._stock_layer_fn = stock_layer
        self._defer_width_timing = defer_width_timing
        self._timing_pending = False  # deferred timing not run yet (``time_widths``)
        self._max_model_len = max_model_len or dims.max_position_embeddings
        self._dims = dims
        self._weights = weights
        self._platform = platform
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._metrics = metrics
        self._block_size = block_size
        self._weight_dtype = weight_dtype or getattr(weights, "weight_dtype", "bf16")
        self._kv_dtype = kv_dtype
        self._deployment = deployment
        self._faults = faults_from_env() if faults is None else faults
        self._vote = RankVote(tp_group, tp_size)
        self._recorder = FailStopRecorder(
            config.failstop_dir, tp_rank, config.termination_log, config.exit_on_failstop, metrics
        )
        self._state = OFF
        self._reasons: list[str] = []
        self._notes: list[str] = []  # non-fatal observations (unreadable marker, drill not run)
        self._backend: KernelBackend | None = None
        self._build_key: str | None = None
        self._kernels: DecodeKernels | None = None
        self._warmup: WarmupReport | None = None
        self._mono_steps = 0  # real mono steps since warm-up (fault drills count these)
        self._steps = 0  # real steps this runner saw (warm-up and capture forwards excluded)
        self._local_disable: str | None = None
        self._captured: dict[int, StepDecision] = {}  # decisions baked into FULL graphs, by rows
        self._pending_times: list[tuple[str, Any, Any]] = []  # GPU step timings not yet resolved
        self._t_start: Any = None
        self._last_decision: StepDecision | None = None
        self._guard: Any = None  # HealthGuard once mono decode runs
        self._served_widths: tuple[int, ...] = tuple(config.widths)
        self._dropped_widths: dict[int, str] = {}  # width -> why it is not served
        self._width_timings: dict[int, tuple[WidthTiming, ...]] = {}  # width -> one per context
        self._width_note: str | None = None  # why the widths were not timed
        self._width_run: TimingRun | None = None
        self._stock_name: str | None = None  # what the widths were timed against (metrics' stock label)
        self._shadow: Any = None  # ShadowCheck once mono decode runs with shadow_check_every > 0
        self._shadow_layer: int | None = None  # the layer this step's shadow check compares

    # ---- read-only view --------------------------------------------------------------------

    @property
    def config(self) -> MonoConfig:
        return self._config

    @property
    def dims(self) -> Any:
        return self._dims

    @property
    def weights(self) -> Any:
        return self._weights

    @property
    def weight_dtype(self) -> str:
        return self._weight_dtype

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def tp_rank(self) -> int:
        return self._tp_rank

    @property
    def state(self) -> str:
        """off (disabled in the config), mono, or degraded (stock decode, see ``reasons``)."""
        return self._state

    @property
    def enabled(self) -> bool:
        return self._state == MONO

    @property
    def reasons(self) -> list[str]:
        """Every refusal / degrade reason, ``"<code>: <sentence>"`` (a copy)."""
        return list(self._reasons)

    @property
    def notes(self) -> list[str]:
        return list(self._notes)

    @property
    def backend(self) -> KernelBackend | None:
        return self._backend

    @property
    def build_key(self) -> str | None:
        return self._build_key

    @property
    def kernels(self) -> DecodeKernels | None:
        return self._kernels

    @property
    def warmup(self) -> WarmupReport | None:
        return self._warmup

    @property
    def steps(self) -> int:
        """Real steps seen (mono and fallback); warm-up and capture forwards are not counted."""
        return self._steps

    @property
    def mono_steps(self) -> int:
        return self._mono_steps

    @property
    def last_decision(self) -> StepDecision | None:
        return self._last_decision

    @property
    def served_widths(self) -> tuple[int, ...]:
        """The built widths mono decode serves (the width policy may drop slower ones)."""
        return self._served_widths

    @property
    def dropped_widths(self) -> dict[int, str]:
        return dict(self._dropped_widths)

    @property
    def width_timings(self) -> dict[int, tuple[WidthTiming, ...]]:
        """Width -> its timings, one per timed context (ascending)."""
        return dict(self._width_timings)

    @property
    def stock_side(self) -> str | None:
        """What the widths were timed against: ``vllm_layers``, ``reference``, ``stock_layer``,
        ``unavailable`` (nothing timed: the stock side could not run); None when not timed by
        design (``force``, the reference backend) or not yet (deferred)."""
        return self._stock_name

    def width_report(self) -> str:
        """One line for the startup log and ``verify``: what is served and why."""
        policy = self._config.width_policy
        line = f"width policy {policy}: serving widths {list(self._served_widths)}"
        if self._width_note:
            return f"{line} ({self._width_note})"
        run = self._width_run
        line += f" (timed against {self._stock_name}" + (f" in {run.duration_s:.1f} s)" if run else ")")
        if self._dropped_widths:
            line += "; dropped " + "; ".join(f"{w} ({why})" for w, why in self._dropped_widths.items())
        kept = {w: ts for w, ts in self._width_timings.items() if w in self._served_widths}
        if kept:
            line += "; speedup by context: " + "; ".join(timing_table(kept))
        if run and run.skipped:
            line += f"; {len(run.skipped)} width/context pairs untimed (timing budget spent)"
        return line

    @property
    def vote(self) -> RankVote:
        return self._vote

    @property
    def marker_path(self) -> Any:
        return self._recorder.marker_path

    @property
    def device(self) -> Any:
        import torch

        emb = getattr(self._weights, "embed", None)
        return emb.device if emb is not None else torch.device("cpu")

    # ---- startup ---------------------------------------------------------------------------

    def _choose_backend(self) -> tuple[KernelBackend | None, str | None]:
        statuses = registry.backend_status(self._platform)
        wanted = self._config.backend
        if wanted != "auto":
            st = next((s for s in statuses if s.name == wanted), None)
            if st is None or not st.available:
                return (
                    None,
                    f"backend_unavailable: backend {wanted} cannot run here: {st.reason if st else 'unknown backend'}",
                )
            return registry.get_backend(wanted)(), None
        # auto: on a GPU torch can drive only real kernels count; the reference is the choice where
        # decoding runs on the CPU (no GPU, or a GPU that this torch build cannot use)
        on_gpu = self._platform.is_gpu and self._platform.torch_usable
        if self._platform.is_gpu and not on_gpu:
            self._notes.append(
                f"torch cannot launch on the {self._platform.arch} GPU (CPU build of torch?); decoding runs on the reference"
            )
            statuses = [s for s in statuses if s.name == "reference"]
        # an opt-in backend (registry.OPT_IN) runs only when named
        candidates = [s for s in statuses if s.available and not s.opt_in and (s.name != "reference" or not on_gpu)]
        if not candidates:
            why = "; ".join(f"{s.name}: {s.reason}" for s in statuses if not s.available)
            return (
                None,
                f"backend_unavailable: no kernel backend can run on {self._platform.kind} {self._platform.arch} ({why})",
            )
        return registry.get_backend(candidates[0].name)(), None

    def _default_deployment(self) -> Deployment:
        return Deployment(
            platform_kind=self._platform.kind,
            arch=self._platform.arch,
            compute_units=self._platform.compute_units,
            partition_mode=self._platform.partition_mode,
            tp_size=self._tp_size,
            weight_dtype=self._weight_dtype,
            kv_cache_dtype=self._kv_dtype,
            block_size=self._block_size,
            dims=self._dims,
        )

    def _artifact_problem(self, backend: KernelBackend, key: str) -> tuple[ArtifactStore | None, str | None]:
        if not self._config.artifact_dir:
            store = None
        else:
            try:
                store = ArtifactStore(
                    self._config.artifact_dir, manifest_digest=baked_manifest_digest(self._config.artifact_dir)
                )
            except ArtifactError as e:
                return None, f"artifact_invalid: {e}"
        if not backend.needs_artifacts:
            return store, None
        where = f"in {store.root}" if store else "(no artifact_dir configured)"
        if store is not None:
            try:
                if store.lookup(key) is not None:
                    return store, None
            except ArtifactError as e:
                checksum = ("checksum mismatch", "is missing", "larger than")
                code = "artifact_checksum" if any(s in str(e) for s in checksum) else "artifact_invalid"
                return store, f"{code}: {e}"
        if self._config.allow_jit:
            return store, None
        return store, (
            f"no_artifact: no baked {backend.name} artifact for build key {key[:16]} "
            f"({self._platform.arch}, {self._dims.architecture}, TP {self._tp_size}) {where} and allow_jit is false"
        )

    def start(self) -> Runner:
        """Refusal -> build -> warm-up; leaves ``state`` mono, degraded or off."""
        t0 = time.perf_counter()
        cfg = self._config
        if not cfg.enabled:
            self._state = OFF
            if self._metrics is not None:
                self._metrics.set_enabled(False)
            return self
        self._recorder.check_writable()
        history = self._recorder.read()
        self._notes.extend(history.problems)
        self._recorder.export(history)

        reasons: list[str] = []
        loop = self._recorder.crash_loop_reason(history, cfg.max_failstops, cfg.failstop_window_s)
        if loop:
            reasons.append(loop)
        n_layers = len(getattr(self._weights, "layers", ())) or self._dims.num_layers
        reasons.extend(f"fault_drill: {why}" for why in unreachable_drills(self._faults, n_layers, self._tp_size))
        backend, why = self._choose_backend()
        store = None
        req = None
        if backend is None:
            reasons.append(why)
        else:
            self._backend = backend
            try:
                req = BuildRequest(
                    dims=self._dims,
                    weight_dtype=self._weight_dtype,
                    tp_size=self._tp_size,
                    widths=cfg.widths,
                    block_size=self._block_size,
                    platform=self._platform,
                    kv_dtype=self._kv_dtype,
                    wait_timeout_s=cfg.wait_timeout_s,
                )
            except ValueError as e:
                reasons.append(f"build_request: {e}")
            if req is not None:
                self._build_key = backend.build_key(req)
                store, problem = self._artifact_problem(backend, self._build_key)
                deployment = replace(self._deployment or self._default_deployment(), artifact_problem=problem)
                reasons.extend(refusal_reasons(deployment, backend.kernel_spec(self._platform, cfg.widths)))

        # vote 1: every rank agrees before anything (possibly collective) is built
        agreed = self._vote.min_vote(_level(reasons))
        if agreed < _OK and not reasons:
            reasons.append("peer_refused: another tensor-parallel rank refused; see its log")
        if agreed == _OK:
            reasons.extend(self._build_and_warm(backend, req, store))
            # vote 2: warm-up results
            agreed = self._vote.min_vote(_level(reasons))
            if agreed < _OK and not reasons:
                reasons.append("peer_refused: warm-up failed on another tensor-parallel rank; see its log")

        if reasons:
            # a crash loop always degrades (raising would restart into the same loop)
            self._refuse(reasons, force_degrade=agreed == _DEGRADE_ONLY)
        else:
            from monodecode.runtime.guard import HealthGuard

            self._state = MONO
            self._guard = HealthGuard(self._kernels.health_word, self._fail_stop)
            if cfg.shadow_check_every:
                from monodecode.runtime.shadow import ShadowCheck

                self._shadow = ShadowCheck(
                    cfg.shadow_check_every,
                    len(self._weights.layers),
                    cfg.warmup_atol,
                    cfg.warmup_rtol,
                    self.stock_layer,
                    self.device,
                )
            if self._metrics is not None:
                self._metrics.set_enabled(True)
                self._metrics.set_refusals(())
                self._metrics.set_build(
                    backend.name, self._platform.arch, self._build_key or "", monodecode.__version__
                )
            log.info("mono decode on rank %d (backend %s): %s", self._tp_rank, backend.name, self.width_report())
        self._export_width_timing()
        if self._warmup is not None:
            self._warmup.duration_s = time.perf_counter() - t0
            if self._metrics is not None:
                self._metrics.set_warmup(self._warmup.duration_s, self._warmup.max_abs_error)
        return self

    def _refuse(self, reasons: list[str], force_degrade: bool = False) -> None:
        self._reasons = reasons
        if self._kernels is not None:
            self._kernels.close()
            self._kernels = None
        if self._config.on_refusal == "raise" and not force_degrade:
            raise RefusalError(reasons)
        self._state = DEGRADED
        if self._metrics is not None:
            self._metrics.set_enabled(False)
            self._metrics.set_refusals(reason_code(r) for r in reasons)
            if self._backend is not None:
                self._metrics.set_build(
                    self._backend.name, self._platform.arch, self._build_key or "", monodecode.__version__
                )

    def _build_and_warm(self, backend: KernelBackend, req: BuildRequest, store: ArtifactStore | None) -> list[str]:
        try:
            self._kernels = backend.build(req, self._weights, store, self._config.allow_jit)
        except RefusalError as e:
            return e.reasons
        except ArtifactError as e:
            return [f"artifact_invalid: {e}"]
        except Exception as e:  # a compiler or loader failure is a refusal, with its cause
            return [f"build_failed: {backend.name} build raised {exception_line(e)}"]
        for misfit in self._kernels.residency_misfits():
            log.warning("mono decode %s build: %s (exact, slower than planned)", backend.name, misfit)
        try:
            self._warmup = self._golden_check()
        except Exception as e:
            return [f"warmup_failed: golden decode raised {exception_line(e)}"]
        failure = self._warmup.failure()
        if failure:
            return [failure]
        try:
            return self._choose_served_widths()
        except Exception as e:
            return [f"warmup_failed: timing the widths raised {exception_line(e)}"]

    def _warmup_inputs(self, width: int, gen: Any, context: int | None = None) -> tuple[Any, Any, Any, Any]:
        """A decode step of ``width`` rows on random KV: metadata, two identical KV caches (one for
        each path) and the embedded input. Each row's context is ``context`` tokens, or (None,
        the golden inputs) crosses a KV block boundary and differs per row, block 0 is no row's
        (as vLLM's null block, which a table's padding points at) and every slot no row has cached
        holds NaN: a kernel that sums one fails the check, as stale cache contents would poison a
        served row."""
        import torch

        from monodecode.model.paged_kv import BlockAllocator, PagedKVCache, poison_uncached
        from monodecode.model.reference import embed

        device, bs = self.device, self._block_size
        lens = [context] * width if context is not None else [bs + 1 + (r % bs) for r in range(width)]
        num_blocks = sum(-(-(n + 1) // bs) for n in lens) + 2
        alloc = BlockAllocator(num_blocks, bs)
        alloc.append_slots("null block", 1)  # block 0 (handed out first): no row's
        for r, n in enumerate(lens):
            alloc.append_slots(r, n)
        meta = alloc.decode_metadata(list(range(width)), device=device)
        kv_ref = PagedKVCache.allocate(self._dims, num_blocks, bs, device=device)
        for t in kv_ref.key + kv_ref.value:
            if context is None:
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
            else:  # timing inputs (up to GiBs): any finite values, drawn where they live
                t.normal_()
        if context is None:
            poison_uncached(kv_ref, meta)
        kv_mono = PagedKVCache(
            key=[t.clone() for t in kv_ref.key], value=[t.clone() for t in kv_ref.value], block_size=bs
        )
        ids = torch.randint(0, self._dims.vocab_size, (width,), generator=gen).to(device)
        return meta, kv_ref, kv_mono, embed(self._weights, ids)

    def stock_layer(self, layer: int, x: Any, meta: Any, kv: Any) -> Any:
        """One decoder layer on the stock path (the plugin's callable, or the reference)."""
        if self._stock_layer_fn is not None:
            return self._stock_layer_fn(layer, x, meta, kv)
        return self._reference_layer(layer, x, meta, kv)

    def _reference_layer(self, layer: int, x: Any, meta: Any, kv: Any) -> Any:
        from monodecode.model.reference import decode_layer

        return decode_layer(self._dims, layer, self._weights.layers[layer], x, meta, kv)

    def _choose_served_widths(self) -> list[str]:
        """Width policy after a passed golden check: time each width (auto), keep the faster
        ones. Returns refusal reasons (none when at least one width is served)."""
        widths = tuple(self._config.widths)
        if self._config.width_policy == "force":
            self._width_note = "forced: not timed"
        elif self._backend.name == "reference":
            self._width_note = "not timed: the reference backend runs the stock layers' own math"
        elif self._defer_width_timing:
            self._width_note = "timed once the serving engine binds its KV cache"
            self._timing_pending = True
        else:
            bench, why = self._layer_bench()
            self._measure(bench, why)
            health = self._kernels.health()
            if health:
                fault = decode_health(health)
                return [
                    f"warmup_failed: timing the widths set the health word ({fault.describe() if fault else health})"
                ]
        return self._apply_width_choice(widths)

    def _apply_width_choice(self, widths: tuple[int, ...]) -> list[str]:
        """Served widths from the timings, agreed by every rank (a width is served only where it
        won on every rank); a ``slower_than_stock`` reason when none is left."""
        served, self._dropped_widths = choose_widths(widths, self._width_timings, self._config.width_policy)
        if self._stock_name is not None:  # every rank timed or tried to (agreed in _measure): all vote
            served = tuple(w for w in widths if self._vote.agree(w in served))
            for w in widths:
                if w not in served and w not in self._dropped_widths:
                    self._dropped_widths[w] = "slower than stock on another tensor-parallel rank"
        self._served_widths = served
        if not served:
            return [
                "slower_than_stock: no built width beat the stock step at every timed context at warm-up: "
                + "; ".join(t.describe() for ts in self._width_timings.values() for t in ts)
            ]
        return []

    def _layer_bench(self) -> tuple[LayerBench | None, str | None]:
        """The stock side outside a serving engine: the given stock layer, else the reference
        layers; (None, why) when the given layer cannot run here."""
        import torch

        gen = torch.Generator(device="cpu").manual_seed(20261216)
        dims = self._dims
        name = "reference" if self._stock_layer_fn is None else "stock_layer"
        if self._stock_layer_fn is not None:
            meta, kv_stock, _, x = self._warmup_inputs(1, gen)
            try:  # a stock layer bound to a serving engine may need state a bare runner lacks
                self._stock_layer_fn(0, x, meta, kv_stock)
            except Exception as e:
                return None, f"the stock layer cannot run at warm-up ({exception_line(e, 200)})"
        per_token = 2 * 2 * len(self._weights.layers) * dims.num_kv_heads * dims.head_dim * 2  # K+V, 2 copies, bf16
        bench = LayerBench(
            name,
            lambda width, context: self._warmup_inputs(width, gen, context),
            self._kernels.forward_layer,
            self.stock_layer,
            len(self._weights.layers),
            self._max_model_len - 1,
            kv_budget_bytes(self.device) // per_token,
            forward_step=self._kernels.forward_step,
        )
        return bench, None

    def _measure(self, bench: StockBench | None, unavailable: str | None) -> None:
        """Time every width against ``bench`` (every rank agrees first that its stock side can
        run); where one cannot, or the timing raises (the kernels passed their checks), nothing
        is timed and every width is served, saying why."""
        if not self._vote.agree(bench is not None):
            self._untimed(unavailable or "the stock step cannot run on another tensor-parallel rank")
            return
        try:
            self._width_run = time_widths(bench, tuple(self._config.widths), self.device.type)
        except Exception as e:
            self._untimed(f"timing the widths against {bench.name} raised {exception_line(e, 200)}")
            return
        finally:
            bench.close()
        self._stock_name = bench.name
        self._width_timings = self._width_run.timings

    def _untimed(self, why: str) -> None:
        self._stock_name = STOCK_UNAVAILABLE
        self._width_timings, self._width_run = {}, None
        self._width_note = f"not timed: {why}; every width is served untimed, as with force"
        log.warning("mono decode width policy: %s", self._width_note)

    def time_widths(self, bench: StockBench | None, unavailable: str | None = None) -> None:
        """The deferred width timing (``defer_width_timing``), every rank at the same point before
        any step is served: the kernels against ``bench``'s stock step, or untimed with the reason
        ``unavailable`` where ``bench`` is None. No width faster than the stock step: degraded
        with ``slower_than_stock``."""
        if self._state != MONO or not self._timing_pending:
            return
        self._timing_pending = False
        self._width_note = None
        self._measure(bench, unavailable)
        reasons = self._apply_width_choice(tuple(self._config.widths))
        self._export_width_timing()
        log.info("mono decode on rank %d: %s", self._tp_rank, self.width_report())
        if reasons:
            self.degrade(reasons[0])

    def _export_width_timing(self) -> None:
        if self._metrics is None or self._stock_name is None:
            return
        run = self._width_run
        self._metrics.set_width_timing(
            {(t.width, t.context): t.speedup for ts in self._width_timings.values() for t in ts},
            self._stock_name,
            run.duration_s if run else 0.0,
        )

    def _golden_check(self) -> WarmupReport:
        """One decode step per width on the real weights: every layer vs the reference."""
        import torch

        from monodecode.model.reference import decode_layer

        dims, weights, kernels = self._dims, self._weights, self._kernels
        report = WarmupReport()
        gen = torch.Generator(device="cpu").manual_seed(20261101)
        for width in self._config.widths:
            t0 = time.perf_counter()
            meta, kv_ref, kv_mono, x = self._warmup_inputs(width, gen)
            max_err, worst_margin, worst_layer, tol_at_worst, ok = 0.0, float("-inf"), 0, 0.0, True
            for layer, lw in enumerate(weights.layers):
                ref_out = decode_layer(dims, layer, lw, x, meta, kv_ref)
                out = kernels.forward_layer(layer, x, meta, kv_mono)
                err = (out.float() - ref_out.float()).abs().max().item()
                for a, b in ((kv_mono.key[layer], kv_ref.key[layer]), (kv_mono.value[layer], kv_ref.value[layer])):
                    a, b = _unpoisoned(a, b)
                    err = max(err, (a - b).abs().max().item())
                tol = self._config.warmup_atol + self._config.warmup_rtol * ref_out.float().abs().max().item()
                if err != err:  # NaN
                    err = float("inf")
                max_err = max(max_err, err)
                ok = ok and err <= tol
                if err - tol > worst_margin:
                    worst_margin, worst_layer, tol_at_worst = err - tol, layer, tol
                x = ref_out
            step_error, step_tol = self._golden_step(width)
            health = kernels.health()
            report.widths.append(
                WidthCheck(
                    width,
                    max_err,
                    tol_at_worst,
                    worst_layer,
                    time.perf_counter() - t0,
                    health,
                    ok,
                    step_error,
                    step_tol,
                )
            )
        return report

    def _golden_step(self, width: int) -> tuple[float | None, float]:
        """Where the kernels have a whole-step launch (``forward_step``, what a mono step serves):
        one step of ``width`` rows through every layer against the reference step, on inputs of
        its own. Its error is relative (Frobenius) over the final residual and every layer's K/V,
        against ``STEP_REL_TOLERANCE``: the layers' rounding differences stack up over a whole step,
        so the per-layer absolute bound would refuse deep models that are right. (None, 0) where
        the kernels have none."""
        import torch

        from monodecode.model.reference import decode_layer

        if type(self._kernels).forward_step is DecodeKernels.forward_step:
            return None, 0.0  # the interface's default: no whole-step launch
        gen = torch.Generator(device="cpu").manual_seed(20261102 + width)
        meta, kv_ref, kv_mono, x = self._warmup_inputs(width, gen)
        layers = self._weights.layers
        out = self._kernels.forward_step(x, [meta] * len(layers), kv_mono)
        if out is None:
            return None, 0.0
        ref = x
        for layer, lw in enumerate(layers):
            ref = decode_layer(self._dims, layer, lw, ref, meta, kv_ref)

        def rel(a, b) -> float:
            a, b = a.float(), b.float()
            return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

        err = max(
            [rel(out, ref)]
            + [
                rel(*_unpoisoned(a, b))
                for a, b in zip(kv_mono.key + kv_mono.value, kv_ref.key + kv_ref.value, strict=True)
            ]
        )
        return (float("inf") if err != err else err), STEP_REL_TOLERANCE

    # ---- after start: refusals and rank-local wishes, folded in by vote -----------------------

    def request_disable(self, reason: str) -> None:
        """Rank-local wish to stop mono decode (no collective); takes effect at the next
        ``revote`` on all ranks. ``reason`` is a ``"<code>: <sentence>"`` reason or a sentence
        (reported as ``disabled: <sentence>``)."""
        if reason_code(reason) not in _KNOWN_REFUSAL_CODES:
            reason = f"disabled: {reason}"
        self._local_disable = reason

    def revote(self) -> bool:
        """MIN vote over ranks at a safe point (never inside graph capture); True = still mono."""
        ok = self._vote.agree(self._state == MONO and self._local_disable is None)
        if not ok and self._state == MONO:
            reason = self._local_disable or "peer_disabled: another tensor-parallel rank disabled mono decode"
            self._degrade_now([reason])
        return ok

    def degrade(self, reason: str) -> None:
        """Stop mono decode on every rank now, with ``reason`` (every rank calls it at the same
        point: it votes). Steps from here on take the stock path under ``degraded``."""
        self.request_disable(reason)
        self.revote()

    def refuse(self, reason: str) -> None:
        """A refusal found after ``start`` (e.g. when vLLM binds its KV cache): ``RefusalError``
        under ``on_refusal: raise``, else ``degrade``. Every rank calls it at the same point."""
        if self._config.on_refusal == "raise":
            raise RefusalError([reason])
        self.degrade(reason)

    def _degrade_now(self, reasons: list[str]) -> None:
        self._reasons = reasons
        self._local_disable = None
        self._state = DEGRADED
        if self._metrics is not None:
            self._metrics.set_enabled(False)
            self._metrics.set_refusals(reason_code(r) for r in reasons)

    # ---- per step --------------------------------------------------------------------------

    def decide(self, info: StepInfo) -> StepDecision:
        """Pure function of ``info`` and the agreed state: the same on every rank."""
        step = self._steps
        if self._state == OFF:
            return StepDecision("fallback", "disabled", step=step)
        if self._state != MONO:
            return StepDecision("fallback", "degraded", step=step)
        if not info.has_metadata:
            return StepDecision("fallback", "no_metadata", step=step)
        if info.num_prefill_rows > 0:
            reason = "prefill" if info.num_decode_rows <= 0 else "mixed_batch"
            return StepDecision("fallback", reason, step=step)
        if info.graph_mode not in STEP_GRAPH_MODES_OK:
            return StepDecision("fallback", "graph_mode", step=step)
        width = smallest_width(self._config.widths, info.num_rows)
        if width is None or info.num_rows <= 0:
            return StepDecision("fallback", "rows_exceed_width", step=step)
        if width not in self._served_widths:
            return StepDecision("fallback", "width_dropped", step=step)
        return StepDecision("mono", None, width, step=step)

    def begin_step(self, info: StepInfo, *, real: bool = True) -> StepDecision:
        """This step's decision. A real step (one that serves requests) is counted, timed and may
        fire an armed fault drill; warm-up forwards (``real=False``) are decided the same way but
        leave no trace: no count, no metric, no drill consumed."""
        if not real:
            return replace(self.decide(info), real=False)
        if self._shadow is not None:
            self._shadow.before_step()
            self._shadow_verdicts()
        if self._local_disable is not None and self._tp_size == 1:
            self.revote()  # one rank: the vote is local, so a pending wish applies at once
        decision = self.decide(info)
        self._steps += 1
        self._shadow_layer = None
        if decision:
            self._arm_faults()
            if self._shadow is not None:
                self._shadow_layer = self._shadow.layer_for(self._mono_steps)
            self._mono_steps += 1
        if self._metrics is not None:
            self._metrics.count_step(decision.path, decision.reason)
        self._t_start = self._timestamp()
        return decision

    def capture_step(self, info: StepInfo) -> StepDecision:
        """The decision a FULL graph captured for ``info.num_rows`` rows bakes in: recorded for
        ``account_replay``, not counted (a capture serves no request)."""
        decision = replace(self.decide(info), real=False)
        self._captured[info.num_rows] = decision
        return decision

    def account_replay(self, rows: int) -> StepDecision:
        """Count a real step vLLM served by replaying a FULL graph (our Python did not run): the
        decision baked into the smallest captured size that holds ``rows`` (vLLM pads up to it)."""
        sizes = [s for s in self._captured if s >= rows]
        baked = self._captured[min(sizes)] if sizes else StepDecision("fallback", "rows_exceed_width")
        decision = replace(baked, step=self._steps, real=True)
        self._steps += 1
        if decision:
            for f in self._faults:
                if f.kind in ("stall", "nonfinite") and f.step == self._mono_steps and f.applies_to(self._tp_rank):
                    log.warning("fault drill %s not run: mono step %d was a FULL-graph replay", f, f.step)
                    self._notes.append(f"fault drill {f} not run: mono step {f.step} was a FULL-graph replay")
            self._mono_steps += 1
        if self._metrics is not None:
            self._metrics.count_step(decision.path, decision.reason)
        self._last_decision = decision
        return decision

    def _arm_faults(self) -> None:
        for f in self._faults:
            if f.kind in ("stall", "nonfinite") and f.step == self._mono_steps and f.applies_to(self._tp_rank):
                if not self._kernels.arm_fault(f):
                    self._notes.append(f"fault drill {f} not run: backend {self._backend.name} cannot inject it")

    def forward_layer(self, layer: int, x: Any, meta: Any, kv: Any) -> Any:
        out = self._kernels.forward_layer(layer, x, meta, kv)
        if layer == self._shadow_layer:
            self._shadow.capture(layer, x, out, meta, kv)
        return out

    def forward_step(self, x: Any, metas: list[Any], kv: Any) -> Any | None:
        """Every layer of a mono step in one launch (``DecodeKernels.forward_step``; ``metas[layer]``
        is that layer's metadata). None where the kernels have no whole-step launch, or where this
        step's shadow check needs one layer's input and output (``forward_layer`` captures them):
        the caller then runs ``forward_layer`` per layer. Fault drills were armed by ``begin_step``
        either way; the health check before logits stays the caller's."""
        if self._shadow_layer is not None:
            return None
        return self._kernels.forward_step(x, metas, kv)

    def _shadow_verdicts(self) -> None:
        """Finished shadow checks -> metrics; past the tolerance: degrade or fail-stop."""
        for result in self._shadow.results():
            if self._metrics is not None:
                self._metrics.count_shadow_check(result.max_abs_error, result.passed)
            if result.passed or self._state != MONO:
                continue
            log.error("mono decode %s", result.reason())
            if self._config.shadow_on_fail == "failstop":
                event = FailStopEvent(
                    rank=self._tp_rank,
                    step=result.step,
                    site="shadow_mismatch",
                    layer=result.layer,
                    kernel=None,
                    time=time.time(),
                    detail=result.reason(),
                    pid=os.getpid(),
                )
                self._recorder.fail(event)
            self.request_disable(result.reason())

    def check_health_before_logits(self, decision: StepDecision, x: Any = None) -> None:
        """Fail-stop when the kernels' health word is set or (on a mono step) the residual stream
        ``x`` is non-finite: no token of a failed step is ever computed, and the cause is
        recorded. No blocking host sync (``monodecode.runtime.guard``): on a GPU the check is a
        device-side assert and the cause is read by a watcher thread. The health word is sticky,
        so it is checked on fallback steps too while mono decode runs."""
        if self._state != MONO or self._guard is None:
            return
        self._guard.check(decision.step, x if decision else None)

    def _fail_stop(self, code: int, step: int) -> None:
        """The guard saw health ``code`` at ``step``: record the cause everywhere and end."""
        fault = decode_health(code) or HealthFault("kernel_error", None, None)
        event = FailStopEvent(
            rank=self._tp_rank,
            step=step,
            site=fault.site,
            layer=fault.layer,
            kernel=fault.kernel,
            time=time.time(),
            detail=f"backend {self._backend.name}, build key {(self._build_key or '')[:16]}",
            pid=os.getpid(),
        )
        self._recorder.fail(event)

    def end_step(self, decision: StepDecision) -> None:
        """Close a step ``begin_step`` opened: its time goes to the step-duration histogram."""
        self._last_decision = decision
        if self._shadow is not None and decision.real:
            self._shadow.launch(decision.step)
            self._shadow_layer = None
            self._shadow_verdicts()
            if self._shadow.broken:
                log.warning("mono decode %s", self._shadow.broken)
                self._notes.append(self._shadow.broken)
                self._shadow = None
        if self._metrics is None or not decision.real:
            return
        start, self._t_start = self._t_start, None
        end = self._timestamp()
        if isinstance(start, float):
            self._metrics.observe_step(decision.path, end - start)
        elif start is not None:
            # GPU: resolve event pairs lazily (no host sync in the step)
            self._pending_times.append((decision.path, start, end))
            still = []
            for path, s, e in self._pending_times:
                if e.query():
                    self._metrics.observe_step(path, s.elapsed_time(e) / 1000.0)
                else:
                    still.append((path, s, e))
            self._pending_times = still[-1024:]

    def _timestamp(self):
        dev = self.device
        if getattr(dev, "type", "cpu") == "cuda":
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    # ---- a whole step on the reference model (verify, tests) --------------------------------

    def decode_step(self, ids: Any, meta: Any, kv: Any, info: StepInfo | None = None, *, real: bool = True):
        """One step over every layer: mono kernels when eligible, the reference (stock) layers
        otherwise. Returns fp32 logits, or fail-stops (no logits) on a kernel failure."""
        from monodecode.model.reference import decode_layer, embed, final_logits

        rows = int(ids.shape[0])
        info = info or StepInfo(num_rows=rows)
        decision = self.begin_step(info, real=real)
        x = embed(self._weights, ids, dtype=kv.dtype)
        if decision:
            x = kernel_layers(self.forward_layer, x, [meta] * len(self._weights.layers), kv, self.forward_step)
        else:
            for layer, lw in enumerate(self._weights.layers):
                x = decode_layer(self._dims, layer, lw, x, meta, kv)
        self.check_health_before_logits(decision, x)
        logits = final_logits(self._weights, x)
        self.end_step(decision)
        return logits

    def summary(self) -> dict[str, Any]:
        return {
            "state": self._state,
            "backend": self._backend.name if self._backend else None,
            "build_key": self._build_key,
            "reasons": list(self._reasons),
            "notes": list(self._notes),
            "widths": {
                "policy": self._config.width_policy,
                "served": list(self._served_widths),
                "dropped": {str(w): why for w, why in self._dropped_widths.items()},
                "stock": self._stock_name,
                "speedup": {str(w): {str(t.context): t.speedup for t in ts} for w, ts in self._width_timings.items()},
                "timing_s": self._width_run.duration_s if self._width_run else None,
                "report": self.width_report(),
            },
            "warmup": None
            if self._warmup is None
            else {
                "duration_s": self._warmup.duration_s,
                "max_abs_error": self._warmup.max_abs_error,
                "widths": [w.__dict__ for w in self._warmup.widths],
            },
        }
