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
step; the caller runs ``forward_layer`` per layer on the mono path (stock layers otherwise),
calls ``check_health_before_logits`` (fail-stop) and ``end_step``. ``decode_step`` is that loop
for the reference model (what ``monodecode-ops verify`` and the tests drive).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import monodecode
from monodecode.config import MonoConfig
from monodecode.errors import ArtifactError, RefusalError
from monodecode.kernels import registry
from monodecode.kernels.base import BuildRequest, DecodeKernels, KernelBackend, smallest_width
from monodecode.kernels.health import HealthFault, decode_health
from monodecode.runtime.failstop import FailStopEvent, FailStopRecorder
from monodecode.runtime.vote import RankVote, StepInfo
from monodecode.services.artifacts import ArtifactStore
from monodecode.services.faults import Fault, faults_from_env
from monodecode.services.platform import Platform
from monodecode.spec import Deployment, reason_code, refusal_reasons

OFF, MONO, DEGRADED = "off", "mono", "degraded"
# startup vote levels (MIN over ranks): refuse < degrade-only (crash-loop guard) < ok
_REFUSE, _DEGRADE_ONLY, _OK = 0, 1, 2
_DEGRADE_ONLY_CODES = {"failstop_loop"}


def _level(reasons: list[str]) -> int:
    if not reasons:
        return _OK
    if all(reason_code(r) in _DEGRADE_ONLY_CODES for r in reasons):
        return _DEGRADE_ONLY
    return _REFUSE


STEP_GRAPH_MODES_OK = ("none", "full", "full_decode_only")


@dataclass(frozen=True)
class StepDecision:
    path: str  # mono | fallback
    reason: str | None = None  # fallback reason (metric label)
    width: int | None = None  # built width the rows are padded to (mono only)
    step: int = -1

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

    @property
    def passed(self) -> bool:
        return self.health == 0 and self.within_tolerance


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
            if not w.passed:
                return (
                    f"warmup_failed: width {w.width} differs from the reference by {w.max_abs_error:.4g} "
                    f"at layer {w.worst_layer} (tolerance {w.tolerance:.4g})"
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
    ):
        self.config = config
        self.dims = dims
        self.weights = weights
        self.platform = platform
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.metrics = metrics
        self.block_size = block_size
        self.weight_dtype = weight_dtype or getattr(weights, "weight_dtype", "bf16")
        self.kv_dtype = kv_dtype
        self.deployment = deployment
        self.faults = faults_from_env() if faults is None else faults
        self.vote = RankVote(tp_group, tp_size)
        self.recorder = FailStopRecorder(
            config.failstop_dir, tp_rank, config.termination_log, config.exit_on_failstop, metrics
        )
        self.state = OFF
        self.reasons: list[str] = []
        self.notes: list[str] = []  # non-fatal observations (unreadable marker, drill not run)
        self.backend: KernelBackend | None = None
        self.build_key: str | None = None
        self.kernels: DecodeKernels | None = None
        self.warmup: WarmupReport | None = None
        self.mono_steps = 0  # mono steps since warm-up (fault drills count these)
        self.step = 0  # every step this runner saw
        self._local_disable: str | None = None
        self._pending_times: list[tuple[str, Any, Any]] = []  # GPU step timings not yet resolved
        self._t_start: Any = None
        self.last_decision: StepDecision | None = None

    # ---- startup ---------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.state == MONO

    def _device(self):
        import torch

        emb = getattr(self.weights, "embed", None)
        return emb.device if emb is not None else torch.device("cpu")

    def _choose_backend(self) -> tuple[KernelBackend | None, str | None]:
        statuses = registry.backend_status(self.platform)
        wanted = self.config.backend
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
        on_gpu = self.platform.is_gpu and self.platform.torch_usable
        if self.platform.is_gpu and not on_gpu:
            self.notes.append(
                f"torch cannot launch on the {self.platform.arch} GPU (CPU build of torch?); decoding runs on the reference"
            )
            statuses = [s for s in statuses if s.name == "reference"]
        candidates = [s for s in statuses if s.available and (s.name != "reference" or not on_gpu)]
        if not candidates:
            why = "; ".join(f"{s.name}: {s.reason}" for s in statuses if not s.available)
            return (
                None,
                f"backend_unavailable: no kernel backend can run on {self.platform.kind} {self.platform.arch} ({why})",
            )
        return registry.get_backend(candidates[0].name)(), None

    def _default_deployment(self) -> Deployment:
        return Deployment(
            platform_kind=self.platform.kind,
            arch=self.platform.arch,
            compute_units=self.platform.compute_units,
            partition_mode=self.platform.partition_mode,
            tp_size=self.tp_size,
            weight_dtype=self.weight_dtype,
            kv_cache_dtype=self.kv_dtype,
            block_size=self.block_size,
            dims=self.dims,
        )

    def _artifact_problem(self, backend: KernelBackend, key: str) -> tuple[ArtifactStore | None, str | None]:
        store = ArtifactStore(self.config.artifact_dir) if self.config.artifact_dir else None
        if not backend.needs_artifacts:
            return store, None
        where = f"in {store.root}" if store else "(no artifact_dir configured)"
        if store is not None:
            try:
                if store.lookup(key) is not None:
                    return store, None
            except ArtifactError as e:
                code = (
                    "artifact_checksum"
                    if "checksum mismatch" in str(e) or "is missing" in str(e)
                    else "artifact_invalid"
                )
                return store, f"{code}: {e}"
        if self.config.allow_jit:
            return store, None
        return store, (
            f"no_artifact: no baked {backend.name} artifact for build key {key[:16]} "
            f"({self.platform.arch}, {self.dims.architecture}, TP {self.tp_size}) {where} and allow_jit is false"
        )

    def start(self) -> Runner:
        """Refusal -> build -> warm-up; leaves ``state`` mono, degraded or off."""
        t0 = time.perf_counter()
        cfg = self.config
        if not cfg.enabled:
            self.state = OFF
            if self.metrics is not None:
                self.metrics.set_enabled(False)
            return self
        self.recorder.check_writable()
        history = self.recorder.read()
        self.notes.extend(history.problems)
        self.recorder.export(history)

        reasons: list[str] = []
        loop = self.recorder.crash_loop_reason(history, cfg.max_failstops, cfg.failstop_window_s)
        if loop:
            reasons.append(loop)
        backend, why = self._choose_backend()
        store = None
        req = None
        if backend is None:
            reasons.append(why)
        else:
            self.backend = backend
            try:
                req = BuildRequest(
                    dims=self.dims,
                    weight_dtype=self.weight_dtype,
                    tp_size=self.tp_size,
                    widths=cfg.widths,
                    block_size=self.block_size,
                    platform=self.platform,
                    kv_dtype=self.kv_dtype,
                    wait_timeout_s=cfg.wait_timeout_s,
                )
            except ValueError as e:
                reasons.append(f"build_request: {e}")
            if req is not None:
                self.build_key = backend.build_key(req)
                store, problem = self._artifact_problem(backend, self.build_key)
                deployment = replace(self.deployment or self._default_deployment(), artifact_problem=problem)
                reasons.extend(refusal_reasons(deployment, backend.kernel_spec(self.platform, cfg.widths)))

        # vote 1: every rank agrees before anything (possibly collective) is built
        agreed = self.vote.min_vote(_level(reasons))
        if agreed < _OK and not reasons:
            reasons.append("peer_refused: another tensor-parallel rank refused; see its log")
        if agreed == _OK:
            reasons.extend(self._build_and_warm(backend, req, store))
            # vote 2: warm-up results
            agreed = self.vote.min_vote(_level(reasons))
            if agreed < _OK and not reasons:
                reasons.append("peer_refused: warm-up failed on another tensor-parallel rank; see its log")

        if reasons:
            # a crash loop always degrades (raising would restart into the same loop)
            self._refuse(reasons, force_degrade=agreed == _DEGRADE_ONLY)
        else:
            self.state = MONO
            if self.metrics is not None:
                self.metrics.set_enabled(True)
                self.metrics.set_build(backend.name, self.platform.arch, self.build_key or "", monodecode.__version__)
        if self.warmup is not None:
            self.warmup.duration_s = time.perf_counter() - t0
            if self.metrics is not None:
                self.metrics.set_warmup(self.warmup.duration_s, self.warmup.max_abs_error)
        return self

    def _refuse(self, reasons: list[str], force_degrade: bool = False) -> None:
        self.reasons = reasons
        if self.kernels is not None:
            self.kernels.close()
            self.kernels = None
        if self.config.on_refusal == "raise" and not force_degrade:
            raise RefusalError(reasons)
        self.state = DEGRADED
        if self.metrics is not None:
            self.metrics.set_enabled(False)
            self.metrics.set_refusals(reason_code(r) for r in reasons)
            if self.backend is not None:
                self.metrics.set_build(
                    self.backend.name, self.platform.arch, self.build_key or "", monodecode.__version__
                )

    def _build_and_warm(self, backend: KernelBackend, req: BuildRequest, store: ArtifactStore | None) -> list[str]:
        try:
            self.kernels = backend.build(req, self.weights, store, self.config.allow_jit)
        except RefusalError as e:
            return e.reasons
        except ArtifactError as e:
            return [f"artifact_invalid: {e}"]
        except Exception as e:  # a compiler or loader failure is a refusal, with its cause
            first = (str(e).splitlines() or [""])[0]
            return [f"build_failed: {backend.name} build raised {type(e).__name__}: {first}"]
        try:
            self.warmup = self._golden_check()
        except Exception as e:
            first = (str(e).splitlines() or [""])[0]
            return [f"warmup_failed: golden decode raised {type(e).__name__}: {first}"]
        failure = self.warmup.failure()
        return [failure] if failure else []

    def _golden_check(self) -> WarmupReport:
        """One decode step per width on the real weights: every layer vs the reference."""
        import torch

        from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
        from monodecode.model.reference import decode_layer, embed

        dims, weights, kernels = self.dims, self.weights, self.kernels
        device = self._device()
        bs = self.block_size
        report = WarmupReport()
        gen = torch.Generator(device="cpu").manual_seed(20261101)
        for width in self.config.widths:
            t0 = time.perf_counter()
            # contexts cross a KV block boundary and differ per row
            lens = [bs + 1 + (r % bs) for r in range(width)]
            num_blocks = sum(-(-(n + 1) // bs) for n in lens) + 1
            alloc = BlockAllocator(num_blocks, bs)
            for r, n in enumerate(lens):
                alloc.append_slots(r, n)
            meta = alloc.decode_metadata(list(range(width)), device=device)
            kv_ref = PagedKVCache.allocate(dims, num_blocks, bs, device=device)
            for t in kv_ref.key + kv_ref.value:
                t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
            kv_mono = PagedKVCache(
                key=[t.clone() for t in kv_ref.key], value=[t.clone() for t in kv_ref.value], block_size=bs
            )
            ids = torch.randint(0, dims.vocab_size, (width,), generator=gen).to(device)
            x = embed(weights, ids)
            max_err, worst_margin, worst_layer, tol_at_worst, ok = 0.0, float("-inf"), 0, 0.0, True
            for layer, lw in enumerate(weights.layers):
                ref_out = decode_layer(dims, layer, lw, x, meta, kv_ref)
                out = kernels.forward_layer(layer, x, meta, kv_mono)
                err = (out.float() - ref_out.float()).abs().max().item()
                for a, b in ((kv_mono.key[layer], kv_ref.key[layer]), (kv_mono.value[layer], kv_ref.value[layer])):
                    err = max(err, (a.float() - b.float()).abs().max().item())
                tol = self.config.warmup_atol + self.config.warmup_rtol * ref_out.float().abs().max().item()
                if err != err:  # NaN
                    err = float("inf")
                max_err = max(max_err, err)
                ok = ok and err <= tol
                if err - tol > worst_margin:
                    worst_margin, worst_layer, tol_at_worst = err - tol, layer, tol
                x = ref_out
            health = kernels.health()
            report.widths.append(
                WidthCheck(width, max_err, tol_at_worst, worst_layer, time.perf_counter() - t0, health, ok)
            )
        return report

    # ---- rank-local state, folded in by vote -----------------------------------------------

    def request_disable(self, reason: str) -> None:
        """Rank-local wish to stop mono decode; takes effect at the next ``revote`` on all ranks."""
        self._local_disable = reason

    def revote(self) -> bool:
        """MIN vote over ranks at a safe point (never inside graph capture); True = still mono."""
        ok = self.vote.agree(self.state == MONO and self._local_disable is None)
        if not ok and self.state == MONO:
            reason = (
                f"disabled: {self._local_disable}"
                if self._local_disable
                else "peer_disabled: another tensor-parallel rank disabled mono decode"
            )
            self._refuse_at_runtime([reason])
        return ok

    def _refuse_at_runtime(self, reasons: list[str]) -> None:
        self.reasons = reasons
        self.state = DEGRADED
        if self.metrics is not None:
            self.metrics.set_enabled(False)
            self.metrics.set_refusals(reason_code(r) for r in reasons)

    # ---- per step --------------------------------------------------------------------------

    def decide(self, info: StepInfo) -> StepDecision:
        """Pure function of ``info`` and the agreed state: the same on every rank."""
        if self.state == OFF:
            return StepDecision("fallback", "disabled", step=self.step)
        if self.state != MONO:
            return StepDecision("fallback", "degraded", step=self.step)
        if not info.has_metadata:
            return StepDecision("fallback", "no_metadata", step=self.step)
        if info.num_prefill_rows > 0:
            reason = "prefill" if info.num_decode_rows <= 0 else "mixed_batch"
            return StepDecision("fallback", reason, step=self.step)
        if info.graph_mode not in STEP_GRAPH_MODES_OK:
            return StepDecision("fallback", "graph_mode", step=self.step)
        width = smallest_width(self.config.widths, info.num_rows)
        if width is None or info.num_rows <= 0:
            return StepDecision("fallback", "rows_exceed_width", step=self.step)
        return StepDecision("mono", None, width, step=self.step)

    def begin_step(self, info: StepInfo) -> StepDecision:
        decision = self.decide(info)
        self.step += 1
        if decision:
            self._arm_faults()
            self.mono_steps += 1
        if self.metrics is not None:
            self.metrics.count_step(decision.path, decision.reason)
        self._t_start = self._timestamp()
        return decision

    def _arm_faults(self) -> None:
        for f in self.faults:
            if f.kind in ("stall", "nonfinite") and f.step == self.mono_steps and f.applies_to(self.tp_rank):
                if not self.kernels.arm_fault(f):
                    self.notes.append(f"fault drill {f} not run: backend {self.backend.name} cannot inject it")

    def forward_layer(self, layer: int, x: Any, meta: Any, kv: Any) -> Any:
        return self.kernels.forward_layer(layer, x, meta, kv)

    def check_health_before_logits(self, decision: StepDecision, x: Any = None) -> None:
        """Fail-stop when the kernels' health word is set or the residual stream is non-finite.
        Never returns on failure: the step's logits are never computed."""
        if not decision or self.kernels is None:
            return
        code = self.kernels.health()
        fault = decode_health(code)
        if fault is None and x is not None:
            import torch

            if not bool(torch.isfinite(x).all()):
                fault = HealthFault("nonfinite", None, None)
        if fault is None:
            return
        event = FailStopEvent(
            rank=self.tp_rank,
            step=decision.step,
            site=fault.site,
            layer=fault.layer,
            kernel=fault.kernel,
            time=time.time(),
            detail=f"backend {self.backend.name}, build key {(self.build_key or '')[:16]}",
            pid=os.getpid(),
        )
        self.recorder.fail(event)

    def end_step(self, decision: StepDecision) -> None:
        if self.metrics is None:
            return
        start = self._t_start
        end = self._timestamp()
        if isinstance(start, float):
            self.metrics.observe_step(decision.path, end - start)
        elif start is not None:
            # GPU: resolve event pairs lazily (no host sync in the step)
            self._pending_times.append((decision.path, start, end))
            still = []
            for path, s, e in self._pending_times:
                if e.query():
                    self.metrics.observe_step(path, s.elapsed_time(e) / 1000.0)
                else:
                    still.append((path, s, e))
            self._pending_times = still[-1024:]

    def _timestamp(self):
        dev = self._device()
        if getattr(dev, "type", "cpu") == "cuda":
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    # ---- a whole step on the reference model (verify, tests) --------------------------------

    def decode_step(self, ids: Any, meta: Any, kv: Any, info: StepInfo | None = None):
        """One step over every layer: mono kernels when eligible, the reference (stock) layers
        otherwise. Returns fp32 logits, or fail-stops (no logits) on a kernel failure."""
        from monodecode.model.reference import decode_layer, embed, final_logits

        rows = int(ids.shape[0])
        info = info or StepInfo(num_rows=rows)
        decision = self.begin_step(info)
        x = embed(self.weights, ids, dtype=kv.dtype)
        for layer, lw in enumerate(self.weights.layers):
            if decision:
                x = self.forward_layer(layer, x, meta, kv)
            else:
                x = decode_layer(self.dims, layer, lw, x, meta, kv)
        self.check_health_before_logits(decision, x)
        logits = final_logits(self.weights, x)
        self.end_step(decision)
        self.last_decision = decision
        return logits

    def summary(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "backend": self.backend.name if self.backend else None,
            "build_key": self.build_key,
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "warmup": None
            if self.warmup is None
            else {
                "duration_s": self.warmup.duration_s,
                "max_abs_error": self.warmup.max_abs_error,
                "widths": [w.__dict__ for w in self.warmup.widths],
            },
        }
