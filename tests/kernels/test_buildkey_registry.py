"""Build keys change with every input; the registry loads backends lazily and explains refusals."""

import subprocess
import sys

import pytest

from monodecode.errors import ConfigError
from monodecode.kernels import registry
from monodecode.kernels.base import BuildRequest
from monodecode.kernels.health import decode_health, health_code
from monodecode.model.profiles import profile_dims
from monodecode.services.buildkey import build_key, source_digest
from monodecode.services.faults import Fault, parse_faults
from monodecode.services.platform import Platform

BASE = dict(
    backend="flydsl",
    arch="gfx942",
    dims=profile_dims("tiny"),
    weight_dtype="bf16",
    kv_dtype="bf16",
    tp_size=1,
    widths=(1, 2, 4, 8),
    block_size=16,
    source_digest="s" * 64,
    compiler_version="0.5.0",
)


def test_build_key_is_deterministic_and_sensitive_to_every_input():
    k = build_key(**BASE)
    assert k == build_key(**BASE) and len(k) == 64
    changes = dict(
        backend="triton",
        arch="gfx950",
        dims=profile_dims("llama3-1b"),
        weight_dtype="fp8",
        kv_dtype="fp8",
        tp_size=2,
        widths=(1, 2, 4),
        block_size=32,
        source_digest="t" * 64,
        compiler_version="0.5.1",
    )
    keys = {build_key(**{**BASE, name: value}) for name, value in changes.items()}
    assert len(keys) == len(changes) and k not in keys
    assert build_key(**{**BASE, "dims": profile_dims("tiny").digest()}) == k


def test_source_digest_tracks_content_and_names(tmp_path):
    (tmp_path / "k.py").write_text("a = 1\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__/k.cpython-311.pyc").write_bytes(b"junk")
    d1 = source_digest(tmp_path)
    (tmp_path / "__pycache__/k.cpython-311.pyc").write_bytes(b"other junk")
    assert source_digest(tmp_path) == d1
    (tmp_path / "k.py").write_text("a = 2\n")
    d2 = source_digest(tmp_path)
    assert d2 != d1
    (tmp_path / "k.py").rename(tmp_path / "j.py")
    assert source_digest(tmp_path) != d2
    with pytest.raises(FileNotFoundError):
        source_digest(tmp_path / "missing")


def test_importing_registry_imports_no_kernel_toolchain():
    code = "import sys, monodecode.kernels.registry; print(sorted(m for m in ('triton','flydsl','torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "triton" not in out and "flydsl" not in out


def test_cpu_preference_and_reasons():
    cpu = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)
    st = {s.name: s for s in registry.backend_status(cpu)}
    assert st["reference"].available
    assert not st["flydsl"].available and "gfx942/gfx950" in st["flydsl"].reason
    assert not st["triton"].available and "GPU" in st["triton"].reason
    assert [b.name for b in registry.backends_for(cpu)] == ["reference"]


def test_gpu_preference_order():
    mi300 = Platform(kind="rocm", arch="gfx942", name="MI300X", compute_units=304)
    order = [s.name for s in registry.backend_status(mi300)]
    assert order[:3] == ["flydsl", "triton", "reference"]
    h200 = Platform(kind="cuda", arch="sm_90", name="H200", compute_units=132)
    order = [s.name for s in registry.backend_status(h200)]
    assert order[:2] == ["triton", "reference"]


def test_unknown_and_broken_backends(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown kernel backend 'nope'"):
        registry.get_backend("nope")
    registry.register_lazy("broken", "monodecode_no_such_module:Backend")
    try:
        with pytest.raises(ValueError, match="'broken' is unavailable: cannot import monodecode_no_such_module"):
            registry.get_backend("broken")
        cpu = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)
        st = {s.name: s for s in registry.backend_status(cpu)}
        assert not st["broken"].available and "ModuleNotFoundError" in st["broken"].reason
    finally:
        registry._LAZY.pop("broken", None)
        registry._IMPORT_ERRORS.pop("broken", None)


def test_health_word_roundtrip():
    for site in ("wait_timeout", "nonfinite", "kernel_error"):
        for layer in (None, 0, 61, 1000):
            for kernel in (None, "k1", "k2"):
                code = health_code(site, layer, kernel)
                assert 0 < code < 2**31
                f = decode_health(code)
                assert (f.site, f.layer, f.kernel) == (site, layer, kernel)
    assert decode_health(0) is None
    with pytest.raises(ValueError):
        health_code("bogus")


def test_build_request_validation():
    p = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)
    with pytest.raises(ValueError, match="ascending"):
        BuildRequest(profile_dims("tiny"), "bf16", 1, (4, 2), 16, p)
    with pytest.raises(ValueError, match="weight_dtype"):
        BuildRequest(profile_dims("tiny"), "int8", 1, (1,), 16, p)
    r = BuildRequest(profile_dims("tiny"), "bf16", 1, [1, 2], 16, p)
    assert r.widths == (1, 2) and r.max_width == 2


def test_fault_grammar():
    assert parse_faults(None) == () and parse_faults("  ") == ()
    assert parse_faults("stall:layer=1") == (Fault("stall", layer=1),)
    assert parse_faults("nonfinite:layer=2,step=3,rank=1; corrupt_artifact") == (
        Fault("nonfinite", layer=2, step=3, rank=1),
        Fault("corrupt_artifact"),
    )
    assert str(Fault("stall", layer=1, step=2)) == "stall:layer=1,step=2"
    for bad, frag in [
        ("explode", "unknown fault 'explode'"),
        ("stall:lyer=1", "has no parameter 'lyer'"),
        ("stall:layer=x", "needs a non-negative integer"),
        ("stall:layer", "needs a non-negative integer"),
        ("corrupt_artifact:layer=1", "takes no parameters"),
        ("nonfinite:step=-1", "non-negative integer"),
    ]:
        with pytest.raises(ConfigError, match=frag):
            parse_faults(bad)


def test_reasons_come_from_each_backend(tmp_path, monkeypatch):
    """``backend_status`` reports each backend's own ``unavailable_reason``, also for backends the
    platform does not prefer (flydsl and triton on a CPU): the registry has no name-specific
    sentence of its own."""
    (tmp_path / "monodecode_test_backends.py").write_text(
        "from monodecode.kernels.reference_backend import ReferenceBackend\n"
        "class Picky(ReferenceBackend):\n"
        "    name = 'picky'\n"
        "    @classmethod\n"
        "    def unavailable_reason(cls, platform):\n"
        "        return f'picky wants a unicorn; this is {platform.kind}'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register_lazy("picky", "monodecode_test_backends:Picky")
    try:
        cpu = Platform(kind="cpu", arch="cpu", name="cpu", compute_units=2)
        st = {s.name: s for s in registry.backend_status(cpu)}
        assert st["picky"] == registry.BackendStatus("picky", False, "picky wants a unicorn; this is cpu")
        for name in ("flydsl", "triton"):
            cls = registry._load(name)
            want = cls.unavailable_reason(cpu) if cls else registry._IMPORT_ERRORS[name]
            assert st[name] == registry.BackendStatus(name, False, want)
    finally:
        registry._LAZY.pop("picky", None)
        registry._IMPORT_ERRORS.pop("picky", None)
