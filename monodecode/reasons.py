"""Every reason code mono decode reports: why a step took the stock path, why a start refused.

Codes are metric label values (``monodecode_fallback_steps_total{reason}``,
``monodecode_refusal_info{reason}``), the prefix of each ``"<code>: <sentence>"`` refusal
reason, and the keys of the runbook; the alert-rule tests and the runbook are checked against
these enums, so a code exists here or nowhere. Pure: imports nothing but ``enum``.
"""

from __future__ import annotations

from enum import Enum


class _Code(str, Enum):
    """A code that prints, formats and compares as its plain string value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class FallbackReason(_Code):
    """Why one decode step ran vLLM's stock layers instead of the kernels."""

    prefill = "prefill"  # every row belongs to a prompt chunk
    mixed_batch = "mixed_batch"  # prompt chunks and decode rows in one step
    rows_exceed_width = "rows_exceed_width"  # more rows than the widest built width (or none)
    width_dropped = "width_dropped"  # the fitting width measured slower than stock at warm-up
    graph_mode = "graph_mode"  # PIECEWISE graphs replay without the decision
    no_metadata = "no_metadata"  # profile / dummy runs, pipeline-stage input, prompt embeddings
    disabled = "disabled"  # mono decode is off in the config
    degraded = "degraded"  # refused at start or degraded at runtime (see refusal_info)


class RefusalReason(_Code):
    """Why mono decode does not run on this deployment (start-up refusal or runtime degrade)."""

    # the deployment against the kernels' spec (monodecode.spec)
    platform = "platform"
    arch = "arch"
    compute_units = "compute_units"
    tp_size = "tp_size"
    pipeline_parallel = "pipeline_parallel"
    data_parallel = "data_parallel"
    expert_parallel = "expert_parallel"
    lora = "lora"
    speculative_decoding = "speculative_decoding"
    kv_connector = "kv_connector"
    sleep_mode = "sleep_mode"
    decode_context_parallel = "decode_context_parallel"
    cpu_offload = "cpu_offload"
    dtype = "dtype"
    weight_dtype = "weight_dtype"
    kv_cache_dtype = "kv_cache_dtype"
    kv_dtype = "kv_dtype"
    block_size = "block_size"
    model = "model"
    model_family = "model_family"
    model_dims = "model_dims"
    head_dim = "head_dim"
    dims_not_built = "dims_not_built"
    graph_mode = "graph_mode"
    capture_sizes = "capture_sizes"
    # backend, build and artifacts
    backend_unavailable = "backend_unavailable"
    no_gpu = "no_gpu"
    build_request = "build_request"
    build_failed = "build_failed"
    no_artifact = "no_artifact"
    artifact_checksum = "artifact_checksum"
    artifact_invalid = "artifact_invalid"
    # warm-up
    warmup_failed = "warmup_failed"
    slower_than_stock = "slower_than_stock"  # width_policy auto: no built width beat the stock step
    # the vLLM integration
    runner_type = "runner_type"
    tp_shards = "tp_shards"
    dual_batch_overlap = "dual_batch_overlap"
    weight_layout = "weight_layout"
    kv_layout = "kv_layout"
    attention_backend = "attention_backend"
    attention_metadata = "attention_metadata"
    vllm_version = "vllm_version"
    cpu_isa = "cpu_isa"
    additional_config = "additional_config"
    # tensor-parallel agreement
    peer_refused = "peer_refused"
    peer_disabled = "peer_disabled"
    # runtime
    failstop_loop = "failstop_loop"  # N fail-stops within the window: start with stock decode
    disabled = "disabled"  # a rank-local wish to stop, agreed by vote
    shadow_mismatch = "shadow_mismatch"  # the shadow check exceeded the warm-up tolerance
    fault_drill = "fault_drill"  # MONODECODE_FAULT names a layer or rank that does not exist


def reason_code(reason: str) -> str:
    """The code of a ``"<code>: <sentence>"`` reason (the part before the first colon)."""
    return reason.split(":", 1)[0].strip()
