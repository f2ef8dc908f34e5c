"""K1/K2 arguments: one layer's weights in kernel form, the launch argument order, the launch call.

The offline compile (``offline.py``, placeholder pointers), the run-only check (``bake.py``) and
the launches (``launch.py``, device addresses) all take the argument order and the pointer
element types from here, so they can never disagree: the types are part of the traced IR, hence
of FlyDSL's cache key. A launch is described by a ``LaunchCall`` (addresses, scalars and the
stream) built from tensors by ``k1_call`` / ``k2_call``: pure host code that runs on CPU tensors,
so what a launch would be handed is checked without a GPU.

Stream: every launch goes on the caller's current stream (``current_stream``), the stream vLLM
runs the forward on and captures CUDA/HIP graphs on. FlyDSL's default (no stream argument) is
the NULL stream, which races with vLLM's own kernels and escapes (or breaks) graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from monodecode.kernels.flydsl.kv import KV_STRIDE_ARGS, KVLaunchArgs

# Element type of every pointer argument, in launcher order. ``mbox`` is the width's segment of
# the scratch buffer (mailbox regions, epoch and completion counters), ``health`` the plan's header word,
# ``arrive`` (K2) the width's split-K arrival counters (``Geometry.arrive_counters``, at least one word).
K1_ARGS = (
    ("x", "i32"),
    ("norm_w", "i32"),
    ("w_qkv", "i32"),
    ("s_qkv", "f32"),
    ("q_norm_w", "i32"),
    ("k_norm_w", "i32"),
    ("cos_sin", "f32"),
    ("key_cache", "i32"),
    ("value_cache", "i32"),
    ("block_tables", "i32"),
    ("seq_lens", "i32"),
    ("slots", "i32"),
    ("positions", "i32"),
    ("out_attn", "i16"),
    ("mbox", "i64"),
    ("health", "i32"),
)
# The KV cache strides (``kv.KV_STRIDE_ARGS``) are arguments, not constants: one code object
# serves contiguous caches and vLLM's interleaved K|V views alike.
K1_SCALARS = ("window", "bt_stride", *KV_STRIDE_ARGS, "max_polls", "layer", "stall")
K2_ARGS = (
    ("x", "i32"),
    ("attn", "i32"),
    ("w_o", "i32"),
    ("s_o", "f32"),
    ("post_attn_w", "i32"),
    ("mlp_norm_w", "i32"),
    ("w_gu", "i32"),
    ("s_gu", "f32"),
    ("w_down", "i32"),
    ("s_down", "f32"),
    ("post_mlp_w", "i32"),
    ("out", "i16"),
    ("mbox", "i64"),
    ("health", "i32"),
    ("peers", "i64"),
    ("arrive", "i64"),
)
K2_SCALARS = ("max_polls", "layer", "nan_fault", "rank")
SIGNATURES = {"k1": (K1_ARGS, K1_SCALARS), "k2": (K2_ARGS, K2_SCALARS)}


def pointer(kind: str, address: int | None):
    """A FlyDSL pointer argument of element type ``kind`` (``None``: a compile-time placeholder)."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    dtype = {"i32": fx.Int32, "f32": fx.Float32, "i16": fx.Int16, "i64": fx.Int64}[kind]
    return flyc.from_c_void_p(dtype, address)


def current_stream() -> Any:
    """The stream the launches go on: torch's current stream (vLLM's forward / capture stream)."""
    import torch

    return torch.cuda.current_stream()


@dataclass
class PackedLayer:
    """One layer's tensors in kernel form: q|k|v and gate|up rows fused, FP8 weights as int8 with
    their per-row fp32 scales (1.0 rows for bf16), absent norms as ones."""

    attn_norm: Any
    qkv: tuple[Any, Any]  # (weight, scale)
    q_norm: Any
    k_norm: Any
    o: tuple[Any, Any]
    post_attn: Any
    mlp_norm: Any
    gu: tuple[Any, Any]
    down: tuple[Any, Any]
    post_mlp: Any


def pack_layer(lw: Any, head_dim: int, hidden: int, device: Any) -> PackedLayer:
    """``lw`` (a ``LayerWeights``) in kernel form on ``device``."""
    import torch

    def cat(*lins):
        w = torch.cat([lin.weight for lin in lins], 0).contiguous()
        s = torch.cat([lin.scale for lin in lins], 0) if lins[0].scale is not None else torch.ones(w.shape[0])
        return (w.view(torch.int8) if w.element_size() == 1 else w).to(device), s.float().contiguous().to(device)

    def one(w, n):
        return (w if w is not None else torch.ones(n, dtype=torch.bfloat16)).to(device).contiguous()

    return PackedLayer(
        attn_norm=one(lw.attn_norm, hidden),
        qkv=cat(lw.q_proj, lw.k_proj, lw.v_proj),
        q_norm=one(lw.q_norm, head_dim),
        k_norm=one(lw.k_norm, head_dim),
        o=cat(lw.o_proj),
        post_attn=one(lw.attn_post_norm, hidden),
        mlp_norm=one(lw.mlp_norm, hidden),
        gu=cat(lw.gate_proj, lw.up_proj),
        down=cat(lw.down_proj),
        post_mlp=one(lw.mlp_post_norm, hidden),
    )


def _address(v: Any) -> int:
    return v if isinstance(v, int) else v.data_ptr()


@dataclass(frozen=True)
class LaunchCall:
    """Everything one launch is handed: pointer arguments ``(name, element type, address)`` and
    scalars ``(name, value)`` in launcher order, and the stream it goes on."""

    kernel: str  # "k1" | "k2"
    pointers: tuple[tuple[str, str, int], ...]
    scalars: tuple[tuple[str, int], ...]
    stream: Any

    def flydsl_args(self) -> list:
        """The launcher's positional arguments (FlyDSL pointers, then Python ints)."""
        return [pointer(kind, addr) for _, kind, addr in self.pointers] + [v for _, v in self.scalars]

    def launch(self, launcher: Any) -> Any:
        return launcher(*self.flydsl_args(), stream=self.stream)


def _call(kernel: str, pointers: dict[str, Any], scalars: dict[str, int], stream: Any) -> LaunchCall:
    args, names = SIGNATURES[kernel]
    if set(pointers) != {n for n, _ in args} or set(scalars) != set(names):
        raise ValueError(
            f"flydsl {kernel}: launch arguments {sorted(pointers) + sorted(scalars)} are not its signature"
        )
    return LaunchCall(
        kernel,
        tuple((n, kind, _address(pointers[n])) for n, kind in args),
        tuple((n, int(scalars[n])) for n in names),
        stream,
    )


def k1_call(
    lw: PackedLayer,
    x: Any,
    cos_sin: Any,
    cache: KVLaunchArgs,
    block_tables: Any,
    seq_lens: Any,
    slots: Any,
    positions: Any,
    out: Any,
    mbox: int,
    health: int,
    *,
    window: int,
    max_polls: int,
    layer: int,
    stall: int,
    stream: Any,
) -> LaunchCall:
    """K1 of one layer (``block_tables``/``seq_lens`` int32, ``slots``/``positions`` int64)."""
    return _call(
        "k1",
        {
            "x": x,
            "norm_w": lw.attn_norm,
            "w_qkv": lw.qkv[0],
            "s_qkv": lw.qkv[1],
            "q_norm_w": lw.q_norm,
            "k_norm_w": lw.k_norm,
            "cos_sin": cos_sin,
            "key_cache": cache.key_addr,
            "value_cache": cache.value_addr,
            "block_tables": block_tables,
            "seq_lens": seq_lens,
            "slots": slots,
            "positions": positions,
            "out_attn": out,
            "mbox": mbox,
            "health": health,
        },
        {
            "window": window,
            "bt_stride": block_tables.shape[1],
            **cache.named(),
            "max_polls": max_polls,
            "layer": layer,
            "stall": stall,
        },
        stream,
    )


def k2_call(
    lw: PackedLayer,
    x: Any,
    attn: Any,
    out: Any,
    mbox: int,
    health: int,
    arrive: Any,
    *,
    max_polls: int,
    layer: int,
    nan_fault: int,
    stream: Any,
) -> LaunchCall:
    """K2 of one layer at TP 1 (the peer-buffer table is unused: ``mbox`` stands in, rank 0);
    ``arrive``: the width's int64 split-K arrival counters."""
    return _call(
        "k2",
        {
            "x": x,
            "attn": attn,
            "w_o": lw.o[0],
            "s_o": lw.o[1],
            "post_attn_w": lw.post_attn,
            "mlp_norm_w": lw.mlp_norm,
            "w_gu": lw.gu[0],
            "s_gu": lw.gu[1],
            "w_down": lw.down[0],
            "s_down": lw.down[1],
            "post_mlp_w": lw.post_mlp,
            "out": out,
            "mbox": mbox,
            "health": health,
            "peers": mbox,
            "arrive": arrive,
        },
        {"max_polls": max_polls, "layer": layer, "nan_fault": nan_fault, "rank": 0},
        stream,
    )
