"""The ``triton-step`` backend's host side on a CPU: what it refuses and why, where it can run,
that only a deployment naming it uses it, and the callers' dispatch to a whole-step launch
(``DecodeKernels.forward_step``) in ``vllm_plugin.step.run_kernel_layers``. The step launch
itself runs only on an sm_90 GPU (tests/kernels/triton/test_step_gpu.py)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from monodecode.config import MonoConfig
from monodecode.errors import ConfigError, RefusalError
from monodecode.kernels import registry
from monodecode.kernels.base import BuildRequest, DecodeKernels
from monodecode.kernels.triton.backend import TritonBackend
from monodecode.kernels.triton.step_backend import TritonStepBackend
from monodecode.kernels.triton.step_plan import step_refusals
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.reference import run_layers
from monodecode.model.weights import random_weights
from monodecode.reasons import RefusalReason, reason_code
from monodecode.services.buildkey import source_digest, source_files
from monodecode.services.platform import Platform
from monodecode.vllm_plugin.step import run_kernel_layers

pytestmark = pytest.mark.usefixtures("torch_one_thread")

H100 = Platform(kind="cuda", arch="sm_90", name="NVIDIA H100", compute_units=132, torch_usable=True)
CPU = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)
MI300 = Platform(kind="rocm", arch="gfx942", name="MI300X", compute_units=304, torch_usable=True)
A100 = Platform(kind="cuda", arch="sm_80", name="NVIDIA A100", compute_units=108, torch_usable=True)
CODES = {r.value for r in RefusalReason}


def req(profile="llama3-1b", weight_dtype="bf16", tp=1, widths=(1,), platform=H100):
    return BuildRequest(profile_dims(profile), weight_dtype, tp, widths, 16, platform)


def refusals(**kw):
    reasons = TritonStepBackend().refusals(req(**kw))
    assert all(reason_code(r) in CODES for r in reasons), reasons  # each a metric label
    return reasons


# ---- refusals -------------------------------------------------------------------------------


def test_llama_bf16_widths_up_to_8_are_accepted():
    assert step_refusals(profile_dims("llama3-1b"), "bf16", 1, (1, 2, 4, 8)) == []
    assert refusals(widths=(1, 2, 4, 8)) == []
    assert refusals(profile="llama3-8b", widths=(1,)) == []


def test_tiny_model_dims_are_refused():
    reasons = refusals(profile="tiny")
    assert any("must be multiples of 1024" in r for r in reasons), reasons
    assert all(r.startswith("model_dims: ") for r in reasons), reasons


@pytest.mark.parametrize(
    "profile,expected",
    [
        ("qwen3-8b", ["Llama-style and Gemma-3 layers only"]),
        ("gemma3-27b", ["Gemma-3 layers at width 1 only"]),
    ],
)
def test_other_families_are_refused_with_their_reasons(profile, expected):
    """Qwen3 (q/k-norm without the rest of Gemma-3) is refused; Gemma-3 is served at width 1
    only: widths 1 and 8 are refused for that, width 1 alone is served."""
    reasons = refusals(profile=profile, widths=(1, 8))
    for text in expected:
        assert any(r.startswith("model_dims: ") and text in r for r in reasons), (text, reasons)
    assert (refusals(profile=profile) == []) == (profile == "gemma3-27b")


def test_fp8_e4m3fn_weights_are_served_and_fnuz_refused():
    # triton and the step launch both run FP8 e4m3fn (OCP) on CUDA, at every width
    assert TritonBackend().refusals(req(weight_dtype="fp8")) == []
    assert refusals(weight_dtype="fp8", widths=(1, 2, 4, 8)) == []
    # e4m3fnuz is gfx942's: where triton refuses the dtype too, one weight_dtype reason says it
    assert [reason_code(r) for r in refusals(weight_dtype="fp8_fnuz")] == ["weight_dtype"]
    (why,) = step_refusals(profile_dims("llama3-8b"), "fp8_fnuz", 1, (1,))
    assert why == (
        "weight_dtype: the step launch streams bf16 or fp8 (e4m3fn, per-row scales) weights, asked for fp8_fnuz"
    )


def test_tp2_is_refused_once():
    reasons = refusals(tp=2)
    assert [reason_code(r) for r in reasons] == ["tp_size"], reasons


def test_width_16_is_refused():
    assert TritonBackend().refusals(req(widths=(1, 16))) == []
    reasons = refusals(widths=(1, 16))
    assert reasons == ["model_dims: the step launch decodes 1-8 rows (mma.sync's 8 columns), asked for 16"]


def test_llama3_8b_is_served_at_every_width_and_more_than_two_down_tiles_are_refused():
    """8B above 1 row streams down's input (two down tiles a program on 132 SMs); a model with three
    down tiles a program there is refused in one reason naming them."""
    assert refusals(profile="llama3-8b", widths=(1, 2, 8)) == []
    few = Platform(kind="cuda", arch="sm_90", name="NVIDIA H100 (MIG)", compute_units=96, torch_usable=True)
    reasons = refusals(profile="llama3-8b", widths=(1, 2), platform=few)
    assert [reason_code(r) for r in reasons] == ["model_dims"], reasons
    assert "two down tiles at most" in reasons[0] and "need 3" in reasons[0], reasons


def test_too_few_sms_for_the_attention_tasks_is_refused():
    few = Platform(kind="cuda", arch="sm_90", name="NVIDIA H100 (MIG)", compute_units=16, torch_usable=True)
    reasons = refusals(widths=(1, 8), platform=few)
    assert [reason_code(r) for r in reasons] == ["compute_units"], reasons
    assert "16 programs" in reasons[0] and "(8 x 8)" in reasons[0]


# ---- where it runs --------------------------------------------------------------------------


def test_unavailable_reasons():
    why = TritonStepBackend.unavailable_reason(CPU)
    assert "interpreter cannot run" in why and "this is cpu" in why
    why = TritonStepBackend.unavailable_reason(MI300)
    assert "sm_90's TMA and mma.sync" in why and "AMD GPUs run the flydsl or triton backends" in why
    assert "sm_90 or newer" in TritonStepBackend.unavailable_reason(A100)
    sysfs_only = Platform(kind="cuda", arch="sm_90", name="NVIDIA H100", compute_units=132, torch_usable=False)
    assert "torch cannot launch" in TritonStepBackend.unavailable_reason(sysfs_only)
    assert TritonStepBackend.unavailable_reason(H100) is None
    b200 = Platform(kind="cuda", arch="sm_100", name="NVIDIA B200", compute_units=148, torch_usable=True)
    assert TritonStepBackend.unavailable_reason(b200) is None
    # the refusals carry the platform's reason first
    assert refusals(platform=CPU)[0].startswith("no_gpu: the step launch is a Gluon kernel")
    assert refusals(platform=A100)[0].startswith("no_gpu: the step launch needs sm_90 or newer")


def test_interpreter_does_not_make_it_available(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonStepBackend.unavailable_reason(CPU) is not None
    st = {s.name: s for s in registry.backend_status(CPU)}
    assert not st["triton-step"].available


def test_kernel_spec():
    spec = TritonStepBackend().kernel_spec(H100, (1, 2, 4, 8, 16))
    assert spec.backend == "triton-step" and spec.widths == (1, 2, 4, 8)
    assert spec.platform_kinds == ("cuda",) and spec.tp_sizes == (1,) and spec.weight_dtypes == ("bf16", "fp8")
    assert spec.grid_size == 132 and spec.families == ("llama", "gemma3") and spec.head_dims == (64, 128)


def test_source_digest_covers_the_step_launch():
    from monodecode.kernels.triton import backend as triton_backend

    names = {p.name for p in source_files(Path(triton_backend.__file__).parent)}
    assert {"step_plan.py", "step_backend.py"} <= names
    for name in ("step_kernel.py", "step_launch.py"):  # being written beside this backend
        if (Path(triton_backend.__file__).parent / name).exists():
            assert name in names
    plan = Path(triton_backend.__file__).parents[1] / "plan.py"
    assert TritonStepBackend().source_digest() == source_digest(Path(triton_backend.__file__).parent, [plan])
    assert TritonStepBackend().build_key(req()) != TritonBackend().build_key(req())  # the name is keyed


def test_build_refuses_like_triton():
    with pytest.raises(RefusalError) as e:
        TritonStepBackend().build(req(platform=CPU), None, None, allow_jit=True)
    assert reason_code(e.value.reasons[0]) == "no_gpu"
    with pytest.raises(RefusalError) as e:
        TritonStepBackend().build(req(), None, None, allow_jit=False)
    assert e.value.reasons == ["no_artifact: the triton-step backend compiles just in time and allow_jit is off"]


def test_build_makes_step_kernels_on_the_platforms_device(monkeypatch):
    made = []

    class StepKernels:
        def __init__(self, *args):
            made.append(args)

    fake = types.ModuleType("monodecode.kernels.triton.step_launch")
    fake.StepKernels = StepKernels
    monkeypatch.setitem(sys.modules, "monodecode.kernels.triton.step_launch", fake)
    r = req(widths=(1, 2))
    weights = object()
    kernels = TritonStepBackend().build(r, weights, None, allow_jit=True)
    assert isinstance(kernels, StepKernels)
    assert made == [(r, weights, 132, torch.device("cuda:0"))]


# ---- registry and config --------------------------------------------------------------------


def test_registry_knows_it_and_auto_never_picks_it():
    assert "triton-step" in registry.known_backends() and "triton-step" in registry.OPT_IN
    assert registry.get_backend("triton-step") is TritonStepBackend
    st = {s.name: s for s in registry.backend_status(H100)}
    assert st["triton-step"].available and st["triton-step"].opt_in and st["triton-step"].reason is None
    assert not st["triton"].opt_in
    names = [b.name for b in registry.backends_for(H100)]
    assert names[0] == "triton" and "triton-step" not in names
    assert [s.name for s in registry.backend_status(H100)][:2] == ["triton", "reference"]
    st = {s.name: s for s in registry.backend_status(CPU)}
    assert not st["triton-step"].available and "interpreter cannot run" in st["triton-step"].reason


def test_config_accepts_it_and_rejects_a_misspelling():
    assert MonoConfig.from_dict({"backend": "triton-step"}).backend == "triton-step"
    with pytest.raises(ConfigError) as e:
        MonoConfig.from_dict({"backend": "triton_step"})
    msg = str(e.value)
    assert "\n" not in msg and "must be one of auto, flydsl, triton, triton-step, reference, got 'triton_step'" in msg


def test_helm_schema_enumerates_it():
    schema = json.loads((Path(__file__).parents[2] / "helm/vllm-monodecode/values.schema.json").read_text())
    assert "triton-step" in schema["properties"]["monodecode"]["properties"]["backend"]["enum"]


# ---- the callers' dispatch to a whole-step launch -----------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    dims = profile_dims("tiny")
    return dims, random_weights(dims, seed=0)


def _kernels(cls_name, tiny):
    import fake_backends

    dims, weights = tiny
    return getattr(fake_backends, cls_name)(BuildRequest(dims, "bf16", 1, (1, 2), 16, CPU), weights)


def _inputs(tiny):
    dims, weights = tiny
    alloc = BlockAllocator(8, 16)
    alloc.append_slots(0, 20)
    alloc.append_slots(1, 5)
    meta = alloc.decode_metadata([0, 1])
    kv = PagedKVCache.allocate(dims, 8, 16)
    gen = torch.Generator().manual_seed(1)
    for t in kv.key + kv.value:
        t.copy_(torch.randn(t.shape, generator=gen))
    x = (torch.randn(2, dims.hidden_size, generator=gen) * 0.1).to(torch.bfloat16)
    return x, [meta] * dims.num_layers, kv


def _copy(kv):
    return PagedKVCache(key=[t.clone() for t in kv.key], value=[t.clone() for t in kv.value], block_size=kv.block_size)


def test_default_forward_step_is_none(tiny):
    k = _kernels("StepReference", tiny)
    x, metas, kv = _inputs(tiny)
    assert DecodeKernels.forward_step(k, x, metas, kv) is None


def test_run_kernel_layers_takes_one_forward_step(tiny):
    dims, weights = tiny
    k = _kernels("StepReference", tiny)
    x, metas, kv = _inputs(tiny)
    kv_ref = _copy(kv)
    out = run_kernel_layers(k.forward_layer, x, metas, kv, forward_step=k.forward_step)
    assert k.calls == {"forward_layer": 0, "forward_step": 1}
    assert torch.equal(out, run_layers(weights, x, metas[0], kv_ref))
    run_kernel_layers(k.forward_layer, x, metas, kv, count=dims.num_layers, forward_step=k.forward_step)
    assert k.calls == {"forward_layer": 0, "forward_step": 2}


def test_run_kernel_layers_runs_layers_where_a_step_launch_does_not_fit(tiny):
    dims, weights = tiny
    k = _kernels("StepReference", tiny)
    x, metas, kv = _inputs(tiny)
    # fewer layers than the step
    run_kernel_layers(k.forward_layer, x, metas, kv, count=1, forward_step=k.forward_step)
    assert k.calls == {"forward_layer": 1, "forward_step": 0}
    # no forward_step given: per layer, as before
    run_kernel_layers(k.forward_layer, x, metas, kv)
    assert k.calls == {"forward_layer": 1 + dims.num_layers, "forward_step": 0}

    # staged per layer (vLLM's CPU platform): per layer
    class Staged:
        def __init__(self):
            self.metas = metas
            self.log = []

        def stage(self, layer, n):
            self.log.append(("stage", layer))
            return kv

        def commit(self, layer, layer_kv):
            self.log.append(("commit", layer))

    staged = Staged()
    run_kernel_layers(k.forward_layer, x, metas, None, staged, forward_step=k.forward_step)
    assert k.calls == {"forward_layer": 1 + 2 * dims.num_layers, "forward_step": 0}
    assert len(staged.log) == 2 * dims.num_layers


def test_run_kernel_layers_falls_back_when_forward_step_returns_none(tiny):
    dims, weights = tiny
    k = _kernels("NoStepReference", tiny)
    x, metas, kv = _inputs(tiny)
    kv_ref = _copy(kv)
    out = run_kernel_layers(k.forward_layer, x, metas, kv, forward_step=k.forward_step)
    assert k.calls == {"forward_layer": dims.num_layers, "forward_step": 1}
    ref = run_layers(weights, x, metas[0], kv_ref, layer_fn=_kernels("StepReference", tiny).forward_layer)
    assert torch.equal(out, ref)
