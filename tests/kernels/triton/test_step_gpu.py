"""GPU numerics and behaviour of the step launch (``kernels/triton/step_launch.py``, ``StepKernels``:
one persistent Gluon launch runs a range of decoder layers) against the reference decode.

Marked ``gpu``: skipped with a printed reason where torch sees no CUDA GPU of sm_90 or newer (CI,
this project's CPU machines, AMD). On an H100/H200: ``PYTHONPATH=. python -m pytest -x
tests/kernels/triton/test_step_gpu.py`` (``benchmarks/device_run.sh tests`` runs it). ``step_launch``
is imported only once a GPU is there, so the module collects on any machine.

Tolerances are the Triton kernels' (``test_triton_numerics.py``): per layer (``forward_layer``, fed
the reference's input each layer) ||out - ref|| / ||ref|| <= 1e-2 and max |out - ref| <= 3 % of
max |ref|, the K/V a layer writes at the slot mapping to the same bound; the whole stack
(``forward_step``, every layer in one launch) <= 5e-2, its K/V of the first layer to the per-layer
bound (they depend on the step's input only) and of every later layer to the whole-stack bound.
Every K/V entry outside the slot mapping stays bit for bit what it was.
"""

from __future__ import annotations

import dataclasses
import time
import zlib

import pytest
import torch
from test_triton_numerics import BLOCK, MAX_FRAC, REL_FRO, STACK_REL_FRO, _close, _context

from monodecode.kernels.base import BuildRequest
from monodecode.kernels.health import decode_health
from monodecode.model import reference as R
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights
from monodecode.runtime.width_policy import capture_graph

pytestmark = pytest.mark.gpu

# (profile, widths, layers built): Llama-3-1B's layers at every width the step launch serves
# above 1 row, and Llama-3-8B's at widths 1, 2 and 8 (above 1 row its down's input streams:
# StepGeometry.streams_down)
B1 = ("llama3-1b", (1, 2, 4, 8), 4)
B8 = ("llama3-8b", (1, 2, 8), 2)
# FP8 (e4m3fn weights, per-row scales): 8B at widths 1, 2 and 8, 1B at 1 and 8 (its own ring plan)
B8F = ("llama3-8b", (1, 2, 8), 2, 2.0, None, "fp8")
B1F = ("llama3-1b", (1, 8), 2, 2.0, None, "fp8")
# Gemma-3-27B at width 1 (q/k-norm, post norms, (1 + w) norms, GELU-tanh; hidden 5376, no
# multiple of 1024; o_proj's K 4096): layer 0 slides (window 1024), layer 1 is made a full one
G27 = ("gemma3-27b-sf", (1,), 2)
FAULT_TIMEOUT_S = 0.05  # the fault drills' bound on every in-kernel wait

# each row's context (seq_lens: the new token included); fewer rows than a width run padded to it
CONTEXTS = {
    "w1": [3000],
    "w1-first-token": [1],
    "w1-700": [700],  # 6 of each KV head's 16 splits read positions, the other 10 none
    "w2": [1, 700],
    "w4-3rows": [17, 3000, 1],
    "w4": [700, 1, 3000, 17],
    "w8-5rows": [3000, 17, 1, 700, 2048],
    "w8": [1, 17, 700, 3000, 16, 1025, 33, 2048],
}


def _dims(profile: str):
    """A profile's dims; ``gemma3-27b-sf``: Gemma-3-27B's with layer 1 a full-attention layer (the
    model's sixth), so that two built layers hold a sliding and a full one."""
    if profile == "gemma3-27b-sf":
        d = profile_dims("gemma3-27b")
        types = list(d.layer_types)
        types[1] = "full"
        assert d.is_sliding(0) and types[1] != types[0]
        return dataclasses.replace(d, layer_types=tuple(types))
    return profile_dims(profile)


def _gpu() -> torch.device:
    if not torch.cuda.is_available() or torch.version.hip:
        pytest.skip("no CUDA GPU visible to torch: the step launch runs on NVIDIA sm_90+ (H100/H200 run these)")
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        pytest.skip(f"the step launch needs sm_90 or newer; this GPU is sm_{major}{minor}")
    return torch.device("cuda")


_CACHE: dict = {}


def _request(profile: str, widths, wait_timeout_s: float, weight_dtype: str = "bf16") -> BuildRequest:
    from monodecode.services.platform import detect_platform

    return BuildRequest(
        dims=_dims(profile),
        weight_dtype=weight_dtype,
        tp_size=1,
        widths=tuple(widths),
        block_size=BLOCK,
        platform=detect_platform(),
        wait_timeout_s=wait_timeout_s,
    )


def _build(
    profile: str, widths, layers: int, wait_timeout_s: float = 2.0, plan: dict | None = None, weight_dtype="bf16"
):
    """(dims, weights, StepKernels) of one build (cached per session; a fault drill's build has
    its own short wait bound but the same weights and compiled kernels; ``plan``: the plan's
    knobs, ``step_plan.PLAN_KNOBS``)."""
    key = (profile, tuple(widths), layers, wait_timeout_s, repr(sorted((plan or {}).items())), weight_dtype)
    if key in _CACHE:
        return _CACHE[key]
    from monodecode.kernels.triton.step_launch import StepKernels
    from monodecode.kernels.triton.step_plan import step_refusals

    dev = _gpu()
    dims = _dims(profile)
    assert step_refusals(dims, weight_dtype, 1, tuple(widths)) == [], "a build these tests time is refused"
    weights = _weights(profile, layers, weight_dtype)
    req = _request(profile, widths, wait_timeout_s, weight_dtype)
    tk = StepKernels(req, weights, req.platform.compute_units, dev, plan=plan)
    assert tuple(tk.widths) == tuple(widths)
    _CACHE[key] = (dims, weights, tk)
    return _CACHE[key]


def _weights(profile: str, layers: int, weight_dtype: str = "bf16"):
    key = ("weights", profile, layers, weight_dtype)
    if key not in _CACHE:
        seed = zlib.crc32(repr(key[:3]).encode()) % 1000
        _CACHE[key] = random_weights(
            _dims(profile), seed=seed, weight_dtype=weight_dtype, device=_gpu(), num_layers=layers
        )
    return _CACHE[key]


def _input(dims, rows: int, seed: int) -> torch.Tensor:
    dev = _gpu()
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(rows, dims.hidden_size, generator=g, device=dev).to(torch.bfloat16)


def _check_kv(dims, l: int, meta, kv_ref, kv_before, kv_out, what: str, rel: float, frac: float | None):
    """Layer ``l``'s new K/V entries (at the slot mapping) within (rel, frac) of the reference's;
    every other entry bit for bit as it was (inert padded rows write nothing)."""
    slots = meta.slot_mapping
    for name, c_ref, c_before, c_out in (
        ("K", kv_ref.key[l], kv_before.key[l], kv_out.key[l]),
        ("V", kv_ref.value[l], kv_before.value[l], kv_out.value[l]),
    ):
        flat_r = c_ref.view(-1, dims.num_kv_heads, dims.head_dim)
        flat_o = c_out.view(-1, dims.num_kv_heads, dims.head_dim)
        _close(flat_o[slots], flat_r[slots], f"{what}: layer {l} new {name} entries", rel=rel, frac=frac)
        rest = flat_o.clone()
        rest[slots] = c_before.view(-1, dims.num_kv_heads, dims.head_dim)[slots]
        assert torch.equal(rest, c_before.view_as(rest)), (
            f"{what}: layer {l} {name} entries outside the new slots changed"
        )


def _snapshot(kv):
    from monodecode.model.paged_kv import PagedKVCache

    return PagedKVCache([k.clone() for k in kv.key], [v.clone() for v in kv.value], kv.block_size)


def _setup(build, ctx: list[int], seed: int):
    """The build, both caches filled with ``ctx``'s contexts, a snapshot of the kernels' cache,
    the step's metadata and input rows."""
    dims, weights, tk = _build(*build)
    dev = _gpu()
    alloc, kv_ref, kv_out = _context(dims, build[2], ctx, dev, seed=seed)
    meta = alloc.decode_metadata(list(range(len(ctx))), device=dev)
    return dims, weights, tk, kv_ref, kv_out, _snapshot(kv_out), meta, _input(dims, len(ctx), seed)


def _layer_by_layer(build, ctx: list[int], seed: int, what: str) -> None:
    dims, weights, tk, kv_ref, kv_out, before, meta, x = _setup(build, ctx, seed)
    rows, layers = len(ctx), build[2]
    for l in range(layers):
        y_ref = R.decode_layer(dims, l, weights.layers[l], x, meta, kv_ref)
        y = tk.forward_layer(l, x, meta, kv_out)
        assert y.shape == (rows, dims.hidden_size) and y.dtype == torch.bfloat16
        _close(y, y_ref, f"{what} layer {l} output")
        _check_kv(dims, l, meta, kv_ref, before, kv_out, what, rel=REL_FRO, frac=MAX_FRAC)
        x = y_ref
    assert tk.health() == 0, decode_health(tk.health())


def _whole_step(build, ctx: list[int], seed: int, what: str) -> None:
    dims, weights, tk, kv_ref, kv_out, before, meta, x = _setup(build, ctx, seed)
    rows, layers = len(ctx), build[2]
    h_ref = R.run_layers(weights, x, meta, kv_ref)
    h = tk.forward_step(x, [meta] * layers, kv_out)
    assert h is not None, "forward_step declined one metadata shared by every layer"
    assert h.shape == (rows, dims.hidden_size) and h.dtype == torch.bfloat16
    _close(h, h_ref, f"{what} whole step", rel=STACK_REL_FRO, frac=None)
    for l in range(layers):
        first = l == 0  # its K/V depend on the step's input only
        _check_kv(
            dims,
            l,
            meta,
            kv_ref,
            before,
            kv_out,
            what,
            rel=REL_FRO if first else STACK_REL_FRO,
            frac=MAX_FRAC if first else None,
        )
    assert tk.health() == 0, decode_health(tk.health())


@pytest.mark.parametrize("case", ["w1", "w4-3rows"])
def test_each_stage_of_a_layer_matches_the_reference(case):
    """Where a layer goes wrong, stage by stage: after one ``forward_layer`` launch, the kernel's
    own activations of that layer (``_Buffers.act``: q/k/v before RoPE, the merged attention
    output, h1 = x + o_proj, SiLU(g)·u) against the reference's intermediates of the same input,
    each within the per-layer bound. Runs first in the file (``-x`` stops at the stage that is
    wrong, before the end-to-end tests say only that the output is)."""
    import torch.nn.functional as F

    dims, weights, tk, kv_ref, kv_out, before, meta, x = _setup(B1, CONTEXTS[case], 40)
    rows, lw, eps = len(CONTEXTS[case]), weights.layers[0], dims.rms_norm_eps
    tk.forward_layer(0, x, meta, kv_out)
    torch.cuda.synchronize()
    width = min(w for w in tk.widths if w >= rows)
    a = tk.geometry[width].act_offsets
    act = tk._buffers_for(width, 1).act.view(width, a["end"])[:rows]
    h = R.rms_norm(x, lw.attn_norm, eps, False)
    q, k, v = lw.q_proj(h), lw.k_proj(h), lw.v_proj(h)
    _close(act[:, : a["att"]], torch.cat([q, k, v], dim=1), f"{case}: q/k/v before RoPE")
    att = R.k1_reference(dims, 0, lw, x, meta, kv_ref)
    live = meta.slot_mapping >= 0
    _close(act[live, a["att"] : a["h1"]], att[live], f"{case}: merged attention output")
    h1 = (x.float() + lw.o_proj(att).float()).to(x.dtype)
    _close(act[:, a["h1"] : a["gu"]], h1, f"{case}: h1 = x + o_proj")
    hn = R.rms_norm(h1, lw.mlp_norm, eps, False)
    gu = (F.silu(lw.gate_proj(hn).float()).to(x.dtype).float() * lw.up_proj(hn).float()).to(x.dtype)
    _close(act[:, a["gu"] : a["gu"] + dims.intermediate_size], gu, f"{case}: SiLU(g)·u")
    assert tk.health() == 0, decode_health(tk.health())


def test_each_stage_of_a_gemma3_layer_matches_the_reference():
    """Gemma-3-27B's sliding layer 0 at width 1 over 3000 positions (its window sees the last
    1024), stage by stage as the test above: q/k/v before q/k-norm and RoPE, the merged attention
    output, o_proj's raw sums, h1 = x + post-norm(o) (each program wrote its own rows of it), the
    GELU-tanh(g)·u, down's raw sums; then the layer's output (down's post norm and residual, the
    launch's last stage) within the per-layer bound."""
    import torch.nn.functional as F

    dims, weights, tk, kv_ref, kv_out, before, meta, x = _setup(G27, CONTEXTS["w1"], 41)
    lw, eps, h = weights.layers[0], dims.rms_norm_eps, dims.hidden_size
    y = tk.forward_layer(0, x, meta, kv_out)
    torch.cuda.synchronize()
    a = tk.geometry[1].act_offsets
    act = tk._buffers_for(1, 1).act.view(1, a["end"])
    hn = R.rms_norm(x, lw.attn_norm, eps, True)
    _close(act[:, : a["att"]], torch.cat([lw.q_proj(hn), lw.k_proj(hn), lw.v_proj(hn)], dim=1), "gemma: q/k/v")
    att = R.k1_reference(dims, 0, lw, x, meta, kv_ref)
    _close(act[:, a["att"] : a["h1"]], att, "gemma: merged attention output (q/k-normed, windowed)")
    o = lw.o_proj(att)
    _close(act[:, a["o"] : a["o"] + h], o, "gemma: o_proj's raw sums")
    h1 = (x.float() + R.rms_norm(o, lw.attn_post_norm, eps, True).float()).to(x.dtype)
    _close(act[:, a["h1"] : a["gu"]], h1, "gemma: h1 = x + post-norm(o)")
    m = R.rms_norm(h1, lw.mlp_norm, eps, True)
    g = F.gelu(lw.gate_proj(m).float(), approximate="tanh").to(x.dtype)
    gu = (g.float() * lw.up_proj(m).float()).to(x.dtype)
    _close(act[:, a["gu"] : a["o"]], gu, "gemma: GELU-tanh(g)·u")
    _close(act[:, a["dn"] : a["dn"] + h], lw.down_proj(gu), "gemma: down's raw sums")
    _close(y, R.k2_reference(dims, 0, lw, x, att), "gemma: layer 0's output")
    _check_kv(dims, 0, meta, kv_ref, before, kv_out, "gemma stages", rel=REL_FRO, frac=MAX_FRAC)
    assert tk.health() == 0, decode_health(tk.health())


@pytest.mark.parametrize("case", ["w1", "w1-first-token", "w1-700"])
def test_gemma3_27b_at_width_1(case):
    """Gemma-3-27B's sliding and full layers at width 1 (``StepGeometry.gemma``), contexts past
    the window (3000), inside it (700) and the first token: per layer and as one launch over both
    layers within the bounds, nothing written outside the slots."""
    ctx = CONTEXTS[case]
    _layer_by_layer(G27, ctx, seed=150 + len(ctx), what=f"27B {case}")
    _whole_step(G27, ctx, seed=160 + len(ctx), what=f"27B {case} step")
    torch.cuda.empty_cache()


@pytest.mark.parametrize("case", list(CONTEXTS))
def test_forward_layer_matches_reference_llama3_1b(case):
    """One launch a layer (``forward_layer``) at widths 1-8, rows of different contexts over
    shuffled 16-token blocks, fewer rows than the width (inert padded rows): each layer's output
    and the K/V it writes at the slot mapping within the per-layer bounds, nothing else written."""
    _layer_by_layer(B1, CONTEXTS[case], seed=len(CONTEXTS[case]) + 10, what=f"1B {case}")


@pytest.mark.parametrize("case", list(CONTEXTS))
def test_forward_step_matches_reference_llama3_1b(case):
    """Every layer in one launch (``forward_step``), the same cases: the step's output within the
    whole-stack bound, each layer's new K/V within its bound, nothing else written."""
    _whole_step(B1, CONTEXTS[case], seed=len(CONTEXTS[case]) + 20, what=f"1B {case} step")


@pytest.mark.parametrize("case", ["w1-first-token", "w1-700", "w1", "w2", "w8-5rows"])
def test_llama3_8b(case):
    """Llama-3-8B's layers (14336-wide MLP, 128-wide heads, groups of 4; two down tiles a program,
    whose input streams above 1 row): per layer and as one launch over both layers."""
    ctx = CONTEXTS[case]
    _layer_by_layer(B8, ctx, seed=30 + len(ctx), what=f"8B {case}")
    _whole_step(B8, ctx, seed=40 + len(ctx), what=f"8B {case} step")


@pytest.mark.parametrize("case", ["w1-first-token", "w1", "w2", "w8-5rows"])
def test_llama3_8b_fp8(case):
    """Llama-3-8B with FP8 weights (e4m3fn, each row's scale applied to its sum): the ring
    streams e4m3, width 1 widens them in registers, widths 2-8 before mma.sync; against the
    reference's FP8 ``Linear`` (fp32 sums of x · q, then the scale), per layer and as one launch."""
    ctx = CONTEXTS[case]
    _layer_by_layer(B8F, ctx, seed=90 + len(ctx), what=f"8B fp8 {case}")
    _whole_step(B8F, ctx, seed=100 + len(ctx), what=f"8B fp8 {case} step")


@pytest.mark.parametrize("case", ["w1", "w8"])
def test_llama3_1b_fp8(case):
    """Llama-3-1B with FP8 weights at widths 1 and 8 (one down tile a program; its own ring depth)."""
    ctx = CONTEXTS[case]
    _layer_by_layer(B1F, ctx, seed=110 + len(ctx), what=f"1B fp8 {case}")
    _whole_step(B1F, ctx, seed=120 + len(ctx), what=f"1B fp8 {case} step")


@pytest.mark.parametrize("case", ["w1", "w1-700"])
def test_width_1_on_mma_matches_the_reference(case):
    """``mma1`` (``step_plan.PLAN_KNOBS``): width 1's products on mma.sync, its row padded to 8
    columns as widths 2-8's, for bf16 (1B) and FP8 (8B): per layer and as one launch within the bounds."""
    for build in (("llama3-1b", (1,), 2, 2.0, {"mma1": 1}), ("llama3-8b", (1,), 2, 2.0, {"mma1": 1}, "fp8")):
        _layer_by_layer(build, CONTEXTS[case], seed=130, what=f"{build[0]} mma1 {case}")
        _whole_step(build, CONTEXTS[case], seed=140, what=f"{build[0]} mma1 {case} step")


@pytest.mark.parametrize("case", ["w1", "w8"])
def test_long_context_32k(case):
    """Rows of 32768 positions (width 1; width 8 beside shorter rows, so each row's context
    splits differ): per layer and whole step within the bounds."""
    ctx = [32768] if case == "w1" else [32768, 17, 32768, 3000, 1, 20000, 32768, 700]
    _layer_by_layer(B1, ctx, seed=50 + len(ctx), what=f"1B 32k {case}")
    torch.cuda.empty_cache()
    _whole_step(B1, ctx, seed=60 + len(ctx), what=f"1B 32k {case} step")
    torch.cuda.empty_cache()


@pytest.mark.parametrize("case", ["w1", "w2", "w8-5rows", "32k-w8"])
def test_attention_stepping_32_positions_a_warp_matches_the_reference(case):
    """``kv_step`` 2 (``step_plan.PLAN_KNOBS``: each warp's attention step reads 32 positions, a
    K/V ring of two 64 KiB slots beside a 3-slot weight ring; 1B's 64-wide heads only): per layer
    and as one launch within the bounds, rows of contexts that end mid-step included."""
    build = (*B1, 2.0, {"kv_step": 2})
    ctx = CONTEXTS.get(case, [32768, 17, 32768, 3000, 1, 20000, 32768, 700])
    _layer_by_layer(build, ctx, seed=70 + len(ctx), what=f"1B kv_step 2 {case}")
    _whole_step(build, ctx, seed=80 + len(ctx), what=f"1B kv_step 2 {case} step")
    torch.cuda.empty_cache()


# the ``one_sum`` 0 builds (the norms summed chunk by chunk): 1B at widths 1 and 8, 8B at 1, 2
# and 8, FP8 8B at 1 and 8, 27B at 1
ONE_SUM = {"one_sum": 0}
B1S = ("llama3-1b", (1, 8), 2, 2.0, ONE_SUM)
B8S = ("llama3-8b", (1, 2, 8), 2, 2.0, ONE_SUM)
B8FS = ("llama3-8b", (1, 8), 2, 2.0, ONE_SUM, "fp8")
G27S = ("gemma3-27b-sf", (1,), 2, 2.0, ONE_SUM)


@pytest.mark.parametrize(
    ("build", "case"),
    [(B1S, "w1"), (B1S, "w8"), (B8S, "w1"), (B8S, "w2"), (B8S, "w8-5rows"), (B8FS, "w1"), (B8FS, "w8-5rows"),
     (G27S, "w1")],
    ids=["1b-w1", "1b-w8", "8b-w1", "8b-w2", "8b-w8-5rows", "8b-fp8-w1", "8b-fp8-w8-5rows", "gemma-27b-w1"],
)  # fmt: skip
def test_norms_summed_chunk_by_chunk_match_the_reference(build, case):
    """``one_sum`` 0 (``step_plan.PLAN_KNOBS``: every staged norm, Gemma's post norms too,
    reduces each chunk's squares across the block, where the default adds them over the row's
    chunks and reduces once: a different order of the same fp32 sum): per layer and as one
    launch within the bounds, at widths 1, 2 and 8."""
    what = f"{build[0]} {build[-1] if len(build) > 5 else 'bf16'} one_sum 0 {case}"
    _layer_by_layer(build, CONTEXTS[case], seed=150, what=what)
    _whole_step(build, CONTEXTS[case], seed=160, what=f"{what} step")


@pytest.mark.parametrize("case", ["w1", "w2", "w8-5rows"])
def test_a_grid_of_fewer_programs_matches_the_reference(case):
    """``grid`` 128 (``step_plan.PLAN_KNOBS``: 128 programs launched, not one an SM, so each of 8B's
    stages divides evenly over them): per layer and as one launch within the bounds."""
    build = ("llama3-8b", (1, 2, 8), 2, 2.0, {"grid": 128})
    _layer_by_layer(build, CONTEXTS[case], seed=170, what=f"8B grid 128 {case}")
    _whole_step(build, CONTEXTS[case], seed=180, what=f"8B grid 128 {case} step")


@pytest.mark.parametrize(
    ("build", "case"),
    [(B1, "w1"), (B1, "w4-3rows"), (B1, "w8"), (B8F, "w1"), (B8F, "w8-5rows"), (G27, "w1")],
    ids=["1b-w1", "1b-w4-3rows", "1b-w8", "8b-fp8-w1", "8b-fp8-w8-5rows", "gemma-27b-w1"],
)
def test_graph_of_forward_step_replays_bit_identical(build, case):
    """``forward_step`` captured in a CUDA graph (as the runner and the benchmark replay it) and
    replayed twice over the same inputs: the outputs and every K/V entry are bit for bit the same
    after each replay (nothing in the launch depends on state a replay leaves behind), and the
    replayed step is the reference's within the whole-stack bound."""
    dims, weights, tk = _build(*build)
    dev = _gpu()
    layers = build[2]
    ctx = CONTEXTS[case]
    rows = len(ctx)
    alloc, kv_ref, kv_out = _context(dims, layers, ctx, dev, seed=70 + rows)
    meta = alloc.decode_metadata(list(range(rows)), device=dev)
    x = _input(dims, rows, 70 + rows)
    metas = [meta] * layers
    graph, out = capture_graph(lambda: tk.forward_step(x, metas, kv_out))
    graph.replay()
    torch.cuda.synchronize()
    first, kv_first = out.clone(), _snapshot(kv_out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), first.view(torch.int16)), "the second replay's output differs"
    for a, b in zip(kv_out.key + kv_out.value, kv_first.key + kv_first.value):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "the second replay's K/V differ"
    assert tk.health() == 0, decode_health(tk.health())
    h_ref = R.run_layers(weights, x, meta, kv_ref)
    _close(first, h_ref, f"{build[0]} {case} replayed step vs reference", rel=STACK_REL_FRO, frac=None)


@pytest.mark.parametrize("build", [B1, G27], ids=["1b", "gemma-27b"])
@pytest.mark.parametrize("entry", ["forward_step", "forward_layer"])
@pytest.mark.parametrize("kind,site", [("stall", "wait_timeout"), ("nonfinite", "nonfinite")])
def test_faults_set_the_health_word_and_the_launch_returns(kind, site, entry, build):
    """A stall (layer 1's results never published: every wait on them is bounded) and a NaN in
    layer 1's output each set the sticky health word naming the site and layer 1 (the first
    failure: the NaN reaches layers 2 and 3 too, and the runner reports the cause, not where it
    spread), and the launch returns in bounded time with the GPU usable; a healthy step leaves
    the word as it is; ``reset_health`` clears it and a healthy step after that sets nothing
    (the failed launch left its counters consistent). Gemma-3 (2 layers, width 1): its NaN is
    found where down's sums join the residual, the launch's last stage for layer 1."""
    from monodecode.services.faults import Fault

    dims, weights, tk = _build(build[0], build[1], build[2], wait_timeout_s=FAULT_TIMEOUT_S)
    dev = _gpu()
    layers = build[2]
    ctx = CONTEXTS["w2" if max(build[1]) > 1 else "w1"]
    alloc, _, kv = _context(dims, layers, ctx, dev, seed=80)
    meta = alloc.decode_metadata(list(range(len(ctx))), device=dev)
    x = _input(dims, len(ctx), 80)

    def step():
        if entry == "forward_step":
            return tk.forward_step(x, [meta] * layers, kv)
        return R.run_layers(weights, x, meta, kv, layer_fn=tk.forward_layer)

    tk.reset_health()
    assert tk.health() == 0
    assert tk.arm_fault(Fault(kind=kind, layer=1)), f"{kind} could not be armed"
    t0 = time.monotonic()
    out = step()
    torch.cuda.synchronize()  # the launch returned: no hang, no sticky CUDA error
    elapsed = time.monotonic() - t0
    assert out.shape == (len(ctx), dims.hidden_size)
    code = tk.health()
    fault = decode_health(code)
    assert fault is not None and (fault.site, fault.layer) == (site, 1), fault
    assert elapsed < 30, f"a faulted step took {elapsed:.1f}s (waits must be bounded)"
    step()
    torch.cuda.synchronize()
    assert tk.health() == code, "a healthy step changed the sticky health word"
    tk.reset_health()
    assert tk.health() == 0
    step()
    torch.cuda.synchronize()
    assert tk.health() == 0, f"a healthy step after reset_health set {decode_health(tk.health())}"


def test_backend_builds_the_step_launch_and_refuses_what_it_cannot_serve():
    """``triton-step`` (``TritonStepBackend``) builds these tests' kernels on this GPU (1B widths
    1-8) and refuses 16 rows (mma.sync's 8 columns)."""
    _gpu()
    from monodecode.errors import RefusalError
    from monodecode.kernels.base import DecodeKernels
    from monodecode.kernels.triton.step_backend import TritonStepBackend

    weights = _weights(B1[0], B1[2])
    tk = TritonStepBackend().build(_request(B1[0], B1[1], 2.0), weights, None, allow_jit=True)
    try:
        assert isinstance(tk, DecodeKernels) and tuple(tk.widths) == B1[1]
    finally:
        tk.close()
    with pytest.raises(RefusalError, match="1-8 rows"):
        TritonStepBackend().build(_request(B1[0], (1, 16), 2.0), weights, None, allow_jit=True)


def test_timeline_stamps_every_stage_in_order_and_leave_the_step_bit_identical():
    """With the benchmark's stage stamps on (``enable_timeline``), the step's output and K/V are bit
    for bit the plain build's, and every program stamped QKV, attention, o_proj, gate/up and down
    of every layer in order (entry <= input ready <= part counted), each attention task its q, k
    and v in and its partial stored between its wait and its heads merged; off again, no stamps
    are written."""
    dims, weights, tk, _, kv, before, meta, x = _setup(B1, CONTEXTS["w4"], seed=13)
    layers = B1[2]
    kv2 = _snapshot(before)
    h = tk.forward_step(x, [meta] * layers, kv)
    tk.enable_timeline(layers)
    try:
        h2 = tk.forward_step(x, [meta] * layers, kv2)
        torch.cuda.synchronize()
        st = tk.timeline(layers, x.shape[0])
    finally:
        tk.enable_timeline(layers, on=False)
    assert torch.equal(h, h2), "the stamped step's output differs from the plain build's"
    for l in range(layers):
        assert torch.equal(kv.key[l], kv2.key[l]) and torch.equal(kv.value[l], kv2.value[l])
    for half, stage in ((0, 0), (0, 1), (1, 0), (1, 2), (1, 3)):
        s = st[:, half, :, stage, :3]
        assert (s > 0).all(), f"slot ({half}, {stage}) unstamped"
        assert (s[..., 0] <= s[..., 1]).all() and (s[..., 1] <= s[..., 2]).all(), f"slot ({half}, {stage}) out of order"
    # each attention task's q, k and v in (``timeline.STEP.q_in``) and partial stored (``.part``),
    # in order between its wait and its heads merged; the programs past the tasks (the grid's last)
    # stamp neither
    part, q_in = st[:, 0, :, 1, 3], st[:, 0, :, 2, 0]
    tasks = int((part[0] > 0).sum())
    assert 0 < tasks < part.shape[1] and (part[:, :tasks] > 0).all() and (part[:, tasks:] == 0).all()
    assert (q_in[:, :tasks] > 0).all() and (q_in[:, tasks:] == 0).all()
    att = st[:, 0, :tasks, 1]
    assert (att[..., 1] <= q_in[:, :tasks]).all() and (q_in[:, :tasks] <= att[..., 3]).all(), "q_in stamp out of order"
    assert (att[..., 3] <= att[..., 2]).all(), "partial stamp out of order"
    assert (st[:, 0, :, 2, 1:] == 0).all() and (st[:, 1, :, 1] == 0).all()  # the slots the step leaves unnamed
    assert tk.prof.numel() == 1 and tk.health() == 0, decode_health(tk.health())


def _vllm_layout(kv):
    """``kv``'s contents in vLLM's interleaved K|V layout ([blocks, KV heads, block, K | V] a layer,
    one allocation), through the plugin's views (``vllm_plugin.step.kv_views``)."""
    from monodecode.vllm_plugin.step import kv_views

    blocks, bs, heads, dim = kv.key[0].shape
    raw = torch.empty(len(kv.key), blocks, heads, bs, 2 * dim, dtype=kv.key[0].dtype, device=kv.key[0].device)
    out = kv_views(list(raw.unbind(0)), heads, dim)
    for l in range(len(kv.key)):
        out.key[l].copy_(kv.key[l])
        out.value[l].copy_(kv.value[l])
    return out


def _behind_a_null_block(kv, meta):
    """``kv``'s blocks one block later and ``meta`` re-pointed at them, so that block 0 is owned by
    no row, as vLLM's null block is: each row's blocks move up one, the tables' padding past them
    stays 0 (a masked block-table entry reads block 0 too)."""
    from monodecode.model.paged_kv import DecodeMetadata, PagedKVCache

    pad = lambda t: torch.cat([torch.zeros_like(t[:1]), t])  # noqa: E731
    moved = PagedKVCache([pad(k) for k in kv.key], [pad(v) for v in kv.value], kv.block_size)
    slots = torch.where(meta.slot_mapping >= 0, meta.slot_mapping + kv.block_size, meta.slot_mapping)
    owned = (meta.seq_lens.long() + kv.block_size - 1) // kv.block_size  # the new position's block too
    cols = torch.arange(meta.block_tables.shape[1], device=meta.block_tables.device)
    tables = torch.where(cols[None, :] < owned[:, None], meta.block_tables + 1, 0).to(meta.block_tables.dtype)
    return moved, DecodeMetadata(meta.positions, slots, tables, meta.seq_lens)


@pytest.mark.parametrize(("build", "case", "vllm_layout"), [(B1, "w8-5rows", False), (B1, "w1", True),
                                                            (B8, "w2", True), (B8, "w8-5rows", False)])  # fmt: skip
def test_slots_no_row_has_cached_never_reach_a_sum(build, case, vllm_layout):
    """The attention reads whole tiles of 16 positions a warp, so a tile that ends past a row's
    context spans the later slots of its last block, and the warps past it read block 0: their
    K and V are masked as they are copied. With NaN in every slot no row has cached (block 0,
    owned by no row as vLLM's null block is, and whatever a finished sequence left in a block),
    the step's output is bit for bit the clean cache's, over the reference's cache planes and
    vLLM's interleaved K|V layout."""
    from monodecode.model.paged_kv import poison_uncached

    dims, weights, tk, _, kv, before, meta, x = _setup(build, CONTEXTS[case], seed=17)
    before, meta = _behind_a_null_block(before, meta)
    clean = _vllm_layout(before) if vllm_layout else _snapshot(before)
    poisoned = _vllm_layout(before) if vllm_layout else _snapshot(before)
    poison_uncached(poisoned, meta)
    assert torch.isnan(poisoned.value[0][0]).all()
    h = tk.forward_step(x, [meta] * build[2], clean)
    h2 = tk.forward_step(x, [meta] * build[2], poisoned)
    torch.cuda.synchronize()
    assert torch.isfinite(h2).all(), "a slot no row has cached reached the step's sums"
    assert torch.equal(h, h2), "the step's output depends on slots no row has cached"
    assert tk.health() == 0, decode_health(tk.health())


# (plan, widths built, context): each knob at the widths it changes (B8: 8B's own build)
PLAN_CASES = [
    ({"ring": 4}, (1,), "w1"), ({"ring": 2}, (1, 8), "w1"), ({"ring": 2}, (1, 8), "w8-5rows"),
    ({"stream_down": 0}, (1, 8), "w8-5rows"), ({"stream_down": 0}, (1, 2), "w2"),
    ({"wide_tma": 0}, (1, 8), "w8-5rows"), ({"wide_tma": 1}, B8, "w8-5rows"), ({"wide_tma": 1}, B8, "w2"),
    ({"early_down": 0}, (1, 8), "w8-5rows"), ({"early_down": 0}, B8, "w8-5rows"), ({"early_down": 0}, B8, "w1"),
    ({"stream_down": 0, "early_down": 0}, (1, 2), "w2"),
    ({"span": 1}, B8F, "w1"), ({"span": 1}, B8F, "w8-5rows"), ({"span": 2}, (1, 2), "w2"),
    ({"one_box": 0}, B8F, "w1"),
    ({"att_pad": 0}, (1, 2), "w1"), ({"att_pad": 1}, (1, 2), "w2"), ({"att_pad": 0}, B8, "w1"),
]  # fmt: skip


def _plan_case_id(plan: dict, widths, case: str) -> str:
    """``ring4-w1``, ``wide_tma1-w2-8b``: selectable with ``-k`` by knob, context and build."""
    knobs = "-".join(f"{k}{v}" for k, v in plan.items())
    return f"{knobs}-{case}" + {B8: "-8b", B8F: "-8b-fp8"}.get(widths, "")


@pytest.mark.parametrize(("plan", "widths", "case"), PLAN_CASES, ids=[_plan_case_id(*c) for c in PLAN_CASES])
def test_plan_knobs_leave_the_step_bit_identical(plan, widths, case):
    """The plan's knobs (``step_plan.PLAN_KNOBS``: the weight ring's slots; down's input staged
    whole instead of streamed, each tile's chunks still summed in order; the ring filled by
    ``cp.async`` instead of TMA above 1 row at 1B, by TMA at 8B; down waiting for all of gate/up
    at its start, not for its rounds but the last; a weight chunk of one or two 1024-column parts,
    each summed in the same order; FP8's two parts in a TMA box each; the attention's warp partials
    through padded shared-memory rows or not) move bytes, never change a
    sum: the whole step and the K/V it writes are bit for bit the default plan's (1B's
    ``stream_down: 0`` is the default that runs 105-108 verified against the reference)."""
    from monodecode.kernels.triton.step_launch import StepKernels

    build = B1
    if widths in (B8, B8F):  # 8B's own builds (down's input streamed above 1 row), all their widths
        build, widths = widths, widths[1]
    dims, weights, tk, _, kv, before, meta, x = _setup(build, CONTEXTS[case], seed=11)
    req = _request(build[0], widths, 2.0, build[5] if len(build) > 5 else "bf16")
    changed = StepKernels(req, weights, req.platform.compute_units, _gpu(), plan=plan)
    try:
        kv2 = _snapshot(before)
        h = tk.forward_step(x, [meta] * build[2], kv)
        h2 = changed.forward_step(x, [meta] * build[2], kv2)
        torch.cuda.synchronize()
        assert torch.equal(h, h2), f"plan {plan}: the step's output differs from the default plan's"
        for l in range(build[2]):
            assert torch.equal(kv.key[l], kv2.key[l]) and torch.equal(kv.value[l], kv2.value[l]), (
                f"plan {plan}: layer {l}'s K/V differ from the default plan's"
            )
        assert changed.health() == 0, decode_health(changed.health())
    finally:
        changed.close()
