"""The reference decode against Hugging Face transformers' own Llama, Qwen3 and Gemma 3 implementations.

Small random-weight models are built from HF's config classes and written with ``save_pretrained``
(safetensors), so ``load_weights`` reads real checkpoints. Two prompts are decoded as one batch
through the paged cache (shuffled block tables, an inert padded row), teacher-forced with HF's
greedy tokens, and compared step by step with HF run on each prompt alone (HF's DynamicCache).
Contexts reach 23 tokens: they cross KV blocks for block sizes 4 and 16, and exceed Gemma's
sliding window (6). Llama uses llama3 RoPE scaling with a small original context, so scaled,
smoothed and unscaled frequencies all occur.

Stated tolerances (max |logit difference| over every step, logits have std ~1-3):
- fp32 activations: 2e-4 and identical greedy tokens (measured ~1e-6: only summation order differs).
- bf16 activations (HF in bf16 too): 0.12, and the reference's error against HF-fp32 stays within
  1.5x HF-bf16's own error against HF-fp32 plus 0.02 (the reference rounds no worse than HF).
  Greedy tokens identical except where HF's top-2 margin is under the tolerance (then either of the
  near-tied tokens is accepted: bf16 rounding legitimately decides those).
- FP8 weights (e4m3fn and e4m3fnuz, per-channel scales) against HF-fp32 holding the same
  dequantized weights: 2e-4 with fp32 activations, 0.12 with bf16 activations.
"""

from __future__ import annotations

import functools

import pytest
import torch

from monodecode.model import (
    BlockAllocator,
    PagedKVCache,
    decode_step,
    load_dims,
    load_weights,
    prefill,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

transformers = pytest.importorskip("transformers")

FP32_TOL = 2e-4
BF16_TOL = 0.12
PROMPTS = ([5, 17, 99, 3, 42], [7, 7, 120, 64, 1, 33, 90, 2, 11])
STEPS = 14
BLOCK_SIZES = (4, 16)
FAMILIES = ("llama", "qwen3", "gemma3")
# Worst differences seen, printed at the end of the run (pytest -s) for the closing note.
MEASURED: dict[str, float] = {}


def _hf_config(family: str):
    common = dict(
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=128,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "llama":
        return transformers.LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    if family == "qwen3":
        return transformers.Qwen3Config(
            **common, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
    return transformers.Gemma3TextConfig(
        **common,
        sliding_window=6,
        query_pre_attn_scalar=32,
        final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )


def _model_class(family: str):
    return {
        "llama": transformers.LlamaForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
    }[family]


@functools.cache
def _checkpoint(family: str, root: str) -> str:
    """Directory of a random-weight HF checkpoint (bf16 safetensors written by ``save_pretrained``)."""
    torch.manual_seed({"llama": 1, "qwen3": 2, "gemma3": 3}[family])
    model = _model_class(family)(_hf_config(family)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if family == "gemma3" else 1.0))
            elif "embed" in name:
                p.normal_(0.0, 0.2 if family == "gemma3" else 1.0)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
            p.copy_(p.to(torch.bfloat16).float())  # the bf16 checkpoint then holds exactly these values
    path = f"{root}/{family}"
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@functools.cache
def _hf_model(family: str, root: str, dtype: torch.dtype):
    """HF's model loaded from the checkpoint the way users load it (RoPE buffers stay fp32)."""
    return _model_class(family).from_pretrained(_checkpoint(family, root), dtype=dtype).eval()


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_ckpts"))


@torch.no_grad()
def _hf_teacher_forced(model, prompt: list[int]):
    """HF greedy decode: logits after the prompt and after each of STEPS greedy tokens; the tokens fed."""
    out = model(torch.tensor([prompt]), use_cache=True)
    logits, fed = [out.logits[0, -1].float()], []
    past = out.past_key_values
    for _ in range(STEPS):
        tok = int(logits[-1].argmax())
        fed.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits), fed


@functools.cache
def _hf_run(family: str, root: str, dtype: torch.dtype, swap_weights: str | None = None):
    model = _hf_model(family, root, dtype)
    if swap_weights is not None:
        model = _with_dequantized_projections(model, load_weights(_checkpoint(family, root), weight_dtype=swap_weights))
    return [_hf_teacher_forced(model, list(p)) for p in PROMPTS]


def _with_dequantized_projections(model, weights):
    """A copy of ``model`` whose decoder projections hold the FP8 weights' dequantized values."""
    import copy

    clone = copy.deepcopy(model)
    with torch.no_grad():
        for l, (hf_layer, w) in enumerate(zip(clone.model.layers, weights.layers)):
            attn, mlp = hf_layer.self_attn, hf_layer.mlp
            for mod, lin in (
                (attn.q_proj, w.q_proj),
                (attn.k_proj, w.k_proj),
                (attn.v_proj, w.v_proj),
                (attn.o_proj, w.o_proj),
                (mlp.gate_proj, w.gate_proj),
                (mlp.up_proj, w.up_proj),
                (mlp.down_proj, w.down_proj),
            ):
                assert lin.kind != "bf16"
                mod.weight.copy_(lin.dequant())
    return clone


def _reference_run(path: str, act: torch.dtype, block_size: int, fed: list[list[int]], weight_dtype="bf16"):
    """Both prompts as one paged batch (shuffled blocks, one padded row), fed HF's tokens."""
    dims = load_dims(path)
    weights = load_weights(path, dims, weight_dtype=weight_dtype)
    num_blocks = 2 * (-(-(max(map(len, PROMPTS)) + STEPS + 1) // block_size)) + 3
    kv = PagedKVCache.allocate(dims, num_blocks, block_size, dtype=act)
    alloc = BlockAllocator(num_blocks, block_size, shuffle_seed=block_size)
    logits = [[prefill(weights, p, kv, alloc, seq_id=s)] for s, p in enumerate(PROMPTS)]
    for step in range(STEPS):
        meta = alloc.decode_metadata([0, 1]).pad_to(3)
        ids = torch.tensor([fed[0][step], fed[1][step], 0])
        out = decode_step(weights, ids, meta, kv)
        assert torch.isfinite(out[:2]).all()
        logits[0].append(out[0])
        logits[1].append(out[1])
    # Sanity on the paging itself: both sequences crossed block boundaries, not all into adjacent blocks.
    tables = [alloc.block_table(s) for s in (0, 1)]
    assert all(len(t) >= 2 for t in tables)
    assert any(b != a + 1 for t in tables for a, b in zip(t, t[1:]))
    return [torch.stack(l) for l in logits]


def _check_tokens(ref: torch.Tensor, hf: torch.Tensor, tol: float, exact: bool):
    """Greedy token per step identical; with ``exact=False`` a near-tie (HF margin < tol) may go either way."""
    for step in range(hf.shape[0]):
        want, got = int(hf[step].argmax()), int(ref[step].argmax())
        if got == want:
            continue
        margin = float(hf[step, want] - hf[step, got])
        assert not exact and margin < tol, f"step {step}: reference picks {got}, HF {want} (HF margin {margin:.4f})"


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_matches_hf(family, block_size, ckpt_root):
    path = _checkpoint(family, ckpt_root)
    hf = _hf_run(family, ckpt_root, torch.float32)
    ref = _reference_run(path, torch.float32, block_size, [fed for _, fed in hf])
    for (hf_logits, _), ref_logits in zip(hf, ref):
        diff = float((ref_logits - hf_logits).abs().max())
        MEASURED[f"{family} fp32 bs{block_size}"] = max(diff, MEASURED.get(f"{family} fp32 bs{block_size}", 0.0))
        assert diff <= FP32_TOL, f"{family}: max |logit diff| {diff:.3g} > {FP32_TOL}"
        _check_tokens(ref_logits, hf_logits, FP32_TOL, exact=True)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_hf(family, block_size, ckpt_root):
    path = _checkpoint(family, ckpt_root)
    hf16 = _hf_run(family, ckpt_root, torch.bfloat16)
    # HF-fp32 on HF-bf16's tokens is the ground truth both bf16 runs are measured against.
    model32 = _hf_model(family, ckpt_root, torch.float32)
    ref = _reference_run(path, torch.bfloat16, block_size, [fed for _, fed in hf16])
    for (hf_logits, fed), ref_logits, prompt in zip(hf16, ref, PROMPTS):
        truth = _hf_forced_on(model32, list(prompt), fed)
        diff = float((ref_logits - hf_logits).abs().max())
        ref_err = float((ref_logits - truth).abs().max())
        hf_err = float((hf_logits - truth).abs().max())
        key = f"{family} bf16 bs{block_size}"
        MEASURED[key] = max(diff, MEASURED.get(key, 0.0))
        MEASURED[f"{family} bf16 err vs fp32 (ref / hf)"] = max(
            ref_err, MEASURED.get(f"{family} bf16 err vs fp32 (ref / hf)", 0.0)
        )
        MEASURED[f"{family} bf16 hf err vs fp32"] = max(hf_err, MEASURED.get(f"{family} bf16 hf err vs fp32", 0.0))
        assert diff <= BF16_TOL, f"{family}: max |logit diff| {diff:.3g} > {BF16_TOL}"
        assert ref_err <= 1.5 * hf_err + 0.02, f"{family}: reference bf16 error {ref_err:.3g} vs HF bf16 {hf_err:.3g}"
        _check_tokens(ref_logits, hf_logits, BF16_TOL, exact=False)


@torch.no_grad()
def _hf_forced_on(model, prompt: list[int], fed: list[int]) -> torch.Tensor:
    """HF logits at the prompt's end and after each fed token, in one causal forward."""
    out = model(torch.tensor([prompt + fed]))
    return out.logits[0, len(prompt) - 1 :].float()


@pytest.mark.parametrize("weight_dtype", ["fp8", "fp8_fnuz"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_weights_match_hf_with_dequantized_weights(family, weight_dtype, ckpt_root):
    path = _checkpoint(family, ckpt_root)
    hf = _hf_run(family, ckpt_root, torch.float32, swap_weights=weight_dtype)
    fed = [f for _, f in hf]
    ref32 = _reference_run(path, torch.float32, 4, fed, weight_dtype=weight_dtype)
    ref16 = _reference_run(path, torch.bfloat16, 16, fed, weight_dtype=weight_dtype)
    for (hf_logits, _), r32, r16 in zip(hf, ref32, ref16):
        d32 = float((r32 - hf_logits).abs().max())
        d16 = float((r16 - hf_logits).abs().max())
        MEASURED[f"{family} {weight_dtype} fp32-act"] = max(d32, MEASURED.get(f"{family} {weight_dtype} fp32-act", 0.0))
        MEASURED[f"{family} {weight_dtype} bf16-act"] = max(d16, MEASURED.get(f"{family} {weight_dtype} bf16-act", 0.0))
        assert d32 <= FP32_TOL, f"{family} {weight_dtype}: fp32 max |logit diff| {d32:.3g}"
        assert d16 <= BF16_TOL, f"{family} {weight_dtype}: bf16 max |logit diff| {d16:.3g}"
        _check_tokens(r32, hf_logits, FP32_TOL, exact=True)
        _check_tokens(r16, hf_logits, BF16_TOL, exact=False)


def test_fp8_changes_the_weights(ckpt_root):
    """The FP8 runs above are not the bf16 run in disguise: quantization moves logits measurably."""
    _checkpoint("llama", ckpt_root)
    hf_bf16w = _hf_run("llama", ckpt_root, torch.float32)
    hf_fp8w = _hf_run("llama", ckpt_root, torch.float32, swap_weights="fp8")
    assert float((hf_bf16w[0][0][0] - hf_fp8w[0][0][0]).abs().max()) > 10 * FP32_TOL
