"""Fixtures for the tests against the real vllm==0.33.0 (see vllm_testlib.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_testlib import init_one_rank, write_hf_model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> HF model directory (gemma3: the embedded tiny model)."""
    from monodecode.model.tiny import ensure_tiny_model

    root = tmp_path_factory.mktemp("models")
    gemma = ensure_tiny_model(root)
    return {
        "gemma3": gemma,
        "llama": write_hf_model(root / "llama", "llama", gemma),
        "qwen3": write_hf_model(root / "qwen3", "qwen3", gemma),
    }


@pytest.fixture(scope="session")
def vllm_distributed():
    """vLLM's distributed state for one CPU rank (gloo), needed to construct models."""
    import torch

    torch.set_num_threads(1)  # 2 shared CI cores: small-tensor ops are faster on one thread
    init_one_rank()
    yield
