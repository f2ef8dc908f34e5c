"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.metadata

import pytest

# tests/vllm run against the real vLLM, which lives only in .venv-vllm (scripts/toolchains.d/
# 40-vllm.sh; `make test` runs them with that interpreter). Other interpreters skip collecting it.
try:
    importlib.metadata.distribution("vllm")
    collect_ignore: list[str] = []
except importlib.metadata.PackageNotFoundError:
    collect_ignore = ["vllm"]


@pytest.fixture(scope="module")
def torch_one_thread():
    """Run a module's small torch ops on one intra-op thread.

    On the 2 shared CI cores, torch's default thread pool oversubscribes and makes small-tensor tests
    about 10x slower (measured: 104 s -> 8 s for the reference-decode tests under load).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_terminal_summary(terminalreporter):
    """Print the numeric differences tests recorded (``MEASURED`` dicts), so a CI log shows how
    close each comparison came to its tolerance, not just that it passed."""
    import sys

    for name, module in sorted(sys.modules.items()):
        measured = getattr(module, "MEASURED", None) if name.startswith(("test_", "tests.")) else None
        if isinstance(measured, dict) and measured:
            terminalreporter.section(f"measured differences ({name})")
            for key in sorted(measured):
                terminalreporter.write_line(f"  {key:40s} {measured[key]:.3g}")


@pytest.fixture
def backend():
    """``backend(cls)`` registers a test backend and lets ``MonoConfig(backend=cls.name)`` pick it;
    every backend registered this way is removed afterwards."""
    from fake_backends import register

    undo = []

    def use(cls):
        undo.append(register(cls))
        return cls.name

    yield use
    for u in reversed(undo):
        u()


@pytest.fixture
def slow_at_two(backend):
    """The name of ``fake_backends.SlowAtTwoBackend`` (width 2 slower by 30 ms a layer), registered."""
    from fake_backends import SlowAtTwoBackend

    return backend(SlowAtTwoBackend)
