"""MonoConfig: defaults, aliases, and one clear line for every bad key or value."""

import pytest

from monodecode.config import MonoConfig
from monodecode.errors import ConfigError


def test_defaults_are_off_and_valid():
    cfg = MonoConfig()
    assert cfg.enabled is False and cfg.backend == "auto" and cfg.on_refusal == "raise"
    assert cfg.widths == (1, 2, 4, 8) and cfg.max_width == 8


def test_from_dict_normalizes_and_roundtrips():
    cfg = MonoConfig.from_dict({"enabled": True, "widths": [1, 3, 16], "wait_timeout_s": 2, "artifact_dir": "/a"})
    assert cfg.widths == (1, 3, 16) and cfg.wait_timeout_s == 2.0 and isinstance(cfg.wait_timeout_s, float)
    assert MonoConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(on_refusal="degrade").on_refusal == "degrade"


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"enabeld": True}, "unknown key 'enabeld'"),
        ({"enabled": "yes"}, "'enabled' must be true or false"),
        ({"enabled": 1}, "'enabled' must be true or false"),
        ({"backend": "cuda"}, "'backend' must be one of auto, flydsl, triton, triton-step, reference"),
        ({"on_refusal": "ignore"}, "'on_refusal' must be one of raise, degrade"),
        ({"widths": []}, "'widths' must be a non-empty list"),
        ({"widths": "1,2"}, "'widths' must be a non-empty list"),
        ({"widths": [2, 1]}, "strictly ascending"),
        ({"widths": [1, 1]}, "strictly ascending"),
        ({"widths": [0, 1]}, "between 1 and 256"),
        ({"widths": [1, 512]}, "between 1 and 256"),
        ({"widths": [1.5]}, "between 1 and 256"),
        ({"widths": [True]}, "between 1 and 256"),
        ({"max_failstops": 0}, "'max_failstops' must be between 1 and 1000"),
        ({"max_failstops": "3"}, "'max_failstops' must be an integer"),
        ({"failstop_window_s": -1}, "'failstop_window_s' must be a positive finite number"),
        ({"wait_timeout_s": float("inf")}, "'wait_timeout_s' must be a positive finite number"),
        ({"wait_timeout_s": float("nan")}, "'wait_timeout_s' must be a positive finite number"),
        ({"wait_timeout_s": 1e308}, "'wait_timeout_s' must be at most 3600, got 1e+308"),
        ({"warmup_atol": -0.1}, "'warmup_atol' must be a non-negative"),
        ({"artifact_dir": ""}, "'artifact_dir' must be a non-empty path"),
        ({"failstop_dir": None}, "'failstop_dir' must be a non-empty path"),
        ({"termination_log": 5}, "'termination_log' must be a non-empty path"),
        ({"allow_jit": None}, "'allow_jit' must be true or false"),
    ],
)
def test_bad_values_are_one_line_errors(raw, fragment):
    with pytest.raises(ConfigError) as e:
        MonoConfig.from_dict(raw)
    msg = str(e.value)
    assert fragment in msg and "\n" not in msg and msg.startswith("monodecode config:")


def test_not_an_object():
    with pytest.raises(ConfigError, match="must be an object, got list"):
        MonoConfig.from_dict([1, 2])


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="'backend' must be one of"):
        MonoConfig(backend="nope")


def test_from_json_reports_position():
    with pytest.raises(ConfigError, match=r"MONODECODE_CONFIG is not valid JSON .*line 1 column"):
        MonoConfig.from_env({"MONODECODE_CONFIG": "{enabled: true}"})
    assert MonoConfig.from_env({"MONODECODE_CONFIG": '{"enabled": true}'}).enabled
    assert MonoConfig.from_env({}) == MonoConfig()


def test_additional_config_and_aliases():
    c = MonoConfig.from_additional_config({"monodecode": {"enabled": True, "on_refusal": "degrade"}})
    assert c.enabled and c.on_refusal == "degrade"
    assert MonoConfig.from_additional_config({"decode_backend": "latency_specialized"}).enabled
    assert MonoConfig.from_additional_config({}, monokernel=True).enabled
    assert not MonoConfig.from_additional_config({"other_plugin": {"x": 1}}).enabled
    # an explicit enabled: false wins over the alias
    assert not MonoConfig.from_additional_config(
        {"decode_backend": "latency_specialized", "monodecode": {"enabled": False}}
    ).enabled
    with pytest.raises(ConfigError, match="'decode_backend' must be 'auto' or 'latency_specialized'"):
        MonoConfig.from_additional_config({"decode_backend": "fast"})
    with pytest.raises(ConfigError, match=r"additional_config.monodecode: unknown key 'widht'"):
        MonoConfig.from_additional_config({"monodecode": {"widht": [1]}})
    with pytest.raises(ConfigError, match="additional_config.monodecode: must be an object"):
        MonoConfig.from_additional_config({"monodecode": "on"})


def test_one_widths_and_block_size_rule_for_the_command_line():
    """``parse_widths`` / ``check_block_size`` (verify and precompile) apply MonoConfig's rule."""
    from monodecode.config import check_block_size, parse_widths

    assert parse_widths("1, 2,4,8") == (1, 2, 4, 8) == MonoConfig(widths=(1, 2, 4, 8)).widths
    for bad, fragment in [
        ("1,1", "strictly ascending without duplicates"),
        ("4,2", "strictly ascending"),
        ("0", "between 1 and 256"),
        ("1,\u0663", "comma-separated list of integers"),
        ("", "comma-separated list of integers"),
        ("1e3", "comma-separated list of integers"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            parse_widths(bad)
    assert check_block_size(16) == 16
    for bad in (0, 1025, 99999999, True, 16.0):
        with pytest.raises(ConfigError, match="--block-size must be"):
            check_block_size(bad)
