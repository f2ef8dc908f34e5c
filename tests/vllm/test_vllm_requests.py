"""The three ways to ask for mono decode, through `vllm serve`'s real argument parser and
vLLM's config objects, and one clear line for a bad option."""

from __future__ import annotations

import pytest
from vllm_testlib import engine_config

from monodecode.errors import ConfigError


def _serve_config(model_dir, *argv: str):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm_testlib import make_serve_arg_parser

    parser = make_serve_arg_parser()
    args = parser.parse_args(
        ["--model", str(model_dir), "--max-model-len", "256", "--enforce-eager", "--skip-tokenizer-init", *argv]
    )
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


@pytest.mark.parametrize(
    "argv, enabled, widths",
    [
        ((), False, (1, 2, 4, 8)),
        (("--monokernel",), True, (1, 2, 4, 8)),
        (("--additional-config", '{"monodecode": {"enabled": true, "widths": [1, 2]}}'), True, (1, 2)),
        (("--additional-config", '{"decode_backend": "latency_specialized"}'), True, (1, 2, 4, 8)),
        (("--additional-config", '{"decode_backend": "auto"}'), False, (1, 2, 4, 8)),
        (("--monokernel", "--additional-config", '{"monodecode": {"enabled": false}}'), False, (1, 2, 4, 8)),
        (
            ("--additional-config", '{"monodecode": {"backend": "reference", "on_refusal": "degrade"}}'),
            False,
            (1, 2, 4, 8),
        ),
    ],
)
def test_switches(model_dirs, argv, enabled, widths):
    from vllm_testlib import vllm_minor

    from monodecode.vllm_plugin.request import mono_config_for

    if "--monokernel" in argv and vllm_minor() < (0, 33):
        pytest.skip("vLLM 0.32 has no --monokernel flag (KernelConfig.monokernel arrived in 0.33)")

    cfg = _serve_config(model_dirs["llama"], *argv)
    mono = mono_config_for(cfg)
    assert mono.enabled is enabled
    assert mono.widths == widths


@pytest.mark.parametrize(
    "additional, message",
    [
        ({"monodecode": {"enabeld": True}}, "additional_config.monodecode: unknown key 'enabeld'"),
        ({"monodecode": {"widths": [4, 2]}}, "additional_config.monodecode: 'widths' must be strictly ascending"),
        (
            {"monodecode": {"on_refusal": "ignore"}},
            "additional_config.monodecode: 'on_refusal' must be one of raise, degrade",
        ),
        ({"monodecode": "on"}, "additional_config.monodecode: must be an object, got str"),
        ({"decode_backend": "fast"}, "additional_config: 'decode_backend' must be 'auto' or 'latency_specialized'"),
    ],
)
def test_bad_options_fail_model_construction_with_one_line(model_dirs, vllm_distributed, additional, message):
    """A typo must stop the deployment (every supported architecture goes through our class),
    with one line naming the key."""
    from vllm_testlib import load_model

    cfg = engine_config(model_dirs["qwen3"], additional_config=additional)
    with pytest.raises(ConfigError) as err:
        load_model(cfg)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)
