"""The strongest stock decode step PyTorch alone builds: each decoder layer one
``torch.compile(fullgraph=True, dynamic=False)`` function, the whole step one CUDA graph.

One compiled function per layer does all of it: RMSNorm, the merged QKV GEMM, q/k-norm (Gemma,
Qwen3), RoPE in fp32, the step's K/V written into contiguous caches (one in-place index_put each,
``stock.ContiguousKV``: sliding layers hold only their window), SDPA with ``enable_gqa`` over the
caches in place (flash decoding splits the context over the SMs), the O GEMM, Gemma's
post-attention norm, the residual, the pre-MLP norm, the merged gate/up GEMM, SiLU or GELU-tanh
times up, the down GEMM, Gemma's post-MLP norm and the residual. Inductor fuses the pointwise
work into the GEMMs' neighbours; nothing runs eagerly between layers.

The math is the reference's (``monodecode.model.reference``): the same norms (Gemma's ``1 + w`` in
fp32), rounding points and activation, so the comparison with the kernels is like for like.
FP8 weights run W8A16: ``F.linear(x, w_e4m3.to(bf16)) * scale``; with inductor's
``coordinate_descent_tuning`` (``tuning=True``) a one-row GEMM becomes a fused reduction that
dequantizes in its loads and reads one byte per weight; with more rows inductor materializes the
bf16 weight first (slow: the BF16 stock is then the honest bar for FP8).
"""

from __future__ import annotations

import functools
import statistics

import torch
import torch.nn.functional as F

from monodecode.errors import exception_line
from monodecode.model import reference as R
from monodecode.model.dims import ModelDims
from monodecode_ops.decode_bench.stock import (
    ContiguousStockDecode,
    StockDecode,
    StockLayer,
    raise_recompile_limit,
    rope_rows,
    rope_tables,
    write_new_kv_compiled,
)
from monodecode_ops.decode_bench.w8a16 import w8a16_linear

# The fullgraph stocks by backend name: ``FullgraphStockDecode``'s keyword arguments.
FULLGRAPH_STOCKS = {
    "stock-fullgraph": {},
    "stock-fullgraph-cdt": {"tuning": True},
    "stock-fullgraph-cdt-wide": {"tuning": True, "wide_search": True},
    "stock-fullgraph-max": {"tuning": True, "max_autotune": True},
    "stock-fullgraph-splitk": {"splitk": True},
}


# Coordinate descent's wider search (``wide_search``): two steps of each field at a time, not one,
# and every combination of directions. One search lands in configurations 5-26 % apart from one
# compile to the next (FP8 1k x 1: 0.827 and 0.871 ms in run 165, 1.041 and 1.126 in run 167).
WIDE_SEARCH = {"coordinate_descent_search_radius": 2, "coordinate_descent_check_all_directions": True}


def inductor_options(tuning: bool = False, max_autotune: bool = False, wide_search: bool = False) -> dict | None:
    """``torch.compile`` options of a fullgraph stock: inductor's coordinate descent (``tuning``;
    ``wide_search``: ``WIDE_SEARCH`` too) and its GEMM template search (``max_autotune``)."""
    return (
        ({"coordinate_descent_tuning": True} | (WIDE_SEARCH if wide_search else {}) if tuning else {})
        | ({"max_autotune": True} if max_autotune else {})
    ) or None


def tuning_draws(run_draw, draws: int, reset: bool = True) -> tuple[list, list[str]]:
    """``run_draw()`` (compile, capture, time: a tuned stock's one draw) ``draws`` times, dynamo's
    compiled code dropped before each (``reset``); the draws after the first with inductor's caches
    off, so each compiles and tunes afresh (coordinate descent and max-autotune land on different
    configurations from one tuning to the next). The first keeps the caller's cache setting (a
    prewarmed cache, ``TORCHINDUCTOR_FORCE_DISABLE_CACHES``). Returns (each draw's result, each
    later draw's failure in one line); a failing first draw raises."""
    import contextlib

    import torch._inductor.config as inductor_config

    got, failed = [], []
    for d in range(draws):
        if reset:
            torch._dynamo.reset()
        try:
            with inductor_config.patch(force_disable_caches=True) if d else contextlib.nullcontext():
                got.append(run_draw())
        except Exception as e:  # noqa: BLE001 - a later draw that fails leaves the earlier ones' numbers
            if d == 0:
                raise
            failed.append(f"draw {d}: {exception_line(e, 200)}")
    return got, failed


def fastest_draw(draws: list[tuple]) -> tuple:
    """Of ``(times, ...)`` per draw of one stock, the one with the lowest median time (the first of
    equals): a tuned stock's bar is its best tuning, not whichever came first."""
    return min(draws, key=lambda d: statistics.median(d[0]))


def linear_widened(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """bf16 ``F.linear``, or W8A16: the e4m3 weight widened to bf16 in the GEMM, times the
    per-output-channel scale in fp32, rounded once."""
    if scale is None:
        return F.linear(x, weight)
    return (F.linear(x, weight.to(x.dtype)).float() * scale).to(x.dtype)


def fullgraph_layer(
    x, pos, kc, vc, cos_t, sin_t,
    attn_norm, wqkv, sqkv, q_norm, k_norm, wo, so, attn_post_norm, mlp_norm, wgu, sgu, wd, sd, mlp_post_norm,
    *, eps, one_plus, nq, nkv, hd, inter, gelu, scale, start, lin=None,
):  # fmt: skip
    """One whole decoder layer at positions ``pos`` (see the module doc); returns the new residual.
    ``lin``: the projection (default ``linear_widened``)."""
    rows, dt = x.shape[0], x.dtype
    proj = lin or linear_widened
    h = R.rms_norm(x, attn_norm, eps, one_plus)
    qkv = proj(h, wqkv, sqkv)
    q = qkv[:, : nq * hd].view(rows, nq, hd)
    k = qkv[:, nq * hd : (nq + nkv) * hd].view(rows, nkv, hd)
    v = qkv[:, (nq + nkv) * hd :].view(rows, nkv, hd)
    if q_norm is not None:
        q = R.rms_norm(q, q_norm, eps, one_plus)
        k = R.rms_norm(k, k_norm, eps, one_plus)
    cos, sin = cos_t[pos], sin_t[pos]
    q, k = rope_rows(q, cos, sin), rope_rows(k, cos, sin)
    write_new_kv_compiled(kc, vc, pos, start, k, v)
    att = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, scale=scale, enable_gqa=True)
    o = proj(att.reshape(rows, nq * hd), wo, so)
    if attn_post_norm is not None:
        o = R.rms_norm(o, attn_post_norm, eps, one_plus)
    x = (x.float() + o.float()).to(dt)
    gu = proj(R.rms_norm(x, mlp_norm, eps, one_plus), wgu, sgu)
    g, u = gu[:, :inter].float(), gu[:, inter:]
    a = (F.gelu(g, approximate="tanh") if gelu else F.silu(g)).to(dt)
    y = proj((a.float() * u.float()).to(dt), wd, sd)
    if mlp_post_norm is not None:
        y = R.rms_norm(y, mlp_post_norm, eps, one_plus)
    return (x.float() + y.float()).to(dt)


class FullgraphStockDecode(ContiguousStockDecode):
    """``forward_layer(l, x, meta, kv)`` like a kernel backend, over this path's ``ContiguousKV``
    (``load_cache``). ``tuning=True``: compiled with inductor's ``coordinate_descent_tuning`` (that
    compile only; ``wide_search=True``: its search ``WIDE_SEARCH``); ``max_autotune=True`` as well
    with ``max_autotune`` (inductor times its Triton GEMM templates against cuBLAS for each projection's shape and keeps the fastest). ``splitk=True``: FP8 projections through ``w8a16.w8a16_linear`` (one read of the
    e4m3 weights at any batch). ``prepare`` takes the step's positions and builds nothing."""

    def __init__(
        self,
        dims: ModelDims,
        weights,
        context: int,
        device,
        tuning: bool = False,
        max_autotune: bool = False,
        share: StockDecode | None = None,
        splitk: bool = False,
        wide_search: bool = False,
    ):
        fp8 = bool(weights.layers) and weights.layers[0].q_proj.kind != "bf16"
        # the merged e4m3 weights and scales of a W8A8 stock serve W8A16 as they are
        if share is not None and (not fp8 or share.layers[0].qkv.scale is not None):
            self.layers, self._rope = share.layers, share._rope
        else:
            self._rope = rope_tables(dims, len(weights.layers), context, device)
            self.layers = [StockLayer(dims, l, w, "scaled_mm" if fp8 else "bf16") for l, w in enumerate(weights.layers)]
        self.dims, self.device, self._step = dims, torch.device(device), None
        self.fp8_path = "bf16 GEMMs (F.linear)"
        if fp8:
            self.fp8_path = (
                "W8A16: split-K Triton GEMM reading e4m3 weights (w8a16.py)"
                if splitk
                else "W8A16: e4m3 weights widened to bf16 in the GEMM (F.linear(x, w.to(bf16)) * s)"
            )
        self.norms = [
            (w.attn_norm, w.q_norm, w.k_norm, w.attn_post_norm, w.mlp_norm, w.mlp_post_norm) for w in weights.layers
        ]
        self.context, self.compiled, self.tuning = context, True, tuning
        self.cache = None
        consts = {
            "eps": dims.rms_norm_eps,
            "one_plus": dims.norm_one_plus,
            "nq": dims.num_heads,
            "nkv": dims.num_kv_heads,
            "hd": dims.head_dim,
            "inter": dims.intermediate_size,
            "gelu": dims.activation == "gelu_tanh",
            "scale": dims.attn_scale,
            "lin": w8a16_linear if splitk else linear_widened,
        }
        raise_recompile_limit()
        self._layer = torch.compile(
            functools.partial(fullgraph_layer, **consts),
            fullgraph=True,
            dynamic=False,
            options=inductor_options(tuning, max_autotune, wide_search),
        )

    def prepare(self, meta, block_size: int) -> None:
        self._pos = meta.positions

    def forward_layer(self, l: int, x: torch.Tensor, meta, kv) -> torch.Tensor:
        L = self.layers[l]
        attn_norm, q_norm, k_norm, attn_post_norm, mlp_norm, mlp_post_norm = self.norms[l]
        cos_t, sin_t = self._rope[L.rope]
        return self._layer(
            x, self._pos, self.cache.key[l], self.cache.value[l], cos_t, sin_t,
            attn_norm, L.qkv.weight, L.qkv.scale, q_norm, k_norm, L.o.weight, L.o.scale, attn_post_norm,
            mlp_norm, L.gate_up.weight, L.gate_up.scale, L.down.weight, L.down.scale, mlp_post_norm,
            start=self.cache.start[l],
        )  # fmt: skip
