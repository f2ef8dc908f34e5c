"""Every parser of outside input yields a value or one ``MonodecodeError`` line, never another
exception: ``MonoConfig``, the ``MONODECODE_FAULT`` string, the artifact manifest, the fail-stop
marker and a model's ``config.json`` dims. Property-based (Hypothesis) over arbitrary text, bytes
and JSON values, plus the specific inputs that used to escape as tracebacks."""

from __future__ import annotations

import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monodecode.config import MonoConfig
from monodecode.errors import ArtifactError, ConfigError, ModelConfigError, MonodecodeError
from monodecode.model.dims import dims_from_hf_config, load_dims
from monodecode.model.profiles import PROFILES, profile_config
from monodecode.runtime.failstop import FailStopRecorder, MarkerHistory
from monodecode.services.artifacts import ArtifactStore, parse_manifest
from monodecode.services.faults import parse_faults

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
# JSON documents as they arrive: arbitrary text, valid JSON of any shape, and the nasty ones
NASTY = [
    "[" * 100_000 + "]" * 100_000,
    '{"a": ' + "1" * 5000 + "}",
    '{"a": 1e999}',
    '{"a": NaN}',
    '{"a": -Infinity}',
    "\ufeff{}",
    "",
]
documents = st.one_of(
    st.text(max_size=60),
    json_values.map(lambda v: json.dumps(v, allow_nan=True)),
    st.sampled_from(NASTY),
)


def one_line(e: BaseException) -> bool:
    return isinstance(e, MonodecodeError) and "\n" not in str(e) and len(str(e)) < 2000


# ---- MonoConfig --------------------------------------------------------------------------------

config_keys = st.sampled_from([f.name for f in MonoConfig.__dataclass_fields__.values()] + ["bogus", ""])


@SETTINGS
@given(st.dictionaries(config_keys, json_values, max_size=6))
def test_monoconfig_from_any_dict(raw):
    try:
        cfg = MonoConfig.from_dict(raw)
    except ConfigError as e:
        assert one_line(e)
    else:
        assert MonoConfig.from_dict(cfg.to_dict()) == cfg  # what validates round-trips


@SETTINGS
@given(documents)
def test_monoconfig_from_any_json(text):
    try:
        MonoConfig.from_json(text)
    except ConfigError as e:
        assert one_line(e)


@SETTINGS
@given(json_values)
def test_additional_config_of_any_shape(section):
    try:
        MonoConfig.from_additional_config({"monodecode": section, "decode_backend": "latency_specialized"})
    except ConfigError as e:
        assert one_line(e)


# ---- fault string ------------------------------------------------------------------------------

fault_text = st.one_of(
    st.text(max_size=40),
    st.lists(
        st.tuples(
            st.sampled_from(["stall", "nonfinite", "corrupt_artifact", "STALL", "x"]),
            st.lists(
                st.tuples(st.sampled_from(["layer", "step", "rank", "bogus"]), st.text("0123456789٣-e. ", max_size=6)),
                max_size=3,
            ),
        ),
        max_size=3,
    ).map(lambda fs: ";".join(k + (":" + ",".join(f"{a}={b}" for a, b in ps) if ps else "") for k, ps in fs)),
)


@SETTINGS
@given(fault_text)
def test_fault_string(text):
    try:
        faults = parse_faults(text)
    except ConfigError as e:
        assert one_line(e)
    else:
        assert all(0 <= f.layer < 10**9 and 0 <= f.step < 10**9 for f in faults)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("stall:layer=1,layer=2", "given twice"),
        ("stall:layer=\u0663", "non-negative integer"),  # an Arabic-Indic digit
        (";", "names no fault"),
        ("stall:step=99999999999", r"below 10\^9"),
    ],
)
def test_fault_string_quirks_are_refused(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_faults(text)


# ---- artifact manifest -------------------------------------------------------------------------

HEX = "0" * 64
entry_fields = st.fixed_dictionaries(
    {},
    optional={
        "build_key": st.sampled_from([HEX, "abc"]) | json_values,
        "backend": json_values,
        "arch": json_values,
        "dims_digest": json_values,
        "widths": st.lists(json_values, max_size=3) | json_values,
        "files": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "path": st.sampled_from(["a.pkl", "../x", "/abs", "."]) | json_values,
                    "sha256": st.sampled_from([HEX]) | json_values,
                    "bytes": json_values,
                },
            ),
            max_size=2,
        )
        | json_values,
        "compiler": st.fixed_dictionaries({}, optional={"name": json_values, "version": json_values}) | json_values,
        "profile": json_values,
        "extra": json_values,
    },
)
manifests = st.one_of(
    documents,
    st.fixed_dictionaries(
        {"schema": st.sampled_from([1, 2, "1"]), "artifacts": st.lists(entry_fields, max_size=2)}
    ).map(json.dumps),
)


@SETTINGS
@given(manifests)
def test_manifest_text(text):
    try:
        parse_manifest(text)
    except ArtifactError as e:
        assert one_line(e)


@SETTINGS
@given(st.binary(max_size=80))
def test_manifest_bytes(data):
    try:
        parse_manifest(data)
    except ArtifactError as e:
        assert one_line(e)


def _store_with(tmp_path, make_file):
    """A store whose one entry lists ``kernel.pkl`` (made by ``make_file``) as 4 bytes."""
    root = tmp_path / "art"
    store = ArtifactStore(root)
    entry = store.add(
        build_key=HEX,
        backend="flydsl",
        arch="gfx942",
        dims_digest=HEX,
        widths=(1,),
        files={"kernel.pkl": b"code"},
        compiler={"name": "x", "version": "1"},
    )
    (root / "kernel.pkl").unlink()
    make_file(root / "kernel.pkl")
    return store, entry


@pytest.mark.parametrize(
    "make_file, fragment",
    [(lambda p: p.mkdir(), "is not a regular file"), (lambda p: os.mkfifo(p), "is not a regular file")],
    ids=["directory", "fifo"],
)
def test_artifact_path_that_is_not_a_file_is_refused_without_blocking(tmp_path, make_file, fragment):
    store, entry = _store_with(tmp_path, make_file)
    t0 = time.monotonic()
    with pytest.raises(ArtifactError, match=fragment):
        store.lookup(HEX)
    with pytest.raises(ArtifactError, match=fragment):
        store.read_verified(entry, "kernel.pkl")
    assert time.monotonic() - t0 < 5


def test_read_verified_hashes_the_bytes_it_returns(tmp_path):
    store, entry = _store_with(tmp_path, lambda p: p.write_bytes(b"code"))
    assert store.read_verified(entry, "kernel.pkl") == b"code"
    (tmp_path / "art" / "kernel.pkl").write_bytes(b"evil")  # same size, swapped after lookup
    with pytest.raises(ArtifactError, match="checksum mismatch for kernel.pkl"):
        store.read_verified(entry, "kernel.pkl")
    with pytest.raises(ArtifactError, match="not in its manifest entry"):
        store.read_verified(entry, "other.pkl")


def test_manifest_digest_is_checked_at_runtime(tmp_path):
    from monodecode.services.artifacts import manifest_digest

    store, _ = _store_with(tmp_path, lambda p: p.write_bytes(b"code"))
    good = manifest_digest(store.manifest_path.read_bytes())
    assert ArtifactStore(store.root, manifest_digest=good).lookup(HEX) is not None
    with pytest.raises(ArtifactError, match="checksum mismatch for .*manifest.json: digest sha256:"):
        ArtifactStore(store.root, manifest_digest="sha256:" + "1" * 64).lookup(HEX)


# ---- fail-stop marker --------------------------------------------------------------------------

marker_docs = st.one_of(
    documents,
    st.fixed_dictionaries(
        {"schema": st.sampled_from([1, 2]) | json_values},
        optional={
            "events": st.lists(
                st.fixed_dictionaries(
                    {},
                    optional={k: json_values | st.integers() for k in ("rank", "step", "layer", "time", "pid")}
                    | {"site": st.sampled_from(["wait_timeout", "nonfinite", 'x"}']) | json_values},
                ),
                max_size=3,
            )
            | json_values,
            "totals": st.dictionaries(st.text(max_size=8) | st.sampled_from(["nonfinite"]), json_values, max_size=3)
            | json_values,
        },
    ).map(lambda d: json.dumps(d, allow_nan=True)),
)


@SETTINGS
@given(marker_docs)
def test_any_marker_reads_as_history(tmp_path_factory, text):
    d = tmp_path_factory.mktemp("m")
    rec = FailStopRecorder(d, 0, d / "term", exit_on_failstop=False)
    rec.marker_path.write_text(text)
    history = rec.read()  # never raises: an unreadable marker is a note
    assert isinstance(history, MarkerHistory)
    assert set(history.totals) <= {"wait_timeout", "nonfinite", "kernel_error", "shadow_mismatch"}
    rec.crash_loop_reason(history, 3, 3600.0)


@pytest.mark.parametrize(
    "body",
    [
        '{"schema":1,"events":[],"totals":{"nonfinite":1e999}}',
        '{"schema":1,"events":[{"rank":1e999,"step":0,"site":"nonfinite","time":1}],"totals":{}}',
        '{"schema":1,"events":[{"rank":0,"step":0,"site":"nonfinite","time":NaN}],"totals":{}}',
        '{"schema":1,"events":' + "[" * 50_000 + "]" * 50_000 + "}",
    ],
)
def test_marker_numbers_that_used_to_crash_are_notes(tmp_path, body):
    rec = FailStopRecorder(tmp_path, 0, tmp_path / "term", exit_on_failstop=False)
    rec.marker_path.write_text(body)
    h = rec.read()
    assert h.events == [] and h.problems and "ignored" in h.problems[0]


def test_future_marker_events_do_not_loop_forever_and_totals_keep_known_sites(tmp_path):
    rec = FailStopRecorder(tmp_path, 0, tmp_path / "term", exit_on_failstop=False)
    events = [{"rank": 0, "step": i, "site": "nonfinite", "layer": 0, "kernel": "k2", "time": 1e11} for i in range(3)]
    body = {"schema": 1, "events": events, "totals": {"nonfinite": 3, 'evil"} 1': 5}}
    rec.marker_path.write_text(json.dumps(body))
    h = rec.read()
    assert h.events == [] and h.totals == {"nonfinite": 3}
    assert any("dated in the future" in p for p in h.problems) and any("unknown sites" in p for p in h.problems)
    assert rec.crash_loop_reason(h, 3, 3600.0) is None


# ---- model config.json dims --------------------------------------------------------------------

base_configs = st.sampled_from(sorted(PROFILES)).map(profile_config)


@SETTINGS
@given(
    base_configs,
    st.dictionaries(st.sampled_from(sorted(set().union(*map(profile_config, PROFILES)))), json_values, max_size=3),
)
def test_dims_from_a_config_with_any_values(base, changes):
    try:
        dims = dims_from_hf_config({**base, **changes})
    except ModelConfigError as e:
        assert one_line(e)
    else:
        assert dims.num_layers > 0 and dims.hidden_size > 0


@SETTINGS
@given(json_values)
def test_dims_from_any_json_value(raw):
    try:
        dims_from_hf_config(raw)
    except ModelConfigError as e:
        assert one_line(e)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_dims_are_named(value):
    cfg = profile_config("qwen3-8b")
    with pytest.raises(ModelConfigError, match="'rope_parameters.rope_theta' must be a finite number"):
        dims_from_hf_config({**cfg, "rope_parameters": {**cfg["rope_parameters"], "rope_theta": value}})
    with pytest.raises(ModelConfigError, match="'rms_norm_eps' must be a finite number"):
        dims_from_hf_config({**cfg, "rms_norm_eps": value})


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"\xff\xfe{", "is not UTF-8 text"),
        (b"[" * 100_000 + b"]" * 100_000, "is nested too deeply"),
        (b'{"hidden_size": ' + b"1" * 5000 + b"}", "has a number with too many digits"),
        (b'{"rope_theta": NaN}', "holds NaN, not a finite number"),
    ],
)
def test_config_json_bytes_that_used_to_crash(tmp_path, data, fragment):
    (tmp_path / "config.json").write_bytes(data)
    with pytest.raises(ModelConfigError, match=fragment) as e:
        load_dims(tmp_path)
    assert one_line(e.value)


def test_config_json_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ModelConfigError, match="is not a regular file"):
        load_dims(tmp_path)
