"""Host side of the FlyDSL K1/K2: packed weights, RoPE tables, the scratch buffer, and the launches.

Everything a launch touches has a fixed device address after build, and nothing on the host
depends on device values, so ``forward_layer`` can be captured in a graph and replayed. Every
launch goes on the current stream (``args.current_stream``). Constructing ``FlyDSLKernels`` only
lays tensors out (it runs on CPU tensors too); ``bind`` loads the launchers from a run-only
FlyDSL cache and needs the ROCm toolchain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from monodecode.errors import ConfigError
from monodecode.kernels.base import BuildRequest
from monodecode.kernels.flydsl import args as launch_args
from monodecode.kernels.padded import TwoLaunchKernels


class FlyDSLKernels(TwoLaunchKernels):
    """Launch-ready K1/K2 for every width (ROCm device; run-only FlyDSL cache).

    K1 addresses K/V through the caches' strides, passed per launch (``kv.py``): the reference's
    contiguous cache and vLLM 0.33's interleaved K|V views run the same code object.

    One scratch buffer laid out by the shared plan (``plan_model``): the health word at the
    header's offset, then one segment per width with its epoch counters and mailbox regions;
    each launch gets its width's segment and the health word. Nothing is zeroed between steps
    (tags come from the on-device launch counters), so the launches are graph-capturable.

    Per width, K2's split-K arrival counters (``Geometry.arrive_counters``, int64, at least one):
    a tensor of their own, zeroed once here and never again. Not words of the plan's scratch
    segment, which both backends share and test against the plan (a region for one backend's
    merge would change the other's layout), and not settled at the launch's exit with the stage
    counters: they are monotonic (each launch of any layer adds exactly ``k_splits`` per tile), so
    they need no reset and a graph replays them as they are. The Triton backend does the same."""

    kernel_label = "flydsl kernels"

    def __init__(self, req: BuildRequest, weights: Any):
        import torch

        from monodecode.kernels.flydsl.arch import arch_spec
        from monodecode.kernels.flydsl.config import HEALTH, model_plan, plan_geometry
        from monodecode.model.reference import rope_cos_sin

        self.req, self.dims, self.widths = req, req.dims, req.widths
        self.arch = req.platform.arch
        self.cache_dir: Path | None = None
        self.device = weights.embed.device
        dev = self.device
        self.plan = model_plan(self.dims, self.arch, self.widths, req.tp_size)
        self._scratch = torch.zeros(self.plan.scratch.nbytes // 8, dtype=torch.int64, device=dev)
        base = self._scratch.data_ptr()
        self.health_word = self._scratch.view(torch.int32)[self.plan.scratch.header[HEALTH].offset // 4 :][:1]
        self._health_addr = base + self.plan.scratch.header[HEALTH].offset
        self._segment = {w: base + self.plan.scratch.widths[w].offset for w in self.widths}
        spec = arch_spec(self.arch)
        self._arrive = {
            w: torch.zeros(
                max(1, plan_geometry(self.dims, w, spec, req.weight_dtype, req.tp_size).arrive_counters),
                dtype=torch.int64,
                device=dev,
            )
            for w in self.widths
        }
        # ~1 us per poll (sc1 load + s_sleep 1): the wait bound in polls
        self._max_polls = max(1, int(req.wait_timeout_s * 1e6))
        self._kv_cache_args: dict[int, tuple] = {}
        self._launch: dict[int, tuple[Any, Any]] = {}
        hd, hid = self.dims.head_dim, self.dims.hidden_size
        self._layers = [launch_args.pack_layer(lw, hd, hid, dev) for lw in weights.layers]
        positions = torch.arange(self.dims.max_position_embeddings, device=dev)
        self._cos_sin = {}
        for kind in {self.dims.rope_for_layer(l) for l in range(self.dims.num_layers)}:
            cos, sin = rope_cos_sin(kind, hd, positions, torch.bfloat16)
            self._cos_sin[kind] = torch.cat([cos[:, : hd // 2], sin[:, : hd // 2]], 1).float().contiguous()

    def bind(self, cache_dir: Path) -> None:
        """Load every width's launchers from the run-only FlyDSL cache in ``cache_dir``."""
        from monodecode.kernels.flydsl.offline import Specialisation, launchers
        from monodecode.kernels.flydsl.toolchain import arch_env

        self.cache_dir = cache_dir
        with arch_env(self.arch, cache_dir, run_only=True):
            for w in self.widths:
                spec = Specialisation(self.arch, self.dims, w, self.req.weight_dtype, self.req.block_size)
                self._launch[w] = launchers(spec)

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

    def k1_call(self, layer, x, meta, kv, width, stall=0) -> tuple[launch_args.LaunchCall, Any, tuple]:
        """K1's launch call for ``layer`` on ``width`` padded rows, its output tensor, and the
        argument tensors made for it (kept alive until the launch is issued)."""
        import torch

        out = torch.empty(width, self.dims.q_size, dtype=torch.bfloat16, device=self.device)
        bt = meta.block_tables.to(torch.int32).contiguous()
        made = (
            bt,
            meta.seq_lens.to(torch.int32).contiguous(),
            meta.slot_mapping.to(torch.int64).contiguous(),
            meta.positions.to(torch.int64).contiguous(),
        )
        call = launch_args.k1_call(
            self._layers[layer],
            x,
            self._cos_sin[self.dims.rope_for_layer(layer)],
            self._kv_args(layer, kv.key[layer], kv.value[layer]),
            *made,
            out,
            self._segment[width],
            self._health_addr,
            window=self.dims.window_for_layer(layer) or 0,
            max_polls=self._max_polls,
            layer=layer,
            stall=stall,
            stream=launch_args.current_stream(),
        )
        return call, out, made

    def k2_call(self, layer, x, attn, width, nan_fault=0) -> tuple[launch_args.LaunchCall, Any]:
        """K2's launch call for ``layer`` on ``width`` padded rows, and its output tensor."""
        import torch

        out = torch.empty_like(x)
        call = launch_args.k2_call(
            self._layers[layer],
            x,
            attn,
            out,
            self._segment[width],
            self._health_addr,
            self._arrive[width],
            max_polls=self._max_polls,
            layer=layer,
            nan_fault=nan_fault,
            stream=launch_args.current_stream(),
        )
        return call, out

    def _issue(self, call: launch_args.LaunchCall, width: int, which: int) -> None:
        from monodecode.kernels.flydsl.toolchain import arch_env

        if width not in self._launch:
            raise ConfigError(f"{self.kernel_label}: width {width} has no bound launchers (bind() not run)")
        with arch_env(self.arch, self.cache_dir, run_only=True):
            call.launch(self._launch[width][which])

    def _launch_k1(self, layer, x, meta, kv, width, stall=0):
        call, out, _made = self.k1_call(layer, x, meta, kv, width, stall)
        self._issue(call, width, 0)
        return out

    def _launch_k2(self, layer, x, attn, width, nan_fault=0):
        call, out = self.k2_call(layer, x, attn, width, nan_fault)
        self._issue(call, width, 1)
        return out

    def close(self) -> None:
        self._launch.clear()
        self._layers = []
