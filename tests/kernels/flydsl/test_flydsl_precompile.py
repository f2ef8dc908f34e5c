"""`monodecode-ops precompile` -> manifest -> the FlyDSL backend's startup load, on this CPU machine.

What runs for real: the FlyDSL compiler (both archs), the artifact store's checksums, FlyDSL's
run-only cache lookup (the exact load path of a ROCm node up to the first launch), and the
backend's refusals. Only launching the kernels needs AMD silicon (README: FlyDSL on AMD Instinct).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("flydsl", reason="the flydsl extra is not installed")

from monodecode.errors import ArtifactError, RefusalError
from monodecode.kernels.base import BuildRequest
from monodecode.kernels.flydsl import bake
from monodecode.kernels.flydsl.backend import FlyDSLBackend
from monodecode.kernels.registry import backend_status
from monodecode.model.profiles import profile_dims
from monodecode.services.artifacts import ArtifactStore
from monodecode.services.platform import Platform
from monodecode_ops.cli import app

WIDTHS = (1, 2)


def mi300x(cus: int = 304, partition: str = "SPX", torch_usable: bool = True) -> Platform:
    return Platform(
        kind="rocm",
        arch="gfx942",
        name="AMD Instinct MI300X",
        compute_units=cus,
        partition_mode=partition,
        source="torch" if torch_usable else "kfd",
        torch_usable=torch_usable,
    )


def request(platform: Platform, weight_dtype: str = "bf16", widths=WIDTHS) -> BuildRequest:
    return BuildRequest(
        dims=profile_dims("tiny"), weight_dtype=weight_dtype, tp_size=1, widths=widths, block_size=16, platform=platform
    )


@pytest.fixture(scope="module")
def baked(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("artifacts")
    res = CliRunner().invoke(
        app,
        [
            "precompile",
            "--arch",
            "gfx942",
            "--profile",
            "tiny",
            "--out",
            str(out),
            "--widths",
            ",".join(map(str, WIDTHS)),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    return out


def test_manifest_entry_matches_the_runtime_build_key(baked):
    store = ArtifactStore(baked)
    key = FlyDSLBackend().build_key(request(mi300x()))
    entry = store.lookup(key)  # verifies every file's sha256
    assert entry is not None and entry.backend == "flydsl" and entry.arch == "gfx942"
    assert entry.widths == WIDTHS and entry.compiler["name"] == "flydsl"
    assert entry.dims_digest == profile_dims("tiny").digest()
    kinds = {Path(f.path).suffix for f in entry.files}
    assert kinds == {".pkl", ".hsaco"}
    assert set(entry.extra["kernels"]) == {"1", "2"}
    # another arch / dtype / width set is another key: nothing found
    assert store.lookup(FlyDSLBackend().build_key(request(mi300x(), widths=(1, 2, 4)))) is None


def test_baked_cache_loads_run_only_without_compiling(baked, tmp_path):
    store = ArtifactStore(baked)
    entry = store.lookup(FlyDSLBackend().build_key(request(mi300x())))
    run = bake.stage_run_cache(entry, tmp_path / "run", store)
    bake.check_run_only("gfx942", profile_dims("tiny"), list(WIDTHS), "bf16", 16, run)
    # an empty cache misses: run-only never falls back to compiling
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="no usable AOT cache"):
        bake.check_run_only("gfx942", profile_dims("tiny"), list(WIDTHS), "bf16", 16, tmp_path / "empty")


def test_one_code_object_serves_contiguous_and_vllm_kv_caches(baked, tmp_path):
    """The KV strides are K1 launch arguments, not constants of the code object: tracing K1 with
    the arguments of the reference's contiguous cache and of vLLM 0.33's interleaved K|V views
    (built by the plugin's own ``kv_views``) hits the same baked cache entry for every width."""
    import torch

    from monodecode.kernels.flydsl.kv import kv_launch_args
    from monodecode.model.paged_kv import PagedKVCache
    from monodecode.vllm_plugin.step import kv_views

    dims = profile_dims("tiny")
    plain = PagedKVCache.allocate(dims, 4, 16, num_layers=1)
    raw = torch.zeros(4, 16, dims.num_kv_heads, 2 * dims.head_dim, dtype=torch.bfloat16)
    vllm = kv_views([raw.permute(0, 2, 1, 3)], dims.num_kv_heads, dims.head_dim)
    layouts = [
        kv_launch_args(kv.key[0], kv.value[0], dims.num_kv_heads, dims.head_dim, 16).named() for kv in (plain, vllm)
    ]
    assert layouts[0] != layouts[1]
    store = ArtifactStore(baked)
    entry = store.lookup(FlyDSLBackend().build_key(request(mi300x())))
    run = bake.stage_run_cache(entry, tmp_path / "run", store)
    hits = bake.check_run_only("gfx942", dims, list(WIDTHS), "bf16", 16, run, k1_scalars=layouts)
    assert hits[0] == hits[1]
    root = entry.extra["cache_root"] + "/"
    baked_files = {
        int(w): {k: rec["cache_file"].removeprefix(root) for k, rec in ks.items()}
        for w, ks in entry.extra["kernels"].items()
    }
    assert hits[0] == baked_files  # the very files precompile wrote: one code object per width and kernel


def test_tampered_artifact_is_refused(baked, tmp_path):
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(baked, copy)
    store = ArtifactStore(copy)
    key = FlyDSLBackend().build_key(request(mi300x()))
    victim = next(f for f in store.lookup(key).files if f.path.endswith(".pkl"))
    data = bytearray((copy / victim.path).read_bytes())
    data[len(data) // 2] ^= 0x01
    (copy / victim.path).write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        store.lookup(key)
    with pytest.raises(RefusalError) as err:
        FlyDSLBackend().build(request(mi300x()), weights=None, artifacts=store, allow_jit=False)
    assert err.value.codes == ["artifact_checksum"]


class SwapAfterLookup(ArtifactStore):
    """A real store whose files are swapped by someone with write access to the artifact directory
    right after ``lookup`` verified them (the window before the cache entries are staged)."""

    def lookup(self, build_key):
        entry = super().lookup(build_key)
        swap_a_pickle(self.root, entry)
        return entry


def swap_a_pickle(root: Path, entry) -> bytes:
    victim = next(f for f in entry.files if f.path.endswith(".pkl"))
    evil = (b"EVILPICKLE" * (victim.bytes // 10 + 1))[: victim.bytes]  # same size: only the hash tells
    (root / victim.path).write_bytes(evil)
    return evil


def test_a_pickle_swapped_after_lookup_is_never_staged(baked, tmp_path):
    """The run-only cache gets the bytes that were hashed, read once: a file swapped between the
    manifest check and staging is refused, and nothing of the entry is staged."""
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(baked, copy)
    store = ArtifactStore(copy)
    entry = store.lookup(FlyDSLBackend().build_key(request(mi300x())))
    swap_a_pickle(copy, entry)
    run = tmp_path / "run"
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        bake.stage_run_cache(entry, run, store)
    assert not [p for p in run.rglob("*") if p.is_file()], "unverified bytes were staged"
    # through the backend's build: refused with artifact_checksum before anything is loaded
    swapped = SwapAfterLookup(tmp_path / "store2")
    shutil.copytree(baked, swapped.root)
    with pytest.raises(RefusalError) as err:
        FlyDSLBackend().build(request(mi300x()), weights=None, artifacts=swapped, allow_jit=False)
    assert err.value.codes == ["artifact_checksum"]


def test_staged_cache_is_the_verified_bytes(baked, tmp_path):
    store = ArtifactStore(baked)
    entry = store.lookup(FlyDSLBackend().build_key(request(mi300x())))
    run = bake.stage_run_cache(entry, tmp_path / "run", store)
    root = entry.extra["cache_root"]
    staged = {f.path: (run / f.path[len(root) + 1 :]).read_bytes() for f in entry.files if f.path.startswith(root)}
    assert staged and all(data == (baked / path).read_bytes() for path, data in staged.items())


def test_missing_artifact_is_refused_without_jit(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the build's run dir goes
    (tmp_path / "tmp").mkdir()
    with pytest.raises(RefusalError) as err:
        FlyDSLBackend().build(request(mi300x()), weights=None, artifacts=ArtifactStore(tmp_path), allow_jit=False)
    assert err.value.codes == ["no_artifact"]
    assert not list((tmp_path / "tmp").iterdir())  # the refused build's run dir is gone (issue 29)


def test_refusals_before_any_load(tmp_path):
    backend = FlyDSLBackend()
    assert backend.unavailable_reason(mi300x()) is None
    cpx = backend.unavailable_reason(mi300x(cus=38, partition="CPX"))
    assert "38 compute units" in cpx and "304" in cpx
    cuda = Platform(kind="cuda", arch="sm_90", name="H200", compute_units=132)
    assert "gfx942/gfx950" in backend.unavailable_reason(cuda)
    # an MI300X seen only through sysfs (CPU build of torch): nothing could launch the kernels
    sysfs_only = backend.unavailable_reason(mi300x(torch_usable=False))
    assert sysfs_only.startswith("torch cannot launch on AMD Instinct MI300X (gfx942)") and "\n" not in sysfs_only
    statuses = {s.name: s for s in backend_status(mi300x(torch_usable=False))}
    assert not statuses["flydsl"].available and statuses["flydsl"].reason == sysfs_only
    with pytest.raises(RefusalError) as err:  # build refuses before looking for an artifact
        backend.build(
            request(mi300x(torch_usable=False)), weights=None, artifacts=ArtifactStore(tmp_path), allow_jit=False
        )
    assert err.value.codes == ["backend_unavailable"] and "torch cannot launch" in err.value.reasons[0]
    with pytest.raises(RefusalError) as err:  # gfx942 decodes FNUZ FP8, not OCP
        backend.build(
            request(mi300x(), weight_dtype="fp8"), weights=None, artifacts=ArtifactStore(tmp_path), allow_jit=False
        )
    assert err.value.codes == ["weight_dtype"]
    tp2 = BuildRequest(
        dims=profile_dims("tiny"), weight_dtype="bf16", tp_size=2, widths=WIDTHS, block_size=16, platform=mi300x()
    )
    with pytest.raises(RefusalError) as err:  # TP kernels compile, the runtime peer exchange is not wired
        backend.build(tp2, weights=None, artifacts=ArtifactStore(tmp_path), allow_jit=False)
    assert err.value.codes == ["tp_size"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--arch", "gfx90a", "--profile", "tiny"], "'gfx90a' is not one of 'gfx942', 'gfx950'"),
        (["--arch", "gfx942"], "exactly one of --profile NAME or --model DIR"),
        (["--arch", "gfx942", "--profile", "tiny", "--model", "."], "exactly one of"),
        (["--arch", "gfx942", "--profile", "llama9"], "'llama9' is not one of 'tiny'"),
        (["--arch", "gfx942", "--profile", "tiny", "--widths", "1,x"], "must be a comma-separated list of integers"),
        (["--arch", "gfx942", "--profile", "tiny", "--widths", "0"], "entries must be integers between 1 and"),
        (["--arch", "gfx942", "--profile", "tiny", "--widths", "1,17"], "built for widths up to 16, got 17"),
        (["--arch", "gfx942", "--profile", "tiny", "--weight-dtype", "int4"], "'int4' is not one of 'bf16'"),
        (["--arch", "gfx942", "--profile", "tiny", "--tp-size", "16"], "--tp-size must be in 1..8"),
        (["--arch", "gfx942", "--profile", "llama3-8b", "--tp-size", "3"], "tp_size 3 does not divide num_heads 32"),
    ],
)
def test_bad_arguments_are_one_line(args, message, tmp_path):
    res = CliRunner().invoke(app, ["precompile", *args, "--out", str(tmp_path / "out")])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.output
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_bad_model_dir_is_one_line(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    res = CliRunner().invoke(
        app, ["precompile", "--arch", "gfx950", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "out")]
    )
    assert res.exit_code == 2 and res.output.startswith("error: model config: unsupported model_type 'mixtral'")
