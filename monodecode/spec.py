"""What a kernel build supports, and every reason a deployment cannot use it.

``refusal_reasons(deployment, spec)`` is pure (no GPU, no vLLM, no I/O): the vLLM plugin builds a
``Deployment`` from the real ``VllmConfig`` and platform, the runner adds what it learned (the
artifact lookup), and the result is the complete list of reasons, each ``"<code>: <sentence>"``.
Features are default-deny: anything ON that the spec does not list as supported refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from monodecode.reasons import reason_code

__all__ = ["Deployment", "KernelSpec", "fitting_capture_sizes", "reason_code", "refusal_reasons"]

if TYPE_CHECKING:
    from monodecode.model.dims import ModelDims

# Optional vLLM features; ON in a deployment and not in KernelSpec.supports -> refusal.
FEATURES = (
    "pipeline_parallel",
    "data_parallel",
    "expert_parallel",
    "lora",
    "speculative_decoding",
    "kv_connector",
    "sleep_mode",
    "decode_context_parallel",
    "cpu_offload",
)

_FEATURE_SENTENCES = {
    "pipeline_parallel": "pipeline parallelism (pipeline_parallel_size={}) is not supported; the kernels run whole layer stacks on one TP group",
    "data_parallel": "data parallelism (data_parallel_size={}) is not supported",
    "expert_parallel": "expert parallelism is enabled; the kernels are for dense models",
    "lora": "LoRA adapters are enabled; the kernels have no adapter path",
    "speculative_decoding": "speculative decoding ({}) is enabled; verify rows are not supported",
    "kv_connector": "a KV transfer connector ({}) is configured; its copy kernels would share the CUs the persistent grid needs",
    "sleep_mode": "sleep mode is enabled; kernel scratch and peer buffers do not survive sleep/wake",
    "decode_context_parallel": "decode context parallelism ({}) is not supported",
    "cpu_offload": "CPU weight offload is enabled; the kernels read weights from device memory",
}

GRAPH_MODES_OK = ("none", "full", "full_decode_only", "full_and_piecewise")


@dataclass(frozen=True)
class KernelSpec:
    """What one backend's build supports. ``None`` for a field means "any"."""

    backend: str
    platform_kinds: tuple[str, ...] = ("rocm", "cuda", "cpu")
    archs: tuple[str, ...] | None = None
    # persistent grid: workgroups that must all be resident (one per CU); None = not persistent
    grid_size: int | None = None
    tp_sizes: tuple[int, ...] | None = (1,)
    model_dtypes: tuple[str, ...] = ("bfloat16",)
    weight_dtypes: tuple[str, ...] = ("bf16", "fp8", "fp8_fnuz")
    kv_cache_dtypes: tuple[str, ...] = ("auto", "bf16", "bfloat16")
    block_sizes: tuple[int, ...] | None = (16, 32, 64)
    widths: tuple[int, ...] = (1, 2, 4, 8)
    families: tuple[str, ...] = ("llama", "qwen3", "gemma3")
    head_dims: tuple[int, ...] | None = None
    # digests (ModelDims.digest()) the build has kernels for; None = any dims (JIT / reference)
    built_dims: tuple[str, ...] | None = None
    supports: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Deployment:
    """A deployment as the refusal rules see it (filled from VllmConfig by the vLLM plugin)."""

    platform_kind: str  # rocm | cuda | cpu
    arch: str
    compute_units: int
    partition_mode: str | None = None
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    dcp_size: int = 1
    expert_parallel: bool = False
    lora: bool = False
    speculative: str | None = None  # method name when speculative decoding is on
    kv_connector: str | None = None
    sleep_mode: bool = False
    cpu_offload: bool = False
    model_dtype: str = "bfloat16"
    weight_dtype: str = "bf16"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    dims: ModelDims | None = None
    graph_mode: str = "none"  # none | full | full_decode_only | full_and_piecewise | piecewise
    capture_sizes: tuple[int, ...] = ()
    # filled by the runner after the artifact lookup: a "<code>: <sentence>" or None
    artifact_problem: str | None = None
    extra_reasons: tuple[str, ...] = field(default=())

    def features_on(self) -> dict[str, str]:
        """Feature name -> the detail shown in its refusal sentence."""
        on = {}
        if self.pp_size > 1:
            on["pipeline_parallel"] = str(self.pp_size)
        if self.dp_size > 1:
            on["data_parallel"] = str(self.dp_size)
        if self.expert_parallel:
            on["expert_parallel"] = ""
        if self.lora:
            on["lora"] = ""
        if self.speculative:
            on["speculative_decoding"] = self.speculative
        if self.kv_connector:
            on["kv_connector"] = self.kv_connector
        if self.sleep_mode:
            on["sleep_mode"] = ""
        if self.dcp_size > 1:
            on["decode_context_parallel"] = str(self.dcp_size)
        if self.cpu_offload:
            on["cpu_offload"] = ""
        return on


def _list(values) -> str:
    return ", ".join(str(v) for v in values)


def fitting_capture_sizes(capture_sizes: tuple[int, ...], widths: tuple[int, ...]) -> list[int]:
    """Capture sizes that map onto built widths: the widths themselves plus sizes above the
    largest width (those steps take the stock path inside their own graphs)."""
    return sorted(set(widths) | {c for c in capture_sizes if c > max(widths)})


def refusal_reasons(deployment: Deployment, spec: KernelSpec) -> list[str]:
    """Every reason ``deployment`` cannot run ``spec``'s kernels (empty list = it can)."""
    d, s = deployment, spec
    reasons: list[str] = []

    if d.platform_kind not in s.platform_kinds:
        reasons.append(
            f"platform: the {s.backend} backend runs on {_list(s.platform_kinds)}; this node is {d.platform_kind}"
        )
    elif s.archs is not None and d.arch not in s.archs:
        reasons.append(f"arch: the {s.backend} backend is built for {_list(s.archs)}; this GPU is {d.arch}")

    if s.grid_size is not None and d.compute_units < s.grid_size:
        part = f" (partition mode {d.partition_mode})" if d.partition_mode else ""
        reasons.append(
            f"compute_units: the persistent grid needs {s.grid_size} resident workgroups, one per CU; "
            f"this GPU exposes {d.compute_units} CUs{part}"
        )

    if s.tp_sizes is not None and d.tp_size not in s.tp_sizes:
        reasons.append(
            f"tp_size: kernels are built for tensor parallel sizes {_list(s.tp_sizes)}; deployment uses {d.tp_size}"
        )
    if d.dims is not None and d.tp_size > 1:
        if d.dims.num_kv_heads % d.tp_size or d.dims.num_heads % d.tp_size:
            reasons.append(
                f"tp_size: {d.dims.num_heads} query / {d.dims.num_kv_heads} KV heads do not split evenly over TP {d.tp_size}"
            )
        elif d.dims.intermediate_size % d.tp_size:
            reasons.append(
                f"tp_size: intermediate size {d.dims.intermediate_size} does not split evenly over TP {d.tp_size}"
            )

    for feature, detail in d.features_on().items():
        if feature not in s.supports:
            reasons.append(f"{feature}: " + _FEATURE_SENTENCES[feature].format(detail))

    if d.model_dtype not in s.model_dtypes:
        reasons.append(f"dtype: model dtype {d.model_dtype} is not supported; supported: {_list(s.model_dtypes)}")
    if d.weight_dtype not in s.weight_dtypes:
        reasons.append(
            f"weight_dtype: weights in {d.weight_dtype} are not supported; supported: {_list(s.weight_dtypes)}"
        )
    if d.kv_cache_dtype not in s.kv_cache_dtypes:
        reasons.append(
            f"kv_cache_dtype: KV cache dtype {d.kv_cache_dtype} is not supported; supported: {_list(s.kv_cache_dtypes)}"
        )
    if s.block_sizes is not None and d.block_size not in s.block_sizes:
        reasons.append(f"block_size: KV block size {d.block_size} is not built; built: {_list(s.block_sizes)}")

    if d.dims is None:
        reasons.append("model: the model's dimensions are unknown")
    else:
        if d.dims.family not in s.families:
            reasons.append(
                f"model_family: {d.dims.architecture} ({d.dims.family}) is not supported; supported: {_list(s.families)}"
            )
        if s.head_dims is not None and d.dims.head_dim not in s.head_dims:
            reasons.append(f"head_dim: head dim {d.dims.head_dim} is not built; built: {_list(s.head_dims)}")
        if s.built_dims is not None and d.dims.digest() not in s.built_dims:
            reasons.append(
                f"dims_not_built: no kernels were built for this model's dimensions "
                f"(hidden {d.dims.hidden_size}, {d.dims.num_layers} layers, dims digest {d.dims.digest()[:12]})"
            )

    if d.graph_mode not in GRAPH_MODES_OK:
        reasons.append(
            f"graph_mode: cudagraph mode {d.graph_mode} replays mixed batches without attention metadata; "
            f"use FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE (or eager)"
        )
    elif d.graph_mode != "none" and d.capture_sizes:
        misfit = [c for c in d.capture_sizes if c <= max(s.widths) and c not in s.widths]
        if misfit:
            fit = fitting_capture_sizes(d.capture_sizes, s.widths)
            reasons.append(
                f"capture_sizes: FULL graph capture sizes {_list(misfit)} are not built widths ({_list(s.widths)}); "
                f"use --compilation-config '{{\"cudagraph_capture_sizes\": [{_list(fit)}]}}'"
            )

    if d.artifact_problem:
        reasons.append(d.artifact_problem)
    reasons.extend(d.extra_reasons)
    return reasons
