"""K1/K2 arguments: one layer's tensors in kernel form and the launch argument order.

The GPU launcher, the interpreter and the offline compile checks all build their argument lists
here, so the three can never disagree on order or dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from monodecode.errors import ConfigError


@dataclass
class _Layer:
    """One layer's tensors in kernel form (fused QKV; dummies where a variant has no tensor)."""

    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    sqkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    inv_freq: torch.Tensor
    window: int
    wo: torch.Tensor
    so: torch.Tensor
    post_norm: torch.Tensor
    mlp_norm: torch.Tensor
    wg: torch.Tensor
    sg: torch.Tensor
    wu: torch.Tensor
    su: torch.Tensor
    wd: torch.Tensor
    sd: torch.Tensor
    mlp_post_norm: torch.Tensor


def _scale(lin, dummy):
    return lin.scale.contiguous() if lin.scale is not None else dummy


def pack_layer(dims, l: int, w, device) -> _Layer:
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    qkv_w = torch.cat([w.q_proj.weight, w.k_proj.weight, w.v_proj.weight], dim=0).to(device).contiguous()
    if w.q_proj.scale is not None:
        qkv_s = torch.cat([w.q_proj.scale, w.k_proj.scale, w.v_proj.scale]).to(device).contiguous()
    else:
        qkv_s = dummy
    norm = w.attn_norm.to(device).contiguous()
    inv = torch.tensor(dims.rope_for_layer(l).inv_freq(dims.head_dim), dtype=torch.float32, device=device)
    return _Layer(
        attn_norm=norm,
        wqkv=qkv_w,
        sqkv=qkv_s,
        q_norm=(w.q_norm if w.q_norm is not None else w.attn_norm).to(device).contiguous(),
        k_norm=(w.k_norm if w.k_norm is not None else w.attn_norm).to(device).contiguous(),
        inv_freq=inv,
        window=dims.window_for_layer(l) or 0,
        wo=w.o_proj.weight.to(device).contiguous(),
        so=_scale(w.o_proj, dummy).to(device),
        post_norm=(w.attn_post_norm if w.attn_post_norm is not None else w.mlp_norm).to(device).contiguous(),
        mlp_norm=w.mlp_norm.to(device).contiguous(),
        wg=w.gate_proj.weight.to(device).contiguous(),
        sg=_scale(w.gate_proj, dummy).to(device),
        wu=w.up_proj.weight.to(device).contiguous(),
        su=_scale(w.up_proj, dummy).to(device),
        wd=w.down_proj.weight.to(device).contiguous(),
        sd=_scale(w.down_proj, dummy).to(device),
        mlp_post_norm=(w.mlp_post_norm if w.mlp_post_norm is not None else w.mlp_norm).to(device).contiguous(),
    )


# K1 arguments that are KV-cache strides: the compiled kernels assume each is a multiple of 16
# elements (16-byte vector loads; ``offline._signature`` marks them), ``kv_strides`` checks it.
KV_STRIDE_ARGS = ("k_sb", "k_st", "k_sh", "v_sb", "v_st", "v_sh")
KV_STRIDE_MULTIPLE = 16


def kv_strides(kc: torch.Tensor, vc: torch.Tensor, dims, block_size: int) -> list[int]:
    """Block, token and head strides (elements) of one layer's K and V caches, checked.

    Any view of shape ``[num_blocks, block_size, kv_heads, head_dim]`` with a contiguous head_dim
    axis is accepted: the reference's own planes and vLLM 0.33's interleaved K|V views
    (``vllm_plugin.step.kv_views``: token stride kv_heads*2*head_dim, head stride 2*head_dim)."""
    out = []
    for name, t in (("key", kc), ("value", vc)):
        want = (t.shape[0], block_size, dims.num_kv_heads, dims.head_dim)
        if t.dim() != 4 or tuple(t.shape) != want:
            raise ConfigError(
                f"triton kernels: KV {name} cache has shape {tuple(t.shape)}; expected "
                f"[blocks, {block_size}, {dims.num_kv_heads}, {dims.head_dim}]"
            )
        if t.dtype != torch.bfloat16:
            raise ConfigError(f"triton kernels: KV {name} cache is {t.dtype}; the kernels read bf16")
        if t.stride(3) != 1:
            raise ConfigError(
                f"triton kernels: KV {name} cache's head_dim axis is strided ({t.stride(3)}); it must be contiguous"
            )
        strides = [t.stride(0), t.stride(1), t.stride(2)]
        if any(st % KV_STRIDE_MULTIPLE for st in strides) or max(strides) >= 2**31:
            raise ConfigError(
                f"triton kernels: KV {name} cache strides {tuple(t.stride())} must be multiples "
                f"of {KV_STRIDE_MULTIPLE} elements below 2**31"
            )
        out += strides
    if kc.shape[0] != vc.shape[0]:
        raise ConfigError(f"triton kernels: KV key and value caches have {kc.shape[0]} and {vc.shape[0]} blocks")
    return out


def _kv_and_step(kc, vc, kv_st: list[int], meta) -> list:
    """The KV caches, their strides and the step's metadata: the arguments K1 and the attention
    launch share, in their signature order."""
    return [
        kc,
        vc,
        *kv_st,
        meta.positions,
        meta.slot_mapping,
        meta.block_tables,
        meta.block_tables.stride(0),
        meta.seq_lens,
    ]


def k1_args(
    L: _Layer,
    x,
    kc,
    vc,
    kv_st: list[int],
    meta,
    out,
    scratch,
    health,
    prof,
    layer: int,
    spin_limit: int,
    stall: int,
    dims,
) -> list:
    """Runtime arguments of ``k1_kernel`` in signature order (``kv_st`` from ``kv_strides``;
    ``prof``: the int64 timestamp buffer, any int64 tensor when the timestamps are compiled out)."""
    return [
        x,
        L.attn_norm,
        L.wqkv,
        L.sqkv,
        L.q_norm,
        L.k_norm,
        L.inv_freq,
        *_kv_and_step(kc, vc, kv_st, meta),
        out,
        scratch,
        health,
        prof,
        L.window,
        layer,
        spin_limit,
        stall,
        float(dims.rms_norm_eps),
        float(dims.attn_scale),
    ]


def k2_args(
    L: _Layer, x, attn, out, scratch, health, prof, arrive, layer: int, spin_limit: int, nan_fault: int, dims
) -> list:
    """Runtime arguments of ``k2_kernel`` in signature order; ``arrive``: the int32 arrival
    counters of split row tiles (``config.k2_arrive_counters``; at least one)."""
    return [
        x,
        attn,
        L.wo,
        L.so,
        L.post_norm,
        L.mlp_norm,
        L.wg,
        L.sg,
        L.wu,
        L.su,
        L.wd,
        L.sd,
        L.mlp_post_norm,
        out,
        scratch,
        health,
        prof,
        arrive,
        layer,
        spin_limit,
        nan_fault,
        float(dims.rms_norm_eps),
    ]


def ka_args(
    L: _Layer, kc, vc, kv_st: list[int], meta, out, scratch, health, part, arrive, layer: int, spin_limit: int, dims
) -> list:
    """Runtime arguments of ``ka_kernel`` (the attention launch) in signature order; ``part``: the
    fp32 split partials, ``arrive``: the int32 arrival counter of each (row, KV head)."""
    return [
        L.q_norm,
        L.k_norm,
        L.inv_freq,
        *_kv_and_step(kc, vc, kv_st, meta),
        out,
        scratch,
        health,
        part,
        arrive,
        L.window,
        layer,
        spin_limit,
        float(dims.rms_norm_eps),
        float(dims.attn_scale),
    ]
