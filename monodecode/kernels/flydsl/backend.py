"""The ``flydsl`` kernel backend: baked K1/K2 code for gfx942 / gfx950, loaded without compiling.

Build = look the build key up in the ArtifactStore (sha256 of every file verified), stage the
FlyDSL cache entries into a private writable directory and bind every width's launchers with
``FLYDSL_RUNTIME_RUN_ONLY=1`` (trace + cache hit, never lower). Without an artifact the build
refuses with ``no_artifact`` unless the config allows JIT, in which case the same compile as
``monodecode-ops precompile`` runs (in a subprocess) into that private directory first.

Device side (ROCm only): weights are laid out once per layer (q|k|v and gate|up fused row-wise,
FP8 scales as fp32 rows), the RoPE cos/sin tables are built with the reference's rounding, and one
scratch buffer is laid out by the shared plan (``kernels/plan.py`` ``plan_model``: the sticky
health word, then a disjoint segment of tagged mailbox regions and epoch counters per width).
Nothing here imports FlyDSL or AITER until ``build`` runs on a ROCm device.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from monodecode.errors import RefusalError
from monodecode.kernels.base import BuildRequest, DecodeKernels, KernelBackend
from monodecode.kernels.flydsl.arch import ARCHS
from monodecode.kernels.padded import TwoLaunchKernels
from monodecode.services.platform import Platform


def _fp8_kind_for(arch: str) -> str:
    return ARCHS[arch].fp8_kind


class FlyDSLBackend(KernelBackend):
    name: ClassVar[str] = "flydsl"
    needs_artifacts: ClassVar[bool] = True

    @classmethod
    def unavailable_reason(cls, platform: Platform) -> str | None:
        if platform.kind != "rocm" or platform.arch not in ARCHS:
            return f"flydsl targets gfx942/gfx950 ROCm GPUs; this is {platform.kind} {platform.arch}"
        if not platform.torch_usable:  # e.g. seen only in sysfs by a CPU build of torch: nothing could launch
            return (
                f"torch cannot launch on {platform.name} ({platform.arch}): a CPU build of torch or no "
                "/dev/kfd access; flydsl launches through a ROCm torch"
            )
        if importlib.util.find_spec("flydsl") is None:
            return "the flydsl package is not installed (pip extra 'flydsl')"
        need = ARCHS[platform.arch].compute_units
        if platform.compute_units < need:
            return (
                f"only {platform.compute_units} compute units visible (partition mode "
                f"{platform.partition_mode or 'unknown'}); the persistent grid needs all {need} resident"
            )
        return None

    def kernel_spec(self, platform: Platform, widths: tuple[int, ...]):
        from monodecode.spec import KernelSpec

        spec = ARCHS.get(platform.arch)
        return KernelSpec(
            backend=self.name,
            platform_kinds=("rocm",),
            archs=tuple(ARCHS),
            tp_sizes=(1,),
            grid_size=spec.compute_units if spec else None,
            widths=tuple(widths),
            weight_dtypes=("bf16", spec.fp8_kind) if spec else ("bf16",),
            block_sizes=None,
        )

    def compiler_version(self) -> str:
        from monodecode.kernels.flydsl.bake import compiler_version

        return compiler_version()

    def build_key(self, req: BuildRequest) -> str:
        from monodecode.kernels.flydsl.bake import flydsl_build_key

        return flydsl_build_key(
            req.platform.arch, req.dims, req.weight_dtype, req.widths, req.block_size, req.tp_size, req.kv_dtype
        )

    def _refusals(self, req: BuildRequest) -> list[str]:
        reasons = []
        why = self.unavailable_reason(req.platform)
        if why:
            reasons.append(f"backend_unavailable: {why}")
        if req.tp_size != 1:
            reasons.append(
                f"tp_size: flydsl K1/K2 for TP {req.tp_size} compile (precompile --tp-size), but the "
                "runtime does not yet give the backend its rank and the peer buffers of the other ranks"
            )
        if req.kv_dtype not in ("bf16", "auto", "bfloat16"):
            reasons.append(f"kv_dtype: flydsl reads a bf16 KV cache, not {req.kv_dtype}")
        arch = req.platform.arch
        if arch in ARCHS and req.weight_dtype != "bf16" and req.weight_dtype != _fp8_kind_for(arch):
            reasons.append(f"weight_dtype: {arch} decodes {_fp8_kind_for(arch)} FP8 weights, not {req.weight_dtype}")
        return reasons

    def build(self, req: BuildRequest, weights: Any, artifacts: Any, allow_jit: bool) -> DecodeKernels:
        from monodecode.errors import ArtifactError
        from monodecode.kernels.flydsl import bake

        reasons = self._refusals(req)
        if reasons:
            raise RefusalError(reasons)
        key = self.build_key(req)
        run_dir = Path(tempfile.mkdtemp(prefix="monodecode-flydsl-run-"))
        entry = None
        if artifacts is not None:
            try:
                entry = artifacts.lookup(key)
            except ArtifactError as e:
                raise RefusalError(f"artifact_checksum: {e}") from None
        if entry is not None:
            bake.stage_run_cache(entry, run_dir)
        elif allow_jit:
            from monodecode.kernels.flydsl.compile import compile_in_subprocess

            compile_in_subprocess(
                req.platform.arch, req.dims, list(req.widths), req.weight_dtype, req.block_size, run_dir
            )
        else:
            where = f"in {artifacts.root}" if artifacts is not None else "(no artifact_dir configured)"
            raise RefusalError(
                f"no_artifact: no baked flydsl artifact for build key {key[:16]} {where} and allow_jit is false"
            )
        return FlyDSLKernels(req, weights, run_dir)


class FlyDSLKernels(TwoLaunchKernels):
    """Launch-ready K1/K2 for every width (ROCm device; run-only FlyDSL cache).

    K1 addresses K/V through the caches' strides, passed per launch (``kv.py``): the reference's
    contiguous cache and vLLM 0.33's interleaved K|V views run the same code object.

    One scratch buffer laid out by the shared plan (``plan_model``): the health word at the
    header's offset, then one segment per width with its epoch counters and mailbox regions;
    each launch gets its width's segment and the health word. Nothing is zeroed between steps
    (tags come from the on-device launch counters), so the launches are graph-capturable."""

    kv_strided = True  # read by vllm_plugin.step.kv_reason_for_backend
    kernel_label = "flydsl kernels"

    def __init__(self, req: BuildRequest, weights: Any, cache_dir: Path):
        import torch

        from monodecode.kernels.flydsl.compile import Specialisation, launchers
        from monodecode.kernels.flydsl.geometry import HEALTH, model_plan
        from monodecode.kernels.flydsl.toolchain import arch_env
        from monodecode.model.reference import rope_cos_sin

        self.req, self.dims, self.widths = req, req.dims, req.widths
        self.arch = req.platform.arch
        self.cache_dir = cache_dir
        self.device = weights.embed.device
        dev = self.device
        self._specs = {
            w: Specialisation(self.arch, self.dims, w, req.weight_dtype, req.block_size) for w in self.widths
        }
        self.plan = model_plan(self.dims, self.arch, self.widths, req.tp_size)
        self._scratch = torch.zeros(self.plan.scratch.nbytes // 8, dtype=torch.int64, device=dev)
        base = self._scratch.data_ptr()
        self.health_word = self._scratch.view(torch.int32)[self.plan.scratch.header[HEALTH].offset // 4 :][:1]
        self._health_addr = base + self.plan.scratch.header[HEALTH].offset
        self._segment = {w: base + self.plan.scratch.widths[w].offset for w in self.widths}
        # ~1 us per poll (sc1 load + s_sleep 1): the wait bound in polls
        self._max_polls = max(1, int(req.wait_timeout_s * 1e6))
        self._kv_cache_args: dict[int, tuple] = {}
        self._launch: dict[int, tuple[Any, Any]] = {}
        with arch_env(self.arch, cache_dir, run_only=True):
            for w, spec in self._specs.items():
                self._launch[w] = launchers(spec)
        # weights, fused once: q|k|v rows, gate|up rows; FP8 scales as fp32 rows (1.0 for bf16)
        self._layers = []
        for lw in weights.layers:

            def cat(*lins):
                w_ = torch.cat([lin.weight for lin in lins], 0).contiguous()
                s_ = torch.cat([lin.scale for lin in lins], 0) if lins[0].scale is not None else torch.ones(w_.shape[0])
                return w_.view(torch.int8) if w_.element_size() == 1 else w_, s_.float().contiguous().to(dev)

            def one(w_, n):
                return (w_ if w_ is not None else torch.ones(n, dtype=torch.bfloat16)).to(dev).contiguous()

            hd, hid = self.dims.head_dim, self.dims.hidden_size
            self._layers.append(
                {
                    "attn_norm": one(lw.attn_norm, hid),
                    "qkv": cat(lw.q_proj, lw.k_proj, lw.v_proj),
                    "q_norm": one(lw.q_norm, hd),
                    "k_norm": one(lw.k_norm, hd),
                    "o": cat(lw.o_proj),
                    "post_attn": one(lw.attn_post_norm, hid),
                    "mlp_norm": one(lw.mlp_norm, hid),
                    "gu": cat(lw.gate_proj, lw.up_proj),
                    "down": cat(lw.down_proj),
                    "post_mlp": one(lw.mlp_post_norm, hid),
                }
            )
        positions = torch.arange(self.dims.max_position_embeddings, device=dev)
        self._cos_sin = {}
        for kind in {self.dims.rope_for_layer(l) for l in range(self.dims.num_layers)}:
            cos, sin = rope_cos_sin(kind, self.dims.head_dim, positions, torch.bfloat16)
            half = self.dims.head_dim // 2
            self._cos_sin[kind] = torch.cat([cos[:, :half], sin[:, :half]], 1).float().contiguous()

    # ---- launches
    def _kv_args(self, layer: int, key, value):
        """K1's cache addresses and word strides for ``layer`` (``kv.kv_launch_args``; a layout K1
        cannot address is a ``kv_layout`` ConfigError), kept while the same views come back."""
        from monodecode.kernels.flydsl.kv import kv_launch_args

        sig = (key.data_ptr(), tuple(key.shape), key.stride(), value.data_ptr(), value.stride())
        have = self._kv_cache_args.get(layer)
        if have is None or have[0] != sig:
            have = (sig, kv_launch_args(key, value, self.dims.num_kv_heads, self.dims.head_dim, self.req.block_size))
            self._kv_cache_args[layer] = have
        return have[1]

    def check_kv(self, kv) -> None:
        for layer in range(len(kv.key)):
            self._kv_args(layer, kv.key[layer], kv.value[layer])

    def _ptr(self, kind: str, t) -> Any:
        from monodecode.kernels.flydsl.compile import pointer

        return pointer(kind, t if isinstance(t, int) else t.data_ptr())

    def _launch_k1(self, layer, x, meta, kv, width, stall=0):
        import torch

        from monodecode.kernels.flydsl.toolchain import arch_env

        lw, p = self._layers[layer], self._ptr
        out = torch.empty(width, self.dims.q_size, dtype=torch.bfloat16, device=self.device)
        window = self.dims.window_for_layer(layer) or 0
        bt = meta.block_tables.to(torch.int32).contiguous()
        cache = self._kv_args(layer, kv.key[layer], kv.value[layer])
        with arch_env(self.arch, self.cache_dir, run_only=True):
            self._launch[width][0](
                p("i32", x),
                p("i32", lw["attn_norm"]),
                p("i32", lw["qkv"][0]),
                p("f32", lw["qkv"][1]),
                p("i32", lw["q_norm"]),
                p("i32", lw["k_norm"]),
                p("f32", self._cos_sin[self.dims.rope_for_layer(layer)]),
                p("i32", cache.key_addr),
                p("i32", cache.value_addr),
                p("i32", bt),
                p("i32", meta.seq_lens.to(torch.int32).contiguous()),
                p("i32", meta.slot_mapping.to(torch.int64).contiguous()),
                p("i32", meta.positions.to(torch.int64).contiguous()),
                p("i16", out),
                p("i64", self._segment[width]),
                p("i32", self._health_addr),
                window,
                bt.shape[1],
                *cache.scalars(),
                self._max_polls,
                layer,
                stall,
            )
        return out

    def _launch_k2(self, layer, x, attn, width, nan_fault=0):
        import torch

        from monodecode.kernels.flydsl.toolchain import arch_env

        lw, p = self._layers[layer], self._ptr
        out = torch.empty_like(x)
        with arch_env(self.arch, self.cache_dir, run_only=True):
            self._launch[width][1](
                p("i32", x),
                p("i32", attn),
                p("i32", lw["o"][0]),
                p("f32", lw["o"][1]),
                p("i32", lw["post_attn"]),
                p("i32", lw["mlp_norm"]),
                p("i32", lw["gu"][0]),
                p("f32", lw["gu"][1]),
                p("i32", lw["down"][0]),
                p("f32", lw["down"][1]),
                p("i32", lw["post_mlp"]),
                p("i16", out),
                p("i64", self._segment[width]),
                p("i32", self._health_addr),
                p("i64", self._segment[width]),  # peer-buffer address table: unused at TP 1
                self._max_polls,
                layer,
                nan_fault,
                0,
            )
        return out

    def close(self) -> None:
        self._launch.clear()
        self._layers = []
