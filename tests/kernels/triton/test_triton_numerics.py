"""GPU numerics of the Triton K1/K2 against the reference decode (``monodecode/model/reference.py``).

Marked ``gpu``: skipped with a printed reason where torch sees no CUDA/ROCm GPU (CI). On the
H200 machine they run with ``PYTHONPATH=. python -m pytest tests/kernels/triton/test_triton_numerics.py``.

Stated tolerances (activations are bf16: one ulp is 0.4-0.8 % of a value, and the kernels round
at the same points as the reference but accumulate in a different order):
  per layer   ||tri - ref|| / ||ref|| <= 1e-2  and  max |tri - ref| <= 3 % of max |ref|
  whole stack ||tri - ref|| / ||ref|| <= 5e-2 for hidden states and logits after every step
              (16 random-weight layers let one-ulp differences grow: 3.4e-2 was seen at 16 layers)
FP8 weights: the same bounds, because the reference multiplies by the same quantized weights
and per-channel scales. The KV entries a step writes are held to the per-layer bound too.
"""

from __future__ import annotations

import time
import zlib

import pytest
import torch

from monodecode.kernels.base import BuildRequest
from monodecode.kernels.health import decode_health
from monodecode.model import reference as R
from monodecode.model.paged_kv import BlockAllocator, PagedKVCache
from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights
from monodecode.runtime.width_policy import capture_graph

pytestmark = pytest.mark.gpu

REL_FRO, MAX_FRAC, STACK_REL_FRO = 1e-2, 0.03, 5e-2
BLOCK = 16

# (profile, weight dtype, widths, layers built): the builds these tests compile
# (benchmarks/warm_cache.py compiles the same set in parallel before the tests run).
GPU_BUILDS = [
    ("tiny", "bf16", (1, 2, 3, 4, 5, 6, 7, 8), 4),
    ("llama3-8b", "bf16", (1, 3, 8), 2),
    ("llama3-8b", "fp8", (1, 3, 8), 2),
    ("gemma3-27b", "bf16", (1, 8), 2),
    ("qwen3-8b", "fp8", (2,), 1),
    ("llama3-1b", "bf16", (4,), 16),
    ("tiny", "bf16", (2,), 4),  # fault drills (own build: short wait timeout)
]


def _gpu() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA/ROCm GPU visible to torch: the Triton kernels run on a GPU (H200 runs these)")
    return torch.device("cuda")


def _close(tri: torch.Tensor, ref: torch.Tensor, what: str, rel: float = REL_FRO, frac: float | None = MAX_FRAC):
    t, r = tri.float(), ref.float()
    assert torch.isfinite(t).all(), f"{what}: non-finite values"
    err = (t - r).norm() / r.norm().clamp_min(1e-30)
    assert err <= rel, f"{what}: relative error {err:.2e} > {rel:.0e}"
    if frac is not None:
        worst = (t - r).abs().max() / r.abs().max().clamp_min(1e-30)
        assert worst <= frac, f"{what}: max abs error {worst:.2%} of max|ref| > {frac:.0%}"


_CACHE: dict = {}


def _build(profile: str, weight_dtype: str, widths, layers: int, wait_timeout_s: float = 2.0):
    """Weights + Triton kernels for one GPU_BUILDS entry (cached per session)."""
    key = (profile, weight_dtype, tuple(widths), layers, wait_timeout_s)
    if key in _CACHE:
        return _CACHE[key]
    from monodecode.kernels.triton.backend import TritonBackend
    from monodecode.services.platform import detect_platform

    dev = _gpu()
    dims = profile_dims(profile)
    seed = zlib.crc32(repr(key).encode()) % 1000
    weights = random_weights(dims, seed=seed, weight_dtype=weight_dtype, device=dev, num_layers=layers)
    req = BuildRequest(
        dims=dims,
        weight_dtype=weight_dtype,
        tp_size=1,
        widths=tuple(widths),
        block_size=BLOCK,
        platform=detect_platform(),
        wait_timeout_s=wait_timeout_s,
    )
    kernels = TritonBackend().build(req, weights, None, allow_jit=True)
    _CACHE[key] = (dims, weights, kernels)
    return _CACHE[key]


def _context(dims, layers: int, ctx_lens: list[int], dev, seed: int):
    """Two identical paged caches holding random K/V for sequences of ``ctx_lens - 1`` tokens
    (blocks handed out in shuffled order) and the metadata of their next decode step."""
    need = sum(-(-c // BLOCK) + 1 for c in ctx_lens) + 2
    alloc = BlockAllocator(need, BLOCK, shuffle_seed=seed)
    for i, c in enumerate(ctx_lens):
        if c > 1:
            alloc.append_slots(i, c - 1)
    kv_ref = PagedKVCache.allocate(dims, need, BLOCK, device=dev, num_layers=layers)
    g = torch.Generator(device=dev).manual_seed(seed)
    for l in range(layers):
        kv_ref.key[l].copy_(torch.randn(kv_ref.key[l].shape, generator=g, device=dev))
        kv_ref.value[l].copy_(torch.randn(kv_ref.value[l].shape, generator=g, device=dev))
    kv_tri = PagedKVCache([k.clone() for k in kv_ref.key], [v.clone() for v in kv_ref.value], BLOCK)
    return alloc, kv_ref, kv_tri


def _ctx_lens(width: int, offset: int) -> list[int]:
    base = [1, 17, 300, 33, 1024, 16, 1500, 65]
    return [base[(i + offset) % len(base)] + offset for i in range(width)]


PER_LAYER = [(p, d, w) for (p, d, ws, _) in GPU_BUILDS[:5] for w in ws]


@pytest.mark.parametrize("profile,weight_dtype,width", PER_LAYER)
def test_per_layer_k1_k2_match_reference(profile, weight_dtype, width):
    build = next(b for b in GPU_BUILDS if b[0] == profile and b[1] == weight_dtype)
    dims, weights, tk = _build(*build)
    dev = _gpu()
    layers = build[3]
    alloc, kv_ref, kv_tri = _context(dims, layers, _ctx_lens(width, width), dev, seed=width)
    meta = alloc.decode_metadata(list(range(width)), device=dev)
    g = torch.Generator(device=dev).manual_seed(100 + width)
    x = torch.randn(width, dims.hidden_size, generator=g, device=dev).to(torch.bfloat16)
    slots = meta.slot_mapping
    for l in range(layers):
        a_ref = R.k1_reference(dims, l, weights.layers[l], x, meta, kv_ref)
        a_tri = tk.k1(l, x, meta, kv_tri)
        _close(a_tri, a_ref, f"{profile}/{weight_dtype} w={width} layer {l} K1")
        for name, c_ref, c_tri in (("K", kv_ref.key[l], kv_tri.key[l]), ("V", kv_ref.value[l], kv_tri.value[l])):
            flat_r = c_ref.view(-1, dims.num_kv_heads, dims.head_dim)
            flat_t = c_tri.view(-1, dims.num_kv_heads, dims.head_dim)
            _close(flat_t[slots], flat_r[slots], f"layer {l} new {name} entries")
            rest = flat_t.clone()
            rest[slots] = flat_r[slots]
            assert torch.equal(rest, flat_r), f"layer {l}: {name} entries outside the new slots changed"
        y_ref = R.k2_reference(dims, l, weights.layers[l], x, a_ref)
        y_tri = tk.k2(l, x, a_ref)
        _close(y_tri, y_ref, f"{profile}/{weight_dtype} w={width} layer {l} K2")
        x = y_ref
    assert tk.health() == 0, decode_health(tk.health())


@pytest.mark.parametrize("profile,width", [("llama3-8b", 3), ("llama3-8b", 8), ("gemma3-27b", 1)])
def test_attention_launch_on_long_steps_and_k1_on_short_ones(profile, width):
    """The attention launch (``Target.attn_launch``, here from 1024 positions on, where the
    default takes it from 4096): a step whose rows see fewer positions runs K1's own attention, a
    step with a longer row the launch's many splits merged by the last to arrive (and on Gemma's
    sliding layers, which see at most their window, K1's again). Both within the per-layer bounds."""
    import dataclasses

    from monodecode.kernels.triton.config import CUDA
    from monodecode.kernels.triton.launch import TritonKernels

    build = next(b for b in GPU_BUILDS if b[0] == profile and b[1] == "bf16")
    dims, weights, base = _build(*build)
    dev = _gpu()
    target = dataclasses.replace(CUDA, attn_launch=True, attn_launch_min_context=1024)
    tk = TritonKernels(base.req, weights, target, base.num_programs, dev, share=base)
    layers = build[3]
    for ctx in ([17, 300, 33, 900, 5, 64, 700, 1000][:width], [4000, 1500, 5000, 2100, 33, 1025, 3000, 9][:width]):
        alloc, kv_ref, kv_tri = _context(dims, layers, ctx, dev, seed=width + len(ctx))
        meta = alloc.decode_metadata(list(range(width)), device=dev)
        x = torch.randn(width, dims.hidden_size, device=dev).to(torch.bfloat16)
        for l in range(layers):
            a_ref = R.k1_reference(dims, l, weights.layers[l], x, meta, kv_ref)
            _close(tk.k1(l, x, meta, kv_tri), a_ref, f"{profile} w={width} ctx<={max(ctx)} layer {l} K1")
            x = R.k2_reference(dims, l, weights.layers[l], x, a_ref)
    assert tk.health() == 0, decode_health(tk.health())


def test_every_launch_holds_the_programs_per_sm_it_is_planned_for():
    """On this GPU, from the loaded binaries (``TritonKernels.residency``): K1 and K2 hold their
    persistent grids' programs per SM and the attention launch its whole waves' (no
    ``residency_misfits``). A target that plans the attention launch for 8 programs of 128-wide
    heads per SM, more than its registers allow, is named at every width."""
    import dataclasses

    from monodecode.kernels.triton.config import CUDA
    from monodecode.kernels.triton.launch import TritonKernels

    for build in GPU_BUILDS[:5]:
        tk = _build(*build)[2]
        assert sorted(tk.residency) == sorted(build[2]), build
        assert all({"k1", "k2"} <= set(r) for r in tk.residency.values()), tk.residency
        assert tk.residency_misfits() == [], (build, tk.residency)
    build = next(b for b in GPU_BUILDS if b[:2] == ("llama3-8b", "bf16"))
    dims, weights, base = _build(*build)
    target = dataclasses.replace(CUDA, attn_launch_slots_per_sm=((128, 8),))
    tk = TritonKernels(base.req, weights, target, base.num_programs, _gpu(), share=base)
    assert tk.residency_misfits() == [
        f"width {w} ka: {tk.residency[w]['ka']} programs per SM, planned for 8" for w in build[2]
    ]


def _interleaved(kv: PagedKVCache) -> PagedKVCache:
    """The same K/V as vLLM 0.33 holds them (token-major LBNHC, K|V side by side per head):
    key/value are strided views of one buffer per layer (``vllm_plugin.step.kv_views``)."""
    keys, values = [], []
    for k, v in zip(kv.key, kv.value):
        buf = torch.cat([k, v], dim=-1).contiguous()
        keys.append(buf[..., : k.shape[-1]])
        values.append(buf[..., k.shape[-1] :])
    return PagedKVCache(keys, values, kv.block_size)


@pytest.mark.parametrize(
    "profile,weight_dtype,width", [("llama3-8b", "bf16", 3), ("gemma3-27b", "bf16", 1), ("tiny", "bf16", 8)]
)
def test_vllm_interleaved_kv_views(profile, weight_dtype, width):
    """K1 reads and writes vLLM's interleaved K|V cache through its strides: outputs, the new
    entries and every other entry of the shared buffer (K and V of other heads) as with planes."""
    build = next(b for b in GPU_BUILDS if b[0] == profile and b[1] == weight_dtype)
    dims, weights, tk = _build(*build)
    dev = _gpu()
    layers = build[3]
    alloc, kv_ref, kv_plain = _context(dims, layers, _ctx_lens(width, 3), dev, seed=40 + width)
    kv_tri = _interleaved(kv_plain)
    assert kv_tri.key[0].stride(2) == 2 * dims.head_dim and not kv_tri.key[0].is_contiguous()
    meta = alloc.decode_metadata(list(range(width)), device=dev)
    x = torch.randn(width, dims.hidden_size, device=dev).to(torch.bfloat16)
    s = meta.slot_mapping
    blk, off = s // BLOCK, s % BLOCK
    for l in range(layers):
        a_ref = R.k1_reference(dims, l, weights.layers[l], x, meta, kv_ref)
        a_tri = tk.k1(l, x, meta, kv_tri)
        _close(a_tri, a_ref, f"{profile} w={width} layer {l} K1 (interleaved KV)")
        for name, c_ref, c_tri in (("K", kv_ref.key[l], kv_tri.key[l]), ("V", kv_ref.value[l], kv_tri.value[l])):
            _close(c_tri[blk, off], c_ref[blk, off], f"layer {l} new {name} entries (interleaved KV)")
            rest = c_tri.clone()
            rest[blk, off] = c_ref[blk, off]
            assert torch.equal(rest, c_ref), f"layer {l}: {name} entries outside the new slots changed"
        x = R.k2_reference(dims, l, weights.layers[l], x, a_ref)
    assert tk.health() == 0, decode_health(tk.health())


@pytest.mark.parametrize("profile,width", [("tiny", w) for w in range(1, 9)] + [("llama3-1b", 4)])
def test_whole_stack_over_steps_crossing_blocks(profile, width):
    build = next(b for b in GPU_BUILDS if b[0] == profile)
    dims, weights, tk = _build(*build)
    dev = _gpu()
    layers = build[3]
    # contexts just below a block boundary so the steps cross it; tiny's window (24) is exceeded
    ctx = [BLOCK * (2 + i) - 1 for i in range(width)]
    alloc, kv_ref, kv_tri = _context(dims, layers, ctx, dev, seed=7 + width)
    g = torch.Generator(device=dev).manual_seed(width)
    for step in range(3):
        meta = alloc.decode_metadata(list(range(width)), device=dev)
        ids = torch.randint(0, dims.vocab_size, (width,), generator=g, device=dev)
        x = R.embed(weights, ids)
        h_ref = R.run_layers(weights, x, meta, kv_ref)
        h_tri = R.run_layers(weights, x, meta, kv_tri, layer_fn=tk.forward_layer)
        _close(h_tri, h_ref, f"{profile} w={width} step {step} hidden", rel=STACK_REL_FRO, frac=None)
        _close(
            R.final_logits(weights, h_tri),
            R.final_logits(weights, h_ref),
            f"step {step} logits",
            rel=STACK_REL_FRO,
            frac=None,
        )
    assert tk.health() == 0, decode_health(tk.health())


def test_padded_rows_are_inert():
    """Rows with slot -1 (garbage inputs, empty tables) change neither the live rows' results
    (bit for bit) nor any KV entry but the live rows' slots."""
    dims, weights, tk = _build(*GPU_BUILDS[0])  # tiny, widths 1..8
    dev = _gpu()
    rows = 3
    alloc, kv_ref, kv_tri = _context(dims, 4, [40, 9, 70], dev, seed=3)
    meta = alloc.decode_metadata([0, 1, 2], device=dev)
    padded = meta.pad_to(5)
    x = torch.randn(rows, dims.hidden_size, device=dev).to(torch.bfloat16)
    keys, values = [k.clone() for k in kv_tri.key], [v.clone() for v in kv_tri.value]
    outs = []
    for trial in range(2):
        kv = PagedKVCache([k.clone() for k in keys], [v.clone() for v in values], BLOCK)
        junk = (100.0 * (trial + 1)) * torch.randn(2, dims.hidden_size, device=dev)
        y = tk.forward_layer(0, torch.cat([x, junk.to(torch.bfloat16)]), padded, kv)
        outs.append(y[:rows].clone())
        for before, after in zip(keys + values, kv.key + kv.value):
            diff = (before != after).flatten(2).any(-1).flatten()
            changed = set(torch.nonzero(diff).flatten().tolist())
            assert changed <= set(meta.slot_mapping.tolist()), f"padded rows wrote KV slots {changed}"
    assert torch.equal(outs[0], outs[1]), "padded rows' inputs changed the live rows' results"
    y_ref = R.decode_layer(dims, 0, weights.layers[0], x, meta, kv_ref)
    _close(outs[0], y_ref, "padded step, live rows")
    assert tk.health() == 0


@pytest.mark.parametrize("rows", [2, 5])
def test_forward_layer_pads_to_the_smallest_fitting_width(rows):
    dims, weights, tk = _build(*GPU_BUILDS[1])  # llama3-8b, widths (1, 3, 8)
    dev = _gpu()
    alloc, kv_ref, kv_tri = _context(dims, 2, _ctx_lens(rows, 1), dev, seed=rows)
    meta = alloc.decode_metadata(list(range(rows)), device=dev)
    x = torch.randn(rows, dims.hidden_size, device=dev).to(torch.bfloat16)
    for l in range(2):
        y_ref = R.decode_layer(dims, l, weights.layers[l], x, meta, kv_ref)
        y_tri = tk.forward_layer(l, x, meta, kv_tri)
        assert y_tri.shape == (rows, dims.hidden_size)
        _close(y_tri, y_ref, f"{rows} rows padded, layer {l}")
        x = y_ref
    assert tk.health() == 0


def test_graph_replays_bit_identical():
    """1,000 replays of a captured 16-layer step: every output equals the first, the launch
    counters advance exactly on device (epochs), and nothing is zeroed between replays."""
    dims, weights, tk = _build(*next(b for b in GPU_BUILDS if b[0] == "llama3-1b"))  # 16 layers, width 4
    dev = _gpu()
    alloc, kv_ref, kv_tri = _context(dims, 16, [100, 517, 16, 1023], dev, seed=11)
    meta = alloc.decode_metadata([0, 1, 2, 3], device=dev)
    from monodecode.kernels.triton.launch import _Meta

    m = _Meta(meta, dev)
    x = torch.randn(4, dims.hidden_size, device=dev).to(torch.bfloat16)

    def step():
        y = x
        for l in range(16):
            y = tk.forward_layer(l, y, m, kv_tri)
        return y

    graph, out = capture_graph(step)
    lp = tk.plan.layers[4]
    counter = tk.scratch[lp.region("epoch_k1").word_offset]
    graph.replay()
    first = out.clone()
    c0 = int(counter.item())
    mismatches = torch.zeros((), dtype=torch.int64, device=dev)
    for _ in range(999):
        graph.replay()
        mismatches += (out.view(torch.int16) != first.view(torch.int16)).any().to(torch.int64)
    torch.cuda.synchronize()
    assert int(mismatches.item()) == 0, f"{int(mismatches.item())} of 999 replays differ from the first"
    assert int(counter.item()) - c0 == 999 * 16 * lp.workgroups("k1"), "K1 launch counter did not advance exactly"
    assert tk.health() == 0, decode_health(tk.health())
    h_ref = R.run_layers(weights, x, meta, kv_ref)
    _close(first, h_ref, "replayed step vs reference", rel=STACK_REL_FRO, frac=None)


@pytest.mark.parametrize("kind,site,kernel", [("stall", "wait_timeout", "k1"), ("nonfinite", "nonfinite", "k2")])
def test_faults_set_sticky_health_and_launches_terminate(kind, site, kernel):
    from monodecode.services.faults import Fault

    dims, weights, tk = _build("tiny", "bf16", (2,), 4, wait_timeout_s=0.02)
    dev = _gpu()
    alloc, kv_ref, kv_tri = _context(dims, 4, [5, 30], dev, seed=5)
    meta = alloc.decode_metadata([0, 1], device=dev)
    x = torch.randn(2, dims.hidden_size, device=dev).to(torch.bfloat16)
    tk.reset_health()
    assert tk.arm_fault(Fault(kind=kind, layer=1))
    t0 = time.monotonic()
    R.run_layers(weights, x, meta, kv_tri, layer_fn=tk.forward_layer)
    code = tk.health()
    elapsed = time.monotonic() - t0
    fault = decode_health(code)
    assert fault is not None and (fault.site, fault.kernel, fault.layer) == (site, kernel, 1), fault
    assert elapsed < 30, f"a faulted step took {elapsed:.1f}s (waits must be bounded)"
    # sticky: a healthy step afterwards does not clear it
    R.run_layers(weights, x, meta, kv_tri, layer_fn=tk.forward_layer)
    assert tk.health() == code
    tk.reset_health()
    assert tk.health() == 0
