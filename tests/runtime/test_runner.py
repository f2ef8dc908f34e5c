"""Runner lifecycle on the CPU: refusal (raise/degrade), artifacts, build, warm-up golden check,
per-step decisions, padding, and the scripted mono/fallback run against the reference."""

import json
from typing import ClassVar

import pytest
import torch
from prometheus_client import CollectorRegistry

from monodecode.config import MonoConfig
from monodecode.errors import RefusalError
from monodecode.kernels.reference_backend import ReferenceBackend, ReferenceKernels
from monodecode.metrics import MonoMetrics
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.reference import decode_step as reference_decode_step
from monodecode.model.weights import random_weights
from monodecode.runtime.failstop import FailStop
from monodecode.runtime.runner import Runner
from monodecode.runtime.vote import StepInfo
from monodecode.services.artifacts import ArtifactStore
from monodecode.services.faults import Fault
from monodecode.services.platform import Platform
from monodecode.spec import Deployment
from monodecode_ops.selfcheck import run_scenario

# small torch ops on one thread (2 shared CI cores; see conftest)
pytestmark = pytest.mark.usefixtures("torch_one_thread")

DIMS = profile_dims("tiny")
CPU = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)


@pytest.fixture(scope="module")
def started(weights, tmp_path_factory):
    """One started runner (widths 1,2,4,8) shared by the tests that only decide or decode."""
    r, reg = make(weights, tmp_path_factory.mktemp("started"), widths=[1, 2, 4, 8])
    r.start()
    return r


def make(weights, tmp_path, deployment=None, faults=(), **cfg):
    cfg.setdefault("widths", [1, 2])
    # the test backends run the reference math: timing them against it would be a coin toss
    cfg.setdefault("width_policy", "force")
    conf = MonoConfig.from_dict(
        {
            "enabled": True,
            "failstop_dir": str(tmp_path / "fs"),
            "termination_log": str(tmp_path / "term"),
            "exit_on_failstop": False,
            **cfg,
        }
    )
    reg = CollectorRegistry()
    m = MonoMetrics(reg)
    r = Runner(conf, DIMS, weights, CPU, metrics=m, deployment=deployment, faults=faults)
    return r, reg


# ---- test backends: real runner and store code around deliberately different builds ----------


class ArtifactReference(ReferenceBackend):
    """The reference math, but it only builds from a baked artifact (like flydsl): the artifact
    holds the build key; build() reads it back through the verified entry."""

    name: ClassVar[str] = "test_artifact_reference"
    needs_artifacts: ClassVar[bool] = True

    def build(self, req, weights, artifacts, allow_jit):
        key = self.build_key(req)
        entry = artifacts.lookup(key) if artifacts else None
        if entry is None:
            if not allow_jit:
                raise RefusalError(f"no_artifact: nothing for {key[:12]}")
        else:
            assert json.loads(entry.path_of("kernel.json").read_text())["key"] == key
        return ReferenceKernels(req, weights)


class SkipsLayer(ReferenceKernels):
    def forward_layer(self, layer, x, meta, kv):
        return x if layer == 2 else super().forward_layer(layer, x, meta, kv)


class WrongBackend(ReferenceBackend):
    name: ClassVar[str] = "test_wrong"

    def build(self, req, weights, artifacts, allow_jit):
        return SkipsLayer(req, weights)


class SumsUnseenSlots(ReferenceKernels):
    """The reference math plus zero times every V slot of the layer's cache, as a kernel that masks
    its scores but not its V loads computes: right wherever the cache holds finite values."""

    def forward_layer(self, layer, x, meta, kv):
        out = super().forward_layer(layer, x, meta, kv)
        return out + (0 * kv.value[layer].float().sum()).to(out.dtype)


class SumsUnseenBackend(ReferenceBackend):
    name: ClassVar[str] = "test_sums_unseen"

    def build(self, req, weights, artifacts, allow_jit):
        return SumsUnseenSlots(req, weights)


class CrashingBackend(ReferenceBackend):
    name: ClassVar[str] = "test_crash"

    def build(self, req, weights, artifacts, allow_jit):
        raise RuntimeError("compiler exploded\nsecond line")


# ---- lifecycle -------------------------------------------------------------------------------


def test_disabled_runner_counts_every_step_as_disabled(weights, tmp_path):
    r, reg = make(weights, tmp_path, enabled=False)
    r.start()
    assert r.state == "off" and r.kernels is None
    d = r.begin_step(StepInfo(num_rows=1))
    assert not d and d.reason == "disabled"
    assert reg.get_sample_value("monodecode_fallback_steps_total", {"reason": "disabled"}) == 1
    assert reg.get_sample_value("monodecode_enabled") == 0


def test_start_on_cpu_picks_reference_and_warms_every_width(weights, tmp_path):
    r, reg = make(weights, tmp_path, widths=[1, 3, 5])
    r.start()
    assert r.state == "mono" and r.backend.name == "reference" and not r.reasons
    assert [w.width for w in r.warmup.widths] == [1, 3, 5]
    assert r.warmup.passed and r.warmup.max_abs_error == 0.0  # the reference path is exact
    assert reg.get_sample_value("monodecode_enabled") == 1
    assert reg.get_sample_value("monodecode_warmup_duration_seconds") > 0
    assert reg.get_sample_value("monodecode_warmup_max_abs_error") == 0.0
    assert (
        reg.get_sample_value(
            "monodecode_build_info",
            {"backend": "reference", "arch": "cpu", "build_key": r.build_key, "version": "0.1.0"},
        )
        == 1
    )


def test_fp8_weights_warm_up(tmp_path):
    r, _ = make(random_weights(DIMS, seed=1, weight_dtype="fp8"), tmp_path, widths=[1])
    r.start()
    assert r.state == "mono" and r.weight_dtype == "fp8"


@pytest.mark.parametrize(
    "info, path, reason, width",
    [
        (StepInfo(num_rows=1), "mono", None, 1),
        (StepInfo(num_rows=3), "mono", None, 4),
        (StepInfo(num_rows=8, graph_mode="full"), "mono", None, 8),
        (StepInfo(num_rows=4, graph_mode="full_decode_only"), "mono", None, 4),
        (StepInfo(num_rows=9), "fallback", "rows_exceed_width", None),
        (StepInfo(num_rows=0), "fallback", "rows_exceed_width", None),
        (StepInfo(num_rows=5, num_prefill_rows=5), "fallback", "prefill", None),
        (StepInfo(num_rows=5, num_prefill_rows=4), "fallback", "mixed_batch", None),
        (StepInfo(num_rows=2, graph_mode="piecewise"), "fallback", "graph_mode", None),
        (StepInfo(num_rows=2, has_metadata=False), "fallback", "no_metadata", None),
    ],
)
def test_step_decisions(started, info, path, reason, width):
    d = started.decide(info)
    assert (d.path, d.reason, d.width) == (path, reason, width)


def test_padded_rows_are_inert_and_exact(weights, started):
    r = started
    bs = 16
    alloc = BlockAllocator(32, bs)
    for s in range(3):
        alloc.append_slots(s, 17 + s)
    kv_run = PagedKVCache.allocate(DIMS, 32, bs)
    for t in kv_run.key + kv_run.value:
        t.normal_()
    kv_ref = PagedKVCache(key=[t.clone() for t in kv_run.key], value=[t.clone() for t in kv_run.value], block_size=bs)
    meta = alloc.decode_metadata([0, 1, 2])
    ids = torch.tensor([5, 6, 7])
    out = r.decode_step(ids, meta, kv_run, StepInfo(num_rows=3))
    assert r.last_decision.width == 4
    ref = reference_decode_step(weights, ids, meta, kv_ref)
    assert torch.equal(out, ref)
    for a, b in zip(kv_run.key + kv_run.value, kv_ref.key + kv_ref.value):
        assert torch.equal(a, b)  # the padded 4th row wrote nothing


def test_scripted_run_matches_reference_and_counts(weights, tmp_path):
    r, reg = make(weights, tmp_path, widths=[1, 2, 4, 8])
    r.start()
    res = run_scenario(r)
    assert res.failstop is None and res.tokens_match and res.max_abs_logit_diff == 0.0
    assert all(s.as_expected for s in res.steps), [(s.name, s.path, s.reason) for s in res.steps]
    exp = res.expected_counts()
    assert exp["mono"] >= 4 and exp["prefill"] >= 1 and exp["mixed_batch"] == 1
    assert exp["rows_exceed_width"] == 1 and exp["graph_mode"] == 1
    for p in ("mono", "fallback"):
        assert reg.get_sample_value("monodecode_steps_total", {"path": p}) == exp[p]
        assert reg.get_sample_value("monodecode_step_duration_seconds_count", {"path": p}) == exp[p]
    for reason in ("prefill", "mixed_batch", "rows_exceed_width", "graph_mode"):
        assert reg.get_sample_value("monodecode_fallback_steps_total", {"reason": reason}) == exp[reason]


def test_scripted_run_with_a_single_width(weights, tmp_path):
    r, reg = make(weights, tmp_path, widths=[1])
    r.start()
    res = run_scenario(r)
    assert res.failstop is None and res.tokens_match and all(s.as_expected for s in res.steps)
    assert reg.get_sample_value("monodecode_steps_total", {"path": "mono"}) == res.expected_counts()["mono"] >= 2


def _one_row(bs=16):
    alloc = BlockAllocator(4, bs)
    alloc.append_slots(0, 5)
    return alloc.decode_metadata([0]), PagedKVCache.allocate(DIMS, 4, bs), torch.tensor([3])


def test_warmup_forwards_are_not_counted_and_keep_the_drill(weights, tmp_path):
    """vLLM's warm-up / profiling forwards (real=False) run the kernels but are no step: nothing
    is counted and an armed drill waits for the first real mono step."""
    r, reg = make(weights, tmp_path, faults=(Fault("nonfinite", layer=1, step=0),))
    r.start()
    meta, kv, ids = _one_row()
    for _ in range(3):
        r.decode_step(ids, meta, kv, real=False)
    assert r.last_decision.path == "mono" and not r.last_decision.real
    assert (r.steps, r.mono_steps) == (0, 0)
    assert reg.get_sample_value("monodecode_steps_total", {"path": "mono"}) == 0
    assert reg.get_sample_value("monodecode_step_duration_seconds_count", {"path": "mono"}) == 0
    with pytest.raises(FailStop) as e:
        r.decode_step(ids, meta, kv)
    ev = e.value.event
    assert (ev.step, ev.site, ev.layer, ev.kernel) == (0, "nonfinite", 1, "k2")
    assert reg.get_sample_value("monodecode_steps_total", {"path": "mono"}) == 1


def test_captured_decisions_are_counted_at_each_replay(weights, tmp_path):
    r, reg = make(weights, tmp_path, widths=[1, 2, 4], faults=(Fault("stall", layer=0, step=0),))
    r.start()
    for rows in (1, 2, 4):
        assert r.capture_step(StepInfo(num_rows=rows, graph_mode="full_decode_only")).width == rows
    assert r.steps == 0 and reg.get_sample_value("monodecode_steps_total", {"path": "mono"}) == 0
    d = r.account_replay(3)  # vLLM pads 3 rows up to the graph captured for 4
    assert (d.path, d.width, d.step, d.real) == ("mono", 4, 0, True)
    d = r.account_replay(9)
    assert (d.path, d.reason, d.step) == ("fallback", "rows_exceed_width", 1)
    assert (r.steps, r.mono_steps) == (2, 1)
    assert reg.get_sample_value("monodecode_steps_total", {"path": "mono"}) == 1
    assert reg.get_sample_value("monodecode_fallback_steps_total", {"reason": "rows_exceed_width"}) == 1
    # a drill cannot reach into a replayed graph: said, never silently dropped
    assert r.notes == ["fault drill stall:layer=0,step=0 not run: mono step 0 was a FULL-graph replay"]


def test_degrade_after_start_is_voted_and_exported(weights, tmp_path):
    r, reg = make(weights, tmp_path, on_refusal="degrade")
    r.start()
    r.request_disable("shadow_mismatch: layer 0 differs from vLLM's layer by 1 (tolerance 0.1)")
    assert r.state == "mono"  # a rank-local wish: nothing changes before the vote
    d = r.begin_step(StepInfo(num_rows=1))  # one rank: the vote is local and applies here
    assert (d.path, d.reason) == ("fallback", "degraded") and r.state == "degraded"
    assert r.reasons == ["shadow_mismatch: layer 0 differs from vLLM's layer by 1 (tolerance 0.1)"]
    assert reg.get_sample_value("monodecode_refusal_info", {"reason": "shadow_mismatch"}) == 1
    assert reg.get_sample_value("monodecode_enabled") == 0
    r2, _ = make(weights, tmp_path)
    r2.start()
    with pytest.raises(RefusalError, match="kv_layout: bad"):
        r2.refuse("kv_layout: bad")


# ---- refusals --------------------------------------------------------------------------------


def test_every_refusal_reason_raises_together(weights, tmp_path):
    dep = Deployment(platform_kind="cpu", arch="cpu", compute_units=2, pp_size=2, lora=True, block_size=16, dims=DIMS)
    r, _ = make(weights, tmp_path, deployment=dep)
    with pytest.raises(RefusalError) as e:
        r.start()
    assert e.value.codes == ["pipeline_parallel", "lora"]
    assert "\n" not in str(e.value) and str(e.value).startswith("mono decode refused: pipeline_parallel:")


def test_degrade_exports_reasons_and_falls_back(weights, tmp_path):
    dep = Deployment(platform_kind="cpu", arch="cpu", compute_units=2, sleep_mode=True, kv_cache_dtype="fp8", dims=DIMS)
    r, reg = make(weights, tmp_path, deployment=dep, on_refusal="degrade")
    r.start()
    assert r.state == "degraded" and [x.split(":")[0] for x in r.reasons] == ["sleep_mode", "kv_cache_dtype"]
    assert reg.get_sample_value("monodecode_enabled") == 0
    assert reg.get_sample_value("monodecode_refusal_info", {"reason": "sleep_mode"}) == 1
    assert reg.get_sample_value("monodecode_refusal_info", {"reason": "kv_cache_dtype"}) == 1
    d = r.begin_step(StepInfo(num_rows=1))
    assert d.reason == "degraded"
    assert r.warmup is None and r.kernels is None  # nothing was built for a refused deployment


def test_backend_unavailable_on_cpu(weights, tmp_path):
    r, _ = make(weights, tmp_path, backend="triton")
    with pytest.raises(
        RefusalError, match=r"backend_unavailable: backend triton cannot run here: triton needs a CUDA or ROCm GPU"
    ):
        r.start()


def test_build_failure_is_a_refusal_with_its_cause(weights, tmp_path, backend):
    r, _ = make(weights, tmp_path, backend=backend(CrashingBackend), on_refusal="degrade", widths=[1])
    r.start()
    assert r.state == "degraded"
    assert r.reasons == ["build_failed: test_crash build raised RuntimeError: compiler exploded"]


def test_warmup_catches_a_wrong_kernel(weights, tmp_path, backend):
    r, reg = make(weights, tmp_path, backend=backend(WrongBackend), on_refusal="degrade", widths=[1, 2])
    r.start()
    assert r.state == "degraded" and r.reasons[0].startswith("warmup_failed: width 1 differs from the reference")
    assert "at layer 2" in r.reasons[0]
    assert not r.warmup.passed and r.warmup.max_abs_error > 0.1
    assert reg.get_sample_value("monodecode_warmup_max_abs_error") == r.warmup.max_abs_error
    with pytest.raises(RefusalError, match="warmup_failed"):
        make(weights, tmp_path, backend="test_wrong", widths=[1])[0].start()


def test_warmup_catches_a_kernel_that_sums_slots_no_row_has_cached(weights, tmp_path, backend):
    """The golden inputs hold NaN in every cache slot no row has cached (block 0 is no row's, as
    vLLM's null block): a kernel that lets one into a sum, even times zero, fails the warm-up
    (stale cache contents would poison a served row), while its K/V writes still compare."""
    r, _ = make(weights, tmp_path, backend=backend(SumsUnseenBackend), on_refusal="degrade", widths=[1])
    r.start()
    assert r.state == "degraded" and r.reasons[0].startswith("warmup_failed: width 1 differs from the reference")
    assert r.warmup.max_abs_error == float("inf")
    ok, _ = make(weights, tmp_path, widths=[1])  # the reference backend itself: the poison never reaches a sum
    ok.start()
    assert ok.warmup.passed and ok.warmup.max_abs_error < 1e-2


# ---- artifacts -------------------------------------------------------------------------------


def _bake(store, runner_key):
    store.add(
        build_key=runner_key,
        backend="test_artifact_reference",
        arch="cpu",
        dims_digest=DIMS.digest(),
        widths=(1, 2, 4, 8),
        files={"kernel.json": json.dumps({"key": runner_key}).encode()},
        compiler={"name": "torch", "version": torch.__version__},
        profile="tiny",
    )


def test_artifact_lifecycle(weights, tmp_path, backend, monkeypatch):
    name = backend(ArtifactReference)
    art = tmp_path / "art"
    # 1. nothing baked, JIT not allowed -> no_artifact
    r, reg = make(weights, tmp_path, backend=name, artifact_dir=str(art), on_refusal="degrade")
    r.start()
    assert r.state == "degraded" and r.reasons[0].startswith(
        "no_artifact: no baked test_artifact_reference artifact for build key"
    )
    assert reg.get_sample_value("monodecode_refusal_info", {"reason": "no_artifact"}) == 1
    key = r.build_key
    # 2. JIT allowed -> runs without an artifact
    r, _ = make(weights, tmp_path, backend=name, artifact_dir=str(art), allow_jit=True)
    assert r.start().state == "mono"
    # 3. baked -> verified and loaded
    store = ArtifactStore(art)
    _bake(store, key)
    r, _ = make(weights, tmp_path, backend=name, artifact_dir=str(art))
    assert r.start().state == "mono" and r.build_key == key
    # 4. the corrupt_artifact drill -> checksum refusal, file untouched
    before = (art / "kernel.json").read_bytes()
    r, _ = make(weights, tmp_path, backend=name, artifact_dir=str(art))
    monkeypatch.setenv("MONODECODE_FAULT", "corrupt_artifact")
    with pytest.raises(
        RefusalError, match=r"artifact_checksum: artifact [0-9a-f]{12}: checksum mismatch for kernel.json"
    ):
        r.start()
    monkeypatch.delenv("MONODECODE_FAULT")
    assert (art / "kernel.json").read_bytes() == before
    # 5. tampered on disk -> checksum refusal, never a load (even with JIT allowed)
    (art / "kernel.json").write_bytes(before.replace(b"{", b"[", 1))
    r, _ = make(weights, tmp_path, backend=name, artifact_dir=str(art), allow_jit=True, on_refusal="degrade")
    r.start()
    assert r.state == "degraded" and r.reasons[0].startswith("artifact_checksum:")
    # 6. malformed manifest -> artifact_invalid
    (art / "manifest.json").write_text('{"schema": 1, "artifacts": [{}]}')
    r, _ = make(weights, tmp_path, backend=name, artifact_dir=str(art), on_refusal="degrade")
    r.start()
    assert r.reasons[0].startswith("artifact_invalid:") and "missing field 'build_key'" in r.reasons[0]


@pytest.mark.parametrize(
    "manifest, code",
    [
        ("[" * 100_000 + "]" * 100_000, "artifact_invalid"),
        ('{"schema": 1, "artifacts": [{"bytes": ' + "9" * 5000 + "}]}", "artifact_invalid"),
        (b"\xff\xfe{", "artifact_invalid"),
        (None, "artifact_invalid"),  # manifest.json is a directory
    ],
    ids=["deep", "digits", "not-utf8", "directory"],
)
def test_malformed_artifacts_refuse_never_crash(weights, tmp_path, backend, manifest, code):
    """Runner.start with on_refusal=degrade turns any manifest into a refusal reason, never an
    exception (model load would otherwise fail even with degrade)."""
    art = tmp_path / "art"
    art.mkdir()
    if manifest is None:
        (art / "manifest.json").mkdir()
    else:
        data = manifest if isinstance(manifest, bytes) else manifest.encode()
        (art / "manifest.json").write_bytes(data)
    r, reg = make(weights, tmp_path, backend=backend(ArtifactReference), artifact_dir=str(art), on_refusal="degrade")
    r.start()
    assert r.state == "degraded" and r.reasons[0].startswith(f"{code}: ") and "\n" not in r.reasons[0]
    assert reg.get_sample_value("monodecode_refusal_info", {"reason": code}) == 1


def test_reference_key_changes_with_widths_and_dtype(weights, tmp_path):
    keys = set()
    for cfg in ({"widths": [1]}, {"widths": [1, 2]}):
        r, _ = make(weights, tmp_path, **cfg)
        keys.add(r.start().build_key)
    r = Runner(
        MonoConfig(enabled=True, failstop_dir=str(tmp_path / "fs"), widths=(1,)),
        DIMS,
        random_weights(DIMS, seed=0, weight_dtype="fp8"),
        CPU,
        faults=(),
    )
    keys.add(r.start().build_key)
    assert len(keys) == 3


def test_unwritable_failstop_dir_is_one_line_error(weights, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = Runner(MonoConfig(enabled=True, failstop_dir=str(blocker / "sub")), DIMS, weights, CPU, faults=())
    with pytest.raises(Exception) as e:
        r.start()
    assert "fail-stop directory" in str(e.value) and "not writable" in str(e.value) and "\n" not in str(e.value)


def test_auto_backend_choice_by_platform(weights, tmp_path):
    # a GPU torch can drive: the reference is not a serving backend, so auto refuses when no kernel backend runs
    gpu = Platform(kind="rocm", arch="gfx942", name="MI300X", compute_units=304, torch_usable=True)
    r = Runner(MonoConfig(enabled=True, failstop_dir=str(tmp_path), widths=(1,)), DIMS, weights, gpu, faults=())
    backend, why = r._choose_backend()
    if backend is None:
        assert why.startswith("backend_unavailable: no kernel backend can run on rocm gfx942")
    else:
        assert backend.name in ("flydsl", "triton")
    # a GPU seen only in sysfs (CPU build of torch): the self-test runs on the reference
    sysfs_only = Platform(kind="rocm", arch="gfx942", name="MI300X", compute_units=304, torch_usable=False)
    r = Runner(MonoConfig(enabled=True, failstop_dir=str(tmp_path), widths=(1,)), DIMS, weights, sysfs_only, faults=())
    backend, _ = r._choose_backend()
    assert backend.name == "reference" and "torch cannot launch" in r.notes[0]


def test_refusal_error_pickles_with_its_reasons():
    import pickle

    e = pickle.loads(pickle.dumps(RefusalError(["a: one", "b: two"])))
    assert (
        e.reasons == ["a: one", "b: two"] and e.codes == ["a", "b"] and str(e) == "mono decode refused: a: one; b: two"
    )


# ---- the whole-step launch (DecodeKernels.forward_step) ----------------------------------------


def _step_started(weights, tmp_path, backend, cls, **cfg):
    r, reg = make(weights, tmp_path, backend=backend(cls), **cfg)
    r.start()
    assert r.state == "mono", r.reasons
    return r


def test_decode_step_runs_one_forward_step_where_the_kernels_have_one(weights, tmp_path, backend):
    from fake_backends import StepReferenceBackend

    r = _step_started(weights, tmp_path, backend, StepReferenceBackend)
    # warm-up checked the whole-step launch of every width against the reference step
    assert [w.step_error for w in r.warmup.widths] == [0.0, 0.0]
    r.kernels.calls.update(forward_layer=0, forward_step=0)
    meta, kv, ids = _one_row()
    kv_ref = PagedKVCache(key=[t.clone() for t in kv.key], value=[t.clone() for t in kv.value], block_size=16)
    out = r.decode_step(ids, meta, kv, StepInfo(num_rows=1))
    assert r.last_decision.path == "mono"
    assert r.kernels.calls == {"forward_layer": 0, "forward_step": 1}
    assert torch.equal(out, reference_decode_step(weights, ids, meta, kv_ref))
    # a fallback step runs the stock layers, never the kernels
    r.decode_step(ids, meta, kv, StepInfo(num_rows=1, num_prefill_rows=1))
    assert r.last_decision.reason == "prefill" and r.kernels.calls == {"forward_layer": 0, "forward_step": 1}


def test_decode_step_falls_back_to_forward_layer_when_forward_step_returns_none(weights, tmp_path, backend):
    from fake_backends import NoStepReferenceBackend

    r = _step_started(weights, tmp_path, backend, NoStepReferenceBackend)
    assert [w.step_error for w in r.warmup.widths] == [None, None]
    r.kernels.calls.update(forward_layer=0, forward_step=0)
    meta, kv, ids = _one_row()
    kv_ref = PagedKVCache(key=[t.clone() for t in kv.key], value=[t.clone() for t in kv.value], block_size=16)
    out = r.decode_step(ids, meta, kv, StepInfo(num_rows=1))
    assert r.kernels.calls == {"forward_layer": DIMS.num_layers, "forward_step": 1}
    assert torch.equal(out, reference_decode_step(weights, ids, meta, kv_ref))


def test_a_shadow_checked_step_runs_layer_by_layer(weights, tmp_path, backend):
    """The shadow check compares one layer's output: that step runs ``forward_layer`` per layer
    (the whole-step launch has no layer boundary to capture); the other steps one launch."""
    from fake_backends import StepReferenceBackend

    r = _step_started(weights, tmp_path, backend, StepReferenceBackend, shadow_check_every=2)
    r.kernels.calls.update(forward_layer=0, forward_step=0)
    meta, kv, ids = _one_row()
    r.decode_step(ids, meta, kv, StepInfo(num_rows=1))  # mono step 0: not checked
    assert r.kernels.calls == {"forward_layer": 0, "forward_step": 1}
    r.decode_step(ids, meta, kv, StepInfo(num_rows=1))  # mono step 1: checked
    assert r.kernels.calls == {"forward_layer": DIMS.num_layers, "forward_step": 1}


def test_warmup_checks_the_whole_step_launch(weights, tmp_path, backend):
    from fake_backends import StepSkipsLayerBackend

    r, _ = make(weights, tmp_path, backend=backend(StepSkipsLayerBackend), on_refusal="degrade")
    r.start()
    assert r.state == "degraded"
    assert r.reasons[0].startswith(
        "warmup_failed: width 1's one launch over every layer (forward_step) differs from the reference step by"
    )
    assert r.warmup.widths[0].within_tolerance and not r.warmup.widths[0].passed


def test_width_timing_times_the_whole_step_launch(weights, tmp_path, backend):
    from fake_backends import StepReferenceBackend

    r = _step_started(weights, tmp_path, backend, StepReferenceBackend)
    bench, why = r._layer_bench()
    assert why is None
    mono, _ = bench.steps(1, 20)
    r.kernels.calls.update(forward_layer=0, forward_step=0)
    mono()
    assert r.kernels.calls == {"forward_layer": 0, "forward_step": 1}


def test_auto_never_picks_an_opt_in_backend(weights, tmp_path, monkeypatch):
    """``triton-step`` runs only when named: on an H100 auto takes triton; where triton cannot
    run, auto refuses rather than fall to the step launch, which still runs when named."""
    from monodecode.kernels.triton.backend import TritonBackend

    h100 = Platform(kind="cuda", arch="sm_90", name="H100", compute_units=132, torch_usable=True)

    def runner(name):
        conf = MonoConfig(enabled=True, backend=name, failstop_dir=str(tmp_path), widths=(1,))
        return Runner(conf, profile_dims("llama3-1b"), weights, h100, faults=())

    assert runner("auto")._choose_backend()[0].name == "triton"
    assert runner("triton-step")._choose_backend()[0].name == "triton-step"
    monkeypatch.setattr(TritonBackend, "unavailable_reason", classmethod(lambda cls, p: "triton is switched off"))
    backend, why = runner("auto")._choose_backend()
    assert backend is None and why.startswith("backend_unavailable: no kernel backend can run on cuda sm_90")
    assert runner("triton-step")._choose_backend()[0].name == "triton-step"
