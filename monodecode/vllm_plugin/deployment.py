"""The ``Deployment`` (``monodecode.spec``) of a real ``VllmConfig`` on a real platform.

Every field is read from the config vLLM built (parallel, cache, model, compilation, LoRA,
speculative, KV-transfer, offload) plus the platform facts (arch, compute units, partition
mode). ``plugin_reasons`` adds what only the vLLM integration knows: graph modes whose graphs
cannot carry a per-step decision, and features of vLLM's runner the kernels cannot serve.
"""

from __future__ import annotations

from typing import Any

from monodecode.errors import ModelConfigError
from monodecode.model.dims import ModelDims, dims_from_hf_config
from monodecode.services.platform import Platform
from monodecode.spec import Deployment

# torch dtype -> the short names monodecode uses for unquantized weights
_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def model_dims(vllm_config: Any) -> tuple[ModelDims | None, str | None]:
    """The model's dims from its HF config, or (None, "model: <why>")."""
    model_config = vllm_config.model_config
    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    raw = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
    # vLLM may resolve a text sub-config whose own "architectures" is unset; use the served one.
    if not raw.get("architectures"):
        raw["architectures"] = list(getattr(model_config.hf_config, "architectures", None) or [])
    try:
        return dims_from_hf_config(raw), None
    except ModelConfigError as e:
        return None, f"model: {e}"


def weight_dtype_of(vllm_config: Any, platform: Platform) -> str:
    """bf16 / fp8 / fp8_fnuz for what the kernels support; the quantization name otherwise."""
    quant = vllm_config.model_config.quantization
    if quant is None:
        name = _dtype_name(vllm_config.model_config.dtype)
        return _SHORT_DTYPE.get(name, name)
    if quant == "fp8":
        # vLLM normalizes FP8 checkpoints to the FNUZ encoding on gfx942 (MI300-class)
        return "fp8_fnuz" if platform.arch == "gfx942" else "fp8"
    return str(quant)


def graph_mode_of(vllm_config: Any) -> str:
    mode = vllm_config.compilation_config.cudagraph_mode
    return getattr(mode, "name", str(mode)).lower()


def deployment_from_vllm_config(vllm_config: Any, platform: Platform, dims: ModelDims | None = None) -> Deployment:
    """Every fact the refusal rules read, from the real config objects."""
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    mc = vllm_config.model_config
    spec = vllm_config.speculative_config
    kvt = vllm_config.kv_transfer_config
    offload = getattr(vllm_config, "offload_config", None)
    uva_gb = getattr(getattr(offload, "uva", None), "cpu_offload_gb", 0) or 0
    prefetch_groups = getattr(getattr(offload, "prefetch", None), "offload_group_size", 0) or 0
    if dims is None:
        dims, _ = model_dims(vllm_config)
    capture = vllm_config.compilation_config.cudagraph_capture_sizes or ()
    return Deployment(
        platform_kind=platform.kind,
        arch=platform.arch,
        compute_units=platform.compute_units,
        partition_mode=platform.partition_mode,
        tp_size=pc.tensor_parallel_size,
        pp_size=pc.pipeline_parallel_size,
        dp_size=pc.data_parallel_size,
        dcp_size=getattr(pc, "decode_context_parallel_size", 1) or 1,
        expert_parallel=bool(getattr(pc, "enable_expert_parallel", False)),
        lora=vllm_config.lora_config is not None,
        speculative=(getattr(spec, "method", None) or "on") if spec is not None else None,
        kv_connector=(getattr(kvt, "kv_connector", None) or "on")
        if kvt is not None and getattr(kvt, "kv_connector", None)
        else None,
        sleep_mode=bool(getattr(mc, "enable_sleep_mode", False)),
        cpu_offload=uva_gb > 0 or prefetch_groups > 0,
        model_dtype=_dtype_name(mc.dtype),
        weight_dtype=weight_dtype_of(vllm_config, platform),
        kv_cache_dtype=str(cc.cache_dtype),
        block_size=int(cc.block_size),
        dims=dims,
        graph_mode=graph_mode_of(vllm_config),
        capture_sizes=tuple(sorted(int(c) for c in capture)),
        extra_reasons=tuple(plugin_reasons(vllm_config)),
    )


def _breakable_graphs() -> bool:
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    return is_breakable_cudagraph_enabled()


def plugin_reasons(vllm_config: Any) -> list[str]:
    """Reasons only the vLLM integration can see (each ``"<code>: <sentence>"``)."""
    reasons = []
    _, why = model_dims(vllm_config)
    if why:
        reasons.append(why)
    mode = vllm_config.compilation_config.cudagraph_mode
    # FULL (one routine) replays the same graph for decode-only and mixed batches of a size, so
    # a per-step choice baked in at capture would run the kernels on prefill rows.
    if graph_mode_of(vllm_config) == "full" and not mode.separate_routine():
        reasons.append(
            "graph_mode: cudagraph mode FULL replays one graph for decode-only and mixed batches; "
            "use FULL_DECODE_ONLY or FULL_AND_PIECEWISE (separate decode graphs), or eager"
        )
    if graph_mode_of(vllm_config) != "none" and _breakable_graphs():
        # a breakable capture records the whole forward in PIECEWISE mode too, so its replays skip
        # the plugin's Python like FULL replays; at logits time the two cannot be told apart
        reasons.append(
            "graph_mode: VLLM_USE_BREAKABLE_CUDAGRAPH=1 replays whole PIECEWISE forwards without the plugin, "
            "like FULL ones, so their steps cannot be counted or checked; set VLLM_USE_BREAKABLE_CUDAGRAPH=0 "
            "(vLLM turns it on for some architectures and with VLLM_BATCH_INVARIANT=1)"
        )
    runner_type = getattr(vllm_config.model_config, "runner_type", "generate")
    if runner_type != "generate":
        reasons.append(f"runner_type: a {runner_type} model (vLLM's --runner {runner_type}) has no decode steps")
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        reasons.append(
            "tp_shards: under vLLM every tensor-parallel rank holds only its shard of each weight; "
            "no kernel backend takes per-rank shards yet (TP 1 only)"
        )
    if getattr(vllm_config.parallel_config, "enable_dbo", False):
        reasons.append("dual_batch_overlap: micro-batched steps (DBO) split a decode step across two forward passes")
    return reasons
