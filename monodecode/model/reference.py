"""The reference decode: the numerics oracle of every kernel backend (PyTorch, any device).

A dense decoder layer is split the way the kernels split it:

- **K1** (``k1_reference``): pre-norm -> QKV -> q/k-norm -> RoPE -> write K/V at the slot mapping ->
  paged GQA attention through the block table (sliding window on sliding layers) -> the attention
  output before the O projection.
- **K2** (``k2_reference``): O projection -> (Gemma post-attention norm) -> residual add -> pre-MLP
  norm -> gate/up -> act(gate) * up -> down -> (Gemma post-MLP norm) -> residual add.

Numerics: activations travel in the KV cache's dtype (bf16 in serving; fp32 is allowed so tests can
compare structure tightly against HF in fp32). Every matmul, norm and softmax accumulates in fp32;
results are rounded to the activation dtype where Hugging Face transformers rounds them (after each
projection, norm, activation, product and residual add; RoPE's cos/sin are rounded like HF's and
vLLM's caches; the embedding scale is rounded to the activation dtype as HF does). Attention is
computed in fp32 and rounded once. Logits are returned in fp32.

Everything here is free of host syncs and data-dependent shapes, so a decode step can be captured
in a CUDA graph (benchmarks use it as the stock per-op baseline).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from monodecode.errors import MonodecodeError
from monodecode.model.dims import ModelDims, RopeSpec, load_dims
from monodecode.model.paged_kv import BlockAllocator, DecodeMetadata, PagedKVCache, write_kv
from monodecode.model.weights import LayerWeights, ModelWeights, load_weights

# Bounds the gathered K/V of one attention chunk (rows x context tokens), so long prefills stay small.
_ATTN_CHUNK_TOKENS = 1 << 16


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    """RMSNorm over the last dim. Gemma: ``(x_hat * (1 + w))`` rounded once; Llama/Qwen3: ``w * round(x_hat)``."""
    xf = x.float()
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if one_plus:
        return (x_hat * (1.0 + w.float())).to(x.dtype)
    return (w.float() * x_hat.to(x.dtype).float()).to(x.dtype)


_INV_FREQ_CACHE: dict[tuple, torch.Tensor] = {}


def _inv_freq(rope: RopeSpec, head_dim: int, device: torch.device) -> torch.Tensor:
    # Cached per device: a warm-up step creates it, captured steps only read it.
    key = (rope, head_dim, str(device))
    t = _INV_FREQ_CACHE.get(key)
    if t is None:
        t = torch.tensor(rope.inv_freq(head_dim), dtype=torch.float32, device=device)
        _INV_FREQ_CACHE[key] = t
    return t


def rope_cos_sin(rope: RopeSpec, head_dim: int, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin ``[rows, head_dim]`` (rotate-half layout), rounded to ``dtype`` like HF's and vLLM's."""
    freqs = positions.to(torch.float32)[:, None] * _inv_freq(rope, head_dim, positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x[rows, heads, head_dim] * cos + rotate_half(x) * sin`` in fp32, rounded once."""
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos.float()[:, None, :] + rotated * sin.float()[:, None, :]).to(x.dtype)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """GQA attention of ``q[rows, heads, head_dim]`` over the paged cache, through the block tables.

    Row ``r`` (query position ``p``) attends to its sequence's tokens ``j < seq_lens[r]`` and, with a
    sliding window, only ``j > p - window``. Padded rows (slot -1) return zeros.
    """
    rows, heads, hd = q.shape
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    bs = key_cache.shape[1]
    ctx = meta.max_blocks * bs
    out = torch.empty(rows, heads, hd, dtype=q.dtype, device=q.device)
    chunk = max(1, _ATTN_CHUNK_TOKENS // max(ctx, 1))
    j = torch.arange(ctx, device=q.device)
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        tables = meta.block_tables[r0:r1].long()
        k = key_cache[tables].reshape(r1 - r0, ctx, kv_heads, hd).float()
        v = value_cache[tables].reshape(r1 - r0, ctx, kv_heads, hd).float()
        qf = q[r0:r1].float().view(r1 - r0, kv_heads, group, hd)
        scores = torch.einsum("rkgd,rlkd->rkgl", qf, k) * scale
        seq_lens = meta.seq_lens[r0:r1].long()
        visible = j[None, :] < seq_lens[:, None]
        if window is not None:
            visible = visible & (j[None, :] > meta.positions[r0:r1, None] - window)
        # Finite fill keeps fully masked (padded) rows NaN-free; they are zeroed below.
        scores = scores.masked_fill(~visible[:, None, None, :], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1)
        # an invisible position's V never reaches the sum, whatever the cache holds there (a
        # block's unwritten slots, the null block behind a table's padding): its 0 x NaN is NaN
        v = v.masked_fill(~visible[:, :, None, None], 0.0)
        o = torch.einsum("rkgl,rlkd->rkgd", probs, v).reshape(r1 - r0, heads, hd)
        live = (meta.slot_mapping[r0:r1] >= 0) & (seq_lens > 0)
        out[r0:r1] = torch.where(live[:, None, None], o, torch.zeros_like(o)).to(q.dtype)
    return out


def _activation(dims: ModelDims, gate: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    if dims.activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh").to(gate.dtype)
    return F.silu(g).to(gate.dtype)


def k1_reference(
    dims: ModelDims, layer: int, w: LayerWeights, x: torch.Tensor, meta: DecodeMetadata, kv: PagedKVCache
) -> torch.Tensor:
    """Layer ``layer``'s K1: returns the attention output ``[rows, q_size]`` before o_proj; writes K/V."""
    rows = x.shape[0]
    hd = dims.head_dim
    h = rms_norm(x, w.attn_norm, dims.rms_norm_eps, dims.norm_one_plus)
    q = w.q_proj(h).view(rows, dims.num_heads, hd)
    k = w.k_proj(h).view(rows, dims.num_kv_heads, hd)
    v = w.v_proj(h).view(rows, dims.num_kv_heads, hd)
    if dims.qk_norm:
        q = rms_norm(q, w.q_norm, dims.rms_norm_eps, dims.norm_one_plus)
        k = rms_norm(k, w.k_norm, dims.rms_norm_eps, dims.norm_one_plus)
    cos, sin = rope_cos_sin(dims.rope_for_layer(layer), hd, meta.positions, x.dtype)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    write_kv(kv.key[layer], meta.slot_mapping, k)
    write_kv(kv.value[layer], meta.slot_mapping, v)
    attn = paged_attention(q, kv.key[layer], kv.value[layer], meta, dims.attn_scale, dims.window_for_layer(layer))
    return attn.reshape(rows, dims.q_size)


def k2_reference(dims: ModelDims, layer: int, w: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Layer ``layer``'s K2: O projection and MLP with their residual adds; returns the new residual stream."""
    eps, one_plus = dims.rms_norm_eps, dims.norm_one_plus
    o = w.o_proj(attn.to(x.dtype))
    if dims.post_norms:
        o = rms_norm(o, w.attn_post_norm, eps, one_plus)
    x = (x.float() + o.float()).to(x.dtype)
    h = rms_norm(x, w.mlp_norm, eps, one_plus)
    gate = w.gate_proj(h)
    up = w.up_proj(h)
    mlp_in = (_activation(dims, gate).float() * up.float()).to(x.dtype)
    down = w.down_proj(mlp_in)
    if dims.post_norms:
        down = rms_norm(down, w.mlp_post_norm, eps, one_plus)
    return (x.float() + down.float()).to(x.dtype)


def decode_layer(
    dims: ModelDims, layer: int, w: LayerWeights, x: torch.Tensor, meta: DecodeMetadata, kv: PagedKVCache
) -> torch.Tensor:
    """One whole decoder layer: ``k2(k1(x))``."""
    return k2_reference(dims, layer, w, x, k1_reference(dims, layer, w, x, meta, kv))


def embed(weights: ModelWeights, ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Token embeddings ``[rows, hidden]`` in ``dtype``; Gemma's sqrt(hidden) scale is rounded to ``dtype`` first."""
    x = weights.embed[ids.to(weights.embed.device).long()].to(dtype)
    if weights.dims.embed_scale != 1.0:
        # Rounded on the host: no tensor creation on the device (keeps the step graph-capturable).
        scale = float(torch.tensor(weights.dims.embed_scale, dtype=dtype))
        x = (x.float() * scale).to(dtype)
    return x


def final_logits(weights: ModelWeights, x: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head: fp32 logits ``[rows, vocab]`` (with final softcapping if the model has it)."""
    d = weights.dims
    h = rms_norm(x, weights.final_norm, d.rms_norm_eps, d.norm_one_plus)
    logits = weights.lm_head(h, out_dtype=torch.float32)
    if d.final_logit_softcapping is not None:
        cap = d.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


# A layer implementation: (layer index, x, meta, kv) -> x_new. Backends plug in here.
LayerFn = Callable[[int, torch.Tensor, DecodeMetadata, PagedKVCache], torch.Tensor]


def run_layers(
    weights: ModelWeights, x: torch.Tensor, meta: DecodeMetadata, kv: PagedKVCache, layer_fn: LayerFn | None = None
) -> torch.Tensor:
    """Every decoder layer over ``x``; ``layer_fn`` replaces the reference layer (e.g. a kernel backend)."""
    for l, w in enumerate(weights.layers):
        x = layer_fn(l, x, meta, kv) if layer_fn else decode_layer(weights.dims, l, w, x, meta, kv)
    return x


def decode_step(
    weights: ModelWeights,
    ids: torch.Tensor,
    meta: DecodeMetadata,
    kv: PagedKVCache,
    layer_fn: LayerFn | None = None,
) -> torch.Tensor:
    """One step: embed ``ids[rows]`` -> all layers over the paged cache -> fp32 logits ``[rows, vocab]``.

    Activations use the cache's dtype. Rows of ``meta`` may belong to different sequences (decode) or
    be consecutive tokens of one sequence (prefill); padded rows' logits are meaningless.
    """
    x = embed(weights, ids, dtype=kv.dtype)
    return final_logits(weights, run_layers(weights, x, meta, kv, layer_fn))


def prefill(
    weights: ModelWeights,
    ids: torch.Tensor | list[int],
    kv: PagedKVCache,
    allocator: BlockAllocator,
    seq_id=0,
    max_blocks: int | None = None,
) -> torch.Tensor:
    """Run a prompt (or a continuation chunk) of one sequence through the paged cache.

    Simple by design: all prompt tokens are rows of one step, each attending to the tokens before
    it. Returns the fp32 logits ``[vocab]`` of the last token.
    """
    ids = torch.as_tensor(ids, dtype=torch.int64, device=kv.device)
    if ids.dim() != 1 or ids.numel() == 0:
        raise MonodecodeError("prefill needs a non-empty 1-D list of token ids")
    meta = allocator.prefill_metadata(seq_id, ids.numel(), max_blocks=max_blocks, device=kv.device)
    x = run_layers(weights, embed(weights, ids, dtype=kv.dtype), meta, kv)
    return final_logits(weights, x[-1:])[0]


def greedy_decode(
    model_dir: str | Path,
    prompt_ids: list[int],
    max_new_tokens: int,
    block_size: int = 16,
    dtype: str = "bf16",
    device: str | torch.device = "cpu",
) -> tuple[list[int], torch.Tensor]:
    """Greedy generation with the reference decode for an HF model directory.

    Args:
        model_dir: directory with ``config.json`` and ``*.safetensors`` (Llama 3, Qwen3, Gemma 3 text).
        prompt_ids: the prompt's token ids (include BOS yourself if the model expects it).
        max_new_tokens: tokens to generate (>= 1); generation does not stop at EOS.
        block_size: KV cache block size in tokens.
        dtype: weight dtype: ``"bf16"`` (as stored), ``"fp8"`` (e4m3fn) or ``"fp8_fnuz"`` (e4m3fnuz),
            FP8 quantized per output channel at load. Activations and the KV cache are bf16.
        device: any torch device.

    Returns:
        ``(token_ids, last_logits)``: the ``max_new_tokens`` generated ids (prompt excluded), and the
        fp32 logits ``[vocab]`` from which the last generated id was chosen (argmax).

    The prompt is prefilled through the paged cache, then each new token is one decode step that
    writes its K/V at its slot and attends through the block table.
    """
    if max_new_tokens < 1:
        raise MonodecodeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise MonodecodeError("greedy_decode needs at least one prompt token")
    dims = load_dims(model_dir)
    bad = [t for t in prompt if not 0 <= t < dims.vocab_size]
    if bad:
        raise MonodecodeError(f"prompt token id {bad[0]} is outside the vocabulary (size {dims.vocab_size})")
    weights = load_weights(model_dir, dims, weight_dtype=dtype, device=device)
    total = len(prompt) + max_new_tokens
    num_blocks = -(-total // block_size)
    kv = PagedKVCache.allocate(dims, num_blocks, block_size, device=device)
    alloc = BlockAllocator(num_blocks, block_size)
    logits = prefill(weights, prompt, kv, alloc, seq_id=0)
    out: list[int] = []
    while True:
        token = int(torch.argmax(logits))
        out.append(token)
        if len(out) == max_new_tokens:
            return out, logits
        meta = alloc.decode_metadata([0], device=device)
        logits = decode_step(weights, torch.tensor([token], device=device), meta, kv)[0]
