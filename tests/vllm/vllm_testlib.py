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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_config(model_dir: Path, **kwargs):
    """A real ``VllmConfig`` from vLLM's ``EngineArgs`` (loads the general plugins, ours included)."""
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True, skip_tokenizer_init=True)
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()


def load_model(vllm_config):
    """vLLM's own loader: construct the registered class, load safetensors, post-process."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

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


def bind_token_major_kv(model, num_blocks: int = 8, block_size: int = 16) -> None:
    """Give every attention layer a zeroed KV cache shaped like vLLM 0.33's token-major
    (LBNHC) per-layer view: logical [blocks, kv_heads, block_size, 2 * head_dim]."""
    import torch

    for layer in model.model.layers:
        attn = layer.self_attn.attn
        physical = torch.zeros(num_blocks, block_size, attn.num_kv_heads, 2 * attn.head_size, dtype=torch.bfloat16)
        attn.kv_cache = physical.permute(0, 2, 1, 3)
