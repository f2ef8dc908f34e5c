"""A realistic stock per-op decode step in plain PyTorch: the benchmark's baseline.

What vLLM's per-op decode runs for a dense layer, op for op, with stock PyTorch kernels instead of
vLLM's fused custom ones (no torch.compile, no custom kernels):

  norm        ``F.rms_norm`` (+ weight multiply), Gemma's ``(1 + w)`` folded into the weight
  QKV, gate/up merged weights (vLLM's QKVParallelLinear / MergedColumnParallelLinear), one GEMM each
  GEMMs       bf16: ``F.linear`` (cuBLAS). FP8 (W8A8 like vLLM's Hopper FP8 path): each activation
              row quantized to e4m3 with its absmax scale, then ``torch._scaled_mm`` with row-wise
              scales (activation per row, weight per output channel), bf16 out. Where
              ``_scaled_mm`` does not run, the weights are dequantized to bf16 once at setup and
              ``fp8_path`` says so.
  q/k-norm    one ``F.rms_norm`` over the q|k heads with the per-head weights concatenated
  RoPE        cos/sin cache indexed by position, rotate-half in fp32 (a flip of the two halves)
  KV insert   ``index_put_`` at (slot // block, slot % block): works on strided views too
  attention   gather of the rows' blocks through the block table, then
              ``F.scaled_dot_product_attention`` with the GQA group as the query length and a
              visibility mask (context length, sliding window) built once per step
  act         ``F.silu`` / ``F.gelu(tanh)`` then a multiply

All shapes are static and nothing syncs the host, so a whole step is captured in one CUDA graph.
vLLM fuses several of these small ops (fused add+norm, one RoPE kernel, one cache-write kernel,
paged flash attention without the gather, silu_and_mul) into about 10 kernels per layer; plain
PyTorch launches more, so this path is a little slower than vLLM's around the GEMMs. The GEMMs
alone (``gemm_floor``) bound every per-op path that uses cuBLAS from below.

Numerics follow the reference's rounding points except where the stock ops round differently
(bf16 ``1 + w`` on Gemma, W8A8 activations on FP8); the benchmark reports the error against
the reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from monodecode.model.dims import ModelDims

FP8_MAX = 448.0  # e4m3fn


@dataclass
class _Lin:
    """One projection: bf16 weight [out, in] (``scale`` None), or e4m3 weight + fp32 scale [1, out]."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.scale)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """bf16 ``F.linear``, or W8A8: per-row dynamic e4m3 activations (vLLM's
    dynamic_per_token_scaled_fp8_quant) and ``torch._scaled_mm`` with row-wise scales."""
    if scale is None:
        return F.linear(x, weight)
    xs = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    xq = (x.float() / xs).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale, out_dtype=torch.bfloat16)


def _merge(lins) -> tuple[torch.Tensor, torch.Tensor | None]:
    if len(lins) == 1:  # nothing to merge: share the model's tensor (no second copy on the GPU)
        lin = lins[0]
        return lin.weight.contiguous(), (None if lin.scale is None else lin.scale.float().reshape(1, -1).contiguous())
    w = torch.cat([lin.weight for lin in lins], dim=0).contiguous()
    if lins[0].scale is None:
        return w, None
    return w, torch.cat([lin.scale for lin in lins]).float().reshape(1, -1).contiguous()


def scaled_mm_works(device) -> str | None:
    """None if row-wise ``torch._scaled_mm`` runs here and matches a dequantized GEMM, else why not."""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        w = (torch.randn(64, 128, generator=g) / 4).to(device).to(torch.float8_e4m3fn)
        s = torch.rand(1, 64, generator=g).to(device) + 0.5
        x = torch.randn(3, 128, generator=g).to(device).to(torch.bfloat16)
        y = _Lin(w, s)(x).float()
        ref = x.float() @ (w.float() * s.reshape(-1, 1)).t()
        err = float((y - ref).norm() / ref.norm())
        if not err < 0.1:  # e4m3 activations: a few percent
            return f"torch._scaled_mm disagrees with the dequantized GEMM (relative error {err:.2e})"
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        return f"torch._scaled_mm is unavailable: {str(e).splitlines()[0][:200]}"
    return None


class StockLayer:
    """One layer's tensors in the form the stock ops want."""

    def __init__(self, dims: ModelDims, l: int, w, fp8_mode: str):
        def lin(*parts) -> _Lin:
            weight, scale = _merge(parts)
            if scale is not None and fp8_mode == "dequant":
                weight, scale = (weight.float() * scale.reshape(-1, 1)).to(torch.bfloat16), None
            return _Lin(weight, scale)

        def norm_w(t):
            t = t.float()
            return ((1.0 + t) if dims.norm_one_plus else t).to(torch.bfloat16)

        self.attn_norm = norm_w(w.attn_norm)
        self.qkv = lin(w.q_proj, w.k_proj, w.v_proj)
        self.qk_norm = None
        if dims.qk_norm:
            hd = dims.head_dim
            self.qk_norm = torch.cat(
                [norm_w(w.q_norm).expand(dims.num_heads, hd), norm_w(w.k_norm).expand(dims.num_kv_heads, hd)]
            ).contiguous()
        self.o = lin(w.o_proj)
        self.post_norm = norm_w(w.attn_post_norm) if w.attn_post_norm is not None else None
        self.mlp_norm = norm_w(w.mlp_norm)
        self.gate_up = lin(w.gate_proj, w.up_proj)
        self.down = lin(w.down_proj)
        self.mlp_post_norm = norm_w(w.mlp_post_norm) if w.mlp_post_norm is not None else None
        self.rope = dims.rope_for_layer(l)
        self.window = dims.window_for_layer(l)


def rope_tables(dims: ModelDims, num_layers: int, max_position: int, device) -> dict:
    """RoPE spec -> fp32 (cos, sin) ``[max_position, head_dim]`` of positions 0.. for the specs of
    the first ``num_layers`` layers: rounded to bf16 like HF's / vLLM's caches, the sign of
    rotate-half folded into sin."""
    hd, out = dims.head_dim, {}
    pos = torch.arange(max_position, dtype=torch.float32, device=device)
    for l in range(num_layers):
        rope = dims.rope_for_layer(l)
        if rope in out:
            continue
        inv = torch.tensor(rope.inv_freq(hd), dtype=torch.float32, device=device)
        ang = pos[:, None] * inv[None, :]
        cos = ang.cos().to(torch.bfloat16).float()
        sin = ang.sin().to(torch.bfloat16).float()
        out[rope] = (torch.cat([cos, cos], -1).contiguous(), torch.cat([-sin, sin], -1).contiguous())
    return out


class StockDecode:
    """``forward_layer(l, x, meta, kv)`` like a kernel backend; ``prepare(meta)`` once per step
    builds what every layer shares (cache indices of the new tokens, visibility masks)."""

    def __init__(self, dims: ModelDims, weights, max_position: int, device, fp8: str = "auto"):
        self.dims = dims
        self.device = torch.device(device)
        fp8_kind = weights.layers[0].q_proj.kind if weights.layers else "bf16"
        if fp8_kind == "bf16":
            mode, why = "bf16", None
        elif fp8_kind == "fp8" and fp8 == "auto":
            why = scaled_mm_works(self.device)
            mode = "scaled_mm" if why is None else "dequant"
        else:
            mode, why = "dequant", f"{fp8_kind} weights: no row-wise _scaled_mm path here"
        self.fp8_path = {
            "bf16": "bf16 GEMMs (F.linear)",
            "scaled_mm": "W8A8: per-row e4m3 activations, torch._scaled_mm row-wise scales",
            "dequant": f"FP8 weights dequantized to bf16 at setup ({why})",
        }[mode]
        self.layers = [StockLayer(dims, l, w, mode) for l, w in enumerate(weights.layers)]
        self._rope = rope_tables(dims, len(self.layers), max_position, self.device)
        self._step = None

    def alias_model_weights(self, weights) -> int:
        """Point ``weights``' q/k/v and gate/up projections at row slices of this path's merged
        tensors (the same values), so that the model and the stock hold one copy (27B: 34 GB
        less, room for long-context KV caches). Only where the merged tensor has the model's
        dtype (not for FP8 dequantized to bf16). Returns the bytes freed."""
        freed = 0
        for lw, L in zip(weights.layers, self.layers):
            for merged, parts in ((L.qkv, (lw.q_proj, lw.k_proj, lw.v_proj)), (L.gate_up, (lw.gate_proj, lw.up_proj))):
                if merged.weight.dtype != parts[0].weight.dtype or merged.weight.device != parts[0].weight.device:
                    continue
                row = 0
                for lin in parts:
                    n = lin.weight.shape[0]
                    freed += lin.weight.numel() * lin.weight.element_size()
                    lin.weight = merged.weight[row : row + n]
                    row += n
        return freed

    def prepare(self, meta, block_size: int) -> None:
        """Per-step state shared by the layers (device ops only: capturable)."""
        slots = meta.slot_mapping.long()
        blk, off = slots // block_size, slots % block_size
        tables = meta.block_tables.long()
        ctx = tables.shape[1] * block_size
        j = torch.arange(ctx, device=slots.device)
        visible = j[None, :] < meta.seq_lens.long()[:, None]
        masks = {None: visible[:, None, None, :]}
        for layer in self.layers:
            if layer.window is not None and layer.window not in masks:
                win = visible & (j[None, :] > meta.positions[:, None] - layer.window)
                masks[layer.window] = win[:, None, None, :]
        cos_sin = {
            rope: (c.index_select(0, meta.positions), s.index_select(0, meta.positions))
            for rope, (c, s) in self._rope.items()
        }
        self._step = (blk, off, tables, masks, cos_sin)

    def _norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), eps=self.dims.rms_norm_eps) * w

    def forward_layer(self, l: int, x: torch.Tensor, meta, kv) -> torch.Tensor:
        d = self.dims
        L = self.layers[l]
        blk, off, tables, masks, cos_sin = self._step
        rows, hd = x.shape[0], d.head_dim
        nq, nkv = d.num_heads, d.num_kv_heads
        qkv = L.qkv(self._norm(x, L.attn_norm))
        qk = qkv[:, : d.q_size + d.kv_size].view(rows, nq + nkv, hd)
        v = qkv[:, d.q_size + d.kv_size :].view(rows, nkv, hd)
        if L.qk_norm is not None:
            qk = self._norm(qk, L.qk_norm)
        cos, sin = cos_sin[L.rope]
        qf = qk.float()
        rot = qf.view(rows, nq + nkv, 2, hd // 2).flip(2).view(rows, nq + nkv, hd)
        qk = torch.addcmul(qf * cos[:, None, :], rot, sin[:, None, :]).to(torch.bfloat16)
        q, k = qk[:, :nq], qk[:, nq:]
        kc, vc = kv.key[l], kv.value[l]
        kc.index_put_((blk, off), k)
        vc.index_put_((blk, off), v)
        ctx = tables.shape[1] * kv.block_size
        keys = kc[tables].view(rows, ctx, nkv, hd).transpose(1, 2)
        vals = vc[tables].view(rows, ctx, nkv, hd).transpose(1, 2)
        att = F.scaled_dot_product_attention(
            q.reshape(rows, nkv, nq // nkv, hd), keys, vals, attn_mask=masks[L.window], scale=d.attn_scale
        )
        o = L.o(att.reshape(rows, d.q_size))
        if L.post_norm is not None:
            o = self._norm(o, L.post_norm)
        x = x + o
        gu = L.gate_up(self._norm(x, L.mlp_norm))
        g, u = gu[:, : d.intermediate_size], gu[:, d.intermediate_size :]
        a = F.gelu(g, approximate="tanh") if d.activation == "gelu_tanh" else F.silu(g)
        y = L.down(a * u)
        if L.mlp_post_norm is not None:
            y = self._norm(y, L.mlp_post_norm)
        return x + y

    def gemms_only(self, l: int, x_h: torch.Tensor, x_q: torch.Tensor, x_i: torch.Tensor) -> torch.Tensor:
        """Just the layer's GEMMs (QKV, O, gate/up, down; FP8: with their activation quantization)
        on fixed inputs ``[rows, hidden]``, ``[rows, q_size]``, ``[rows, intermediate]``: the floor
        of any per-op path built on these GEMMs."""
        L = self.layers[l]
        L.qkv(x_h)
        L.o(x_q)
        L.gate_up(x_h)
        return L.down(x_i)


# --------------------------------------------------------------------------------------------
# Contiguous-KV stock paths: (a) per-op, (b) each layer's halves torch.compile'd (vLLM's
# piecewise way). The whole-layer fullgraph step is ``fullgraph.FullgraphStockDecode``.
# --------------------------------------------------------------------------------------------


@dataclass
class ContiguousKV:
    """Per-layer K/V caches ``[rows, kv_heads, positions, head_dim]`` holding the positions
    ``start[l] .. context - 1`` of every row: all of them on full-attention layers, only the last
    ``window`` on sliding layers (what a sliding layer can ever read; vLLM's hybrid allocator keeps
    no more either). Every row has the same context (the benchmark's setting), so the positions a
    step reads are the whole tensor: no mask, no slice."""

    key: list[torch.Tensor]
    value: list[torch.Tensor]
    start: list[int]

    @staticmethod
    def first_position(dims: ModelDims, layer: int, context: int) -> int:
        """The first position layer ``layer`` keeps of a ``context``-token row."""
        window = dims.window_for_layer(layer)
        return max(0, context - window) if window else 0

    @classmethod
    def from_paged(cls, dims: ModelDims, kv, meta, context: int) -> ContiguousKV:
        """The same K/V values as the paged cache ``kv`` holds for ``meta``'s rows."""
        tables = meta.block_tables.long()
        key, value, start = [], [], []
        for l, (kc, vc) in enumerate(zip(kv.key, kv.value)):
            lo = cls.first_position(dims, l, context)
            start.append(lo)
            for src, dst in ((kc, key), (vc, value)):
                rows = src[tables].reshape(tables.shape[0], -1, dims.num_kv_heads, dims.head_dim)[:, lo:context]
                dst.append(rows.transpose(1, 2).contiguous())
                del rows
        return cls(key, value, start)

    @classmethod
    def zeros(cls, dims: ModelDims, layers: int, rows: int, context: int, device) -> ContiguousKV:
        """Caches of the same shapes as ``from_paged`` builds, zero-filled."""
        start = [cls.first_position(dims, l, context) for l in range(layers)]
        shapes = [(rows, dims.num_kv_heads, context - lo, dims.head_dim) for lo in start]
        key = [torch.zeros(s, dtype=torch.bfloat16, device=device) for s in shapes]
        value = [torch.zeros(s, dtype=torch.bfloat16, device=device) for s in shapes]
        return cls(key, value, start)


def cache_index(pos: torch.Tensor, start: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """``scatter_`` index along the position dim of a ``[rows, kv_heads, T, head_dim]`` cache for
    each row's new entry (an expanded view: no copy)."""
    return (pos - start).view(-1, 1, 1, 1).expand(pos.shape[0], kv_heads, 1, head_dim)


def write_new_kv(kc, vc, idx, k, v) -> None:
    """Eager: the step's K/V ``[rows, kv_heads, head_dim]`` into the contiguous caches at
    ``cache_index``: one scatter kernel each (``index_put_`` with broadcast indices would first
    make its index tensors contiguous: several small kernels)."""
    kc.scatter_(2, idx, k.unsqueeze(2))
    vc.scatter_(2, idx, v.unsqueeze(2))


def write_new_kv_compiled(kc, vc, pos, start: int, k, v) -> None:
    """Inside a compiled function: the same write as ``index_put_`` (inductor lowers it to one
    kernel per cache and writes the cache in place; it would copy the whole cache around a
    ``scatter_``, which its re-inplacing pass does not cover)."""
    rows, heads = k.shape[0], k.shape[1]
    at = (
        torch.arange(rows, device=k.device)[:, None],
        torch.arange(heads, device=k.device)[None, :],
        (pos - start)[:, None],
    )
    kc.index_put_(at, k)
    vc.index_put_(at, v)


def _rms(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * w


def rope_rows(qk, cos, sin):
    """RoPE in fp32 on ``qk[rows, heads, hd]`` with the rows' bf16-rounded cos/sin (the sign of
    rotate-half folded into ``sin``), rounded once."""
    rows, heads, hd = qk.shape
    qf = qk.float()
    rot = qf.view(rows, heads, 2, hd // 2).flip(2).view(rows, heads, hd)
    return torch.addcmul(qf * cos[:, None, :], rot, sin[:, None, :]).to(torch.bfloat16)


def layer_pre(x, cos, sin, attn_norm, wqkv, sqkv, qk_norm, *, eps, nq, nkv, hd):
    """Norm, QKV GEMM, q/k-norm, RoPE with this step's rows ``cos``/``sin``: q
    ``[rows, heads, 1, hd]``, k and v ``[rows, kv_heads, hd]``."""
    rows = x.shape[0]
    q_size, kv_size = nq * hd, nkv * hd
    qkv = linear(_rms(x, attn_norm, eps), wqkv, sqkv)
    qk = qkv[:, : q_size + kv_size].view(rows, nq + nkv, hd)
    v = qkv[:, q_size + kv_size :].view(rows, nkv, hd)
    if qk_norm is not None:
        qk = _rms(qk, qk_norm, eps)
    qk = rope_rows(qk, cos, sin)
    return qk[:, :nq].unsqueeze(2), qk[:, nq:], v


def layer_pre_at(x, pos, kc, vc, cos_t, sin_t, attn_norm, wqkv, sqkv, qk_norm, *, eps, nq, nkv, hd, start):
    """The compiled path's first half: ``layer_pre`` at positions ``pos`` (RoPE rows gathered
    inside) and the step's K/V written into the caches; returns q."""
    q, k, v = layer_pre(x, cos_t[pos], sin_t[pos], attn_norm, wqkv, sqkv, qk_norm, eps=eps, nq=nq, nkv=nkv, hd=hd)
    write_new_kv_compiled(kc, vc, pos, start, k, v)
    return q


def layer_post(x, att, wo, so, post_norm, mlp_norm, wgu, sgu, wd, sd, mlp_post_norm, *, eps, inter, gelu):
    """O GEMM, (post-attention norm), residual, pre-MLP norm, gate/up GEMM, activation, down GEMM,
    (post-MLP norm), residual."""
    o = linear(att, wo, so)
    if post_norm is not None:
        o = _rms(o, post_norm, eps)
    x = x + o
    gu = linear(_rms(x, mlp_norm, eps), wgu, sgu)
    g, u = gu[:, :inter], gu[:, inter:]
    a = F.gelu(g, approximate="tanh") if gelu else F.silu(g)
    y = linear(a * u, wd, sd)
    if mlp_post_norm is not None:
        y = _rms(y, mlp_post_norm, eps)
    return x + y


def raise_recompile_limit(limit: int = 256) -> None:
    """Every (batch, context, window) shape is one compiled entry of the same function; dynamo's
    default limit (8) would silently fall back to eager after the eighth."""
    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))


class ContiguousStockDecode(StockDecode):
    """Stock decode over contiguous per-row KV caches (``ContiguousKV``): SDPA with ``enable_gqa``
    reads the rows' K/V in place (no gather), the cheapest attention a per-op path can have.

    ``compiled=False``: path (a), plain per-op PyTorch. ``compiled=True``: path (b), each layer's
    two halves around attention ``torch.compile``d (inductor default mode, ``dynamic=False``), the
    KV write inside the first half (one kernel each for K and V, like vLLM's one
    cache-write kernel) and SDPA eager between them, like vLLM's piecewise graphs. Per step only
    what the positions decide is computed (RoPE rows, write index); nothing of the paged path.
    The benchmark captures the whole step in one CUDA graph either way.
    """

    def __init__(
        self,
        dims: ModelDims,
        weights,
        context: int,
        device,
        fp8: str = "auto",
        compiled: bool = False,
        share: StockDecode | None = None,
    ):
        if share is None:
            super().__init__(dims, weights, context, device, fp8)
        else:  # the same merged weights, RoPE tables and FP8 path as ``share`` (no second copy)
            self.dims, self.device, self.fp8_path = dims, share.device, share.fp8_path
            self.layers, self._rope, self._step = share.layers, share._rope, None
        self.context = context
        self.compiled = compiled
        self.cache: ContiguousKV | None = None
        consts = {"eps": dims.rms_norm_eps, "nq": dims.num_heads, "nkv": dims.num_kv_heads, "hd": dims.head_dim}
        post = functools.partial(
            layer_post, eps=dims.rms_norm_eps, inter=dims.intermediate_size, gelu=dims.activation == "gelu_tanh"
        )
        if compiled:
            raise_recompile_limit()
            self._pre = torch.compile(functools.partial(layer_pre_at, **consts), dynamic=False)
            self._post = torch.compile(post, dynamic=False)
        else:
            self._pre, self._post = functools.partial(layer_pre, **consts), post

    @property
    def key(self) -> list[torch.Tensor]:
        return self.cache.key

    @property
    def value(self) -> list[torch.Tensor]:
        return self.cache.value

    def load_cache(self, kv, meta) -> None:
        """This path's contiguous caches, filled from a paged cache's rows (the same K/V values)."""
        self.cache = ContiguousKV.from_paged(self.dims, kv, meta, self.context)

    def prepare(self, meta, block_size: int) -> None:
        """Per step: the positions only (the compiled path gathers its RoPE rows inside)."""
        self._pos = meta.positions
        if self.compiled:
            return
        self._cos_sin = {
            rope: (c.index_select(0, self._pos), s.index_select(0, self._pos)) for rope, (c, s) in self._rope.items()
        }
        d = self.dims
        self._idx = {lo: cache_index(self._pos, lo, d.num_kv_heads, d.head_dim) for lo in set(self.cache.start)}

    def forward_layer(self, l: int, x: torch.Tensor, meta, kv) -> torch.Tensor:
        d = self.dims
        L = self.layers[l]
        kc, vc, start = self.cache.key[l], self.cache.value[l], self.cache.start[l]
        weights = (L.attn_norm, L.qkv.weight, L.qkv.scale, L.qk_norm)
        if self.compiled:
            cos_t, sin_t = self._rope[L.rope]
            q = self._pre(x, self._pos, kc, vc, cos_t, sin_t, *weights, start=start)
        else:
            q, k, v = self._pre(x, *self._cos_sin[L.rope], *weights)
            write_new_kv(kc, vc, self._idx[start], k, v)
        att = F.scaled_dot_product_attention(q, kc, vc, scale=d.attn_scale, enable_gqa=True)
        return self._post(
            x,
            att.reshape(x.shape[0], d.q_size),
            L.o.weight,
            L.o.scale,
            L.post_norm,
            L.mlp_norm,
            L.gate_up.weight,
            L.gate_up.scale,
            L.down.weight,
            L.down.scale,
            L.mlp_post_norm,
        )
