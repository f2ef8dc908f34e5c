"""The ring probes compile for the H200 on this CPU: ``benchmarks/loader_probe.py``'s four
kernels, ``benchmarks/step_probe.py``'s whole-layer step and ``benchmarks/kv_ring_probe.py``'s
attention task, at every ring size they time, and ``benchmarks/chunk_probe.py``'s chunk loop for
each weight dtype.

The probes' Gluon kernels cannot run in Triton's interpreter, and a signature drift or a ring that
outgrows shared memory would only show on a GPU machine, where device time is scarce. Here the
loader probe's four kernels (``cp.async``, TMA, TMA from a loader warp of its own, and that with
the schedule compiled in) and the step probe's kernel compile for sm_90 at the probes' default
ring sizes; ptxas reports no spills and the shared memory fits one program per SM (a loader ring
of 7 slots does not: 262148 bytes). The probes check their own output against torch on the GPU.
The step probe's command line refuses garbage in one line before any GPU work.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
SMEM_PER_BLOCK = 227 * 1024  # sm_90's most shared memory for one program


def _compile(fn, sig: dict, consts: dict, aligned: tuple[str, ...] = ()):
    """``fn`` compiled for sm_90 with 8 warps (pointer arguments 16-byte aligned, as torch's
    buffers are and the launcher specialises them on the GPU; so are the integers ``aligned``
    names, multiples of 16 as the launcher specialises them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {**sig, **{k: "constexpr" for k in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t[0] == "*" or n in aligned}
    src = GluonASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})


def _probe(name: str):
    import importlib

    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))

    return importlib.import_module(name)


def _compile_loader(name: str, nbuf: int):
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    probe = _probe("loader_probe")
    consts = {"L": 2, "NPROG": 132, "NBUF": nbuf, "T1": 8, "NW": 8}
    tail = {"x_ptr": "*bf16", "act_ptr": "*fp32", "ctr_ptr": "*i32", "epoch_ptr": "*i32"}
    if name in ("tma", "ws", "nested"):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        d2 = TensorDescriptor.from_tensor(torch.empty(64, probe.H_, dtype=torch.bfloat16), [probe.ROWS_, 256], layout)
        d8 = TensorDescriptor.from_tensor(torch.empty(64, probe.I_, dtype=torch.bfloat16), [probe.ROWS_, 256], layout)
        sig = {"d2": mangle_type(d2), "d8": mangle_type(d8), **tail}
        fn = {"tma": probe.tma_chain, "ws": probe.ws_chain, "nested": probe.nested_chain}[name]
    else:
        sig = {"w_ptr": "*bf16", **tail}
        consts["CUT"] = 0
        fn = probe.loader_chain
    return _compile(fn, sig, consts)


@pytest.mark.parametrize("name", ["cp_async", "tma", "ws", "nested"])
@pytest.mark.parametrize("nbuf", [2, 3, 6])
def test_loader_probe_compiles_for_the_h200(name, nbuf):
    from monodecode.kernels.triton.offline import cuda_resources

    compiled = _compile_loader(name, nbuf)
    res = cuda_resources(name, 1, 8, compiled)
    assert res.spills == 0, res
    # the ring and the stage input: nbuf 32 KiB slots + 32 KiB, one program per SM
    assert nbuf * 32 * 1024 + 32 * 1024 <= compiled.metadata.shared <= SMEM_PER_BLOCK, compiled.metadata.shared


ALL_ON = {"ROT": 1, "POLL": 1, "EARLY": 1, "GU": 1, "MERGE": 1}  # step_probe's on/off knobs


# the rings and attention tasks it times (the tensor-core ones with their 16-position warp steps, the
# K/V ring's beside the 3-slot weight ring), every knob (with 2 K/V tiles or 16-position steps, the
# pairings it times), and the stamped build
@pytest.mark.parametrize(
    ("nbuf", "att", "knobs", "prof"),
    [(3, 0, {}, False), (5, 1, ALL_ON, False), (5, 2, ALL_ON | {"DEPTH": 2}, False),
     (5, 2, {"EARLY": 1, "GU": 1, "MERGE": 1, "PW": 16}, True), (5, 3, {"EARLY": 1, "GU": 1, "PW": 16}, False),
     (3, 4, {"EARLY": 1, "GU": 1, "PW": 16, "KVS": 3, "LAY": 1, "XBF": 1}, False),
     (3, 4, {"EARLY": 1, "GU": 1, "PW": 16, "KVS": 3, "XBF": 1, "TMA": 1, "PF": 4}, False),
     (3, 4, {"EARLY": 1, "GU": 1, "PW": 16, "KVS": 3, "XBF": 1, "MMAV": 1}, False),
     (3, 4, {"EARLY": 1, "GU": 1, "PW": 16, "KVS": 3, "XBF": 1, "MMAV": 1, "NB": 8, "NSPLIT": 2}, True)],
)  # fmt: skip
def test_step_probe_compiles_for_the_h200(nbuf, att, knobs, prof):
    """The whole-layer step (ring, stage staging, attention task and merge) at the rings it times,
    with every attention task and variant knob (the weight ring filled by TMA with chunks asked of L2 through the attention; the GEMV on
    tensor cores at batch 1 and 8, whose staged input holds the K/V ring), and the stamped build
    its timeline runs."""
    from monodecode.kernels.triton.offline import cuda_resources

    probe = _probe("step_probe")
    ptrs = ["w", "gin", "gpost", "x", "act", "kc", "vc", "cs", "part", "ctr", "hctr", "epoch", "ts"]
    kinds = ["*bf16"] * 3 + ["*fp32"] * 2 + ["*bf16"] * 2 + ["*fp32"] * 2 + ["*i32"] * 3 + ["*i64"]
    sig = {f"{n}_ptr": t for n, t in zip(ptrs, kinds)} | {"ctx": "i32", "maxctx": "i32"}
    box = f"tensordesc<bf16[{probe.ROWS_}, {probe.BK_ // probe.TB_}, {probe.TB_}],{probe.TMA_LAYOUT!r}>"
    sig = {"w_ptr": sig.pop("w_ptr"), "wh_desc": box, "wi_desc": box} | sig  # the kernel's argument order
    consts = {
        "L": 2,
        "NPROG": 132,
        "NBUF": nbuf,
        "T0": 2,
        "TO": 1,
        "T1": 8,
        "TD": 1,
        "NSPLIT": 16,
        "ATT": att,
        "PROF": prof,
        "NW": 8,
    }
    off = {"ROT": 0, "POLL": 0, "EARLY": 0, "GU": 0, "MERGE": 0, "DEPTH": 1, "PW": 8, "KVS": 0, "LAY": 0, "XBF": 0,
           "TMA": 0, "NB": 1, "MMAV": 0, "PF": 0}  # fmt: skip
    consts |= off | knobs
    compiled = _compile(probe.step_chain, sig, consts)
    res = cuda_resources("step_chain", 1, 8, compiled)
    assert res.spills == 0, res
    assert nbuf * 32 * 1024 + 32 * 1024 <= compiled.metadata.shared <= SMEM_PER_BLOCK, compiled.metadata.shared
    _shared_as_estimated(probe, consts, compiled)
    # PF chunks asked of L2 at the attention's entry: one prefetch a thread per chunk, PF sites
    assert compiled.asm["ptx"].count("prefetch.global.L2") == consts["PF"]


@pytest.mark.parametrize(
    ("args", "says"),
    [(["--ring", "3,x"], "--ring: not comma-separated integers: '3,x'"),
     (["--attention", "9"], "--attention: 9 is not one of 0-4"),
     (["--contexts", "-1"], "--contexts: negative value in '-1'"),
     (["--tma", "0,2"], "--tma: 2 is not 0 (off) or 1 (on)"),
     (["--batch", "1,9"], "--batch: 9 is not 1 to 8 (mma.sync's 8 columns)"),
     (["--stock", "fullgraph,eager"], "--stock: 'eager' is not one of fullgraph, fullgraph-cdt, fullgraph-cdt-wide, fullgraph-max"),
     (["--model", "qwen3-8b"], "--model: invalid choice: 'qwen3-8b' (choose from 'llama3-1b', 'llama3-8b')"),
     (["--stock-draws", "0"], "--stock-draws: 0 is not 1 or more")],
)  # fmt: skip
def test_step_probe_refuses_bad_arguments_in_one_line(args, says):
    """The step probe's command line: garbage ends in argparse's one error line (exit 2) before any
    GPU work, not a traceback."""
    _refused_in_one_line("step_probe.py", args, says)


def _refused_in_one_line(script: str, args: list[str], says: str) -> None:
    """``benchmarks/<script> args`` exits 2 with one error line ending in ``says``, no traceback."""
    import subprocess

    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(says), done.stderr


@pytest.mark.parametrize(
    ("batch", "ctx", "splits", "pw", "want"),
    [(1, 1024, 0, 16, 8), (1, 8192, 0, 16, 16), (1, 32768, 0, 16, 16), (8, 32768, 0, 16, 2), (4, 1024, 0, 16, 4),
     (1, 100, 0, 16, 1), (1, 1024, 16, 16, 16), (1, 1024, 0, 8, 16)],
)  # fmt: skip
def test_step_probe_splits_fill_the_programs_with_whole_tile_passes(batch, ctx, splits, pw, want):
    """Splits per row and KV head: every split its own program of 132, each at least one pass of
    the 8 warps' ``pw``-position tiles (128 positions at pw 16), a power of two up to 16; a given
    value stands."""
    probe = _probe("step_probe")
    assert probe.splits_for({"splits": splits, "batch": batch, "pw": pw}, 132, ctx) == want


def _shared_as_estimated(probe, consts: dict, compiled) -> None:
    """``shared_bytes`` (what ``_refusal`` checks before compiling) is a lower bound of the compiled
    kernel's shared memory, within the small buffers (1.1 KiB) for attention 4's forms."""
    v = {"ring": consts["NBUF"], "xbf": consts["XBF"], "mmav": consts["MMAV"], "attention": consts["ATT"],
         "kvs": consts["KVS"]}  # fmt: skip
    want, got = probe.shared_bytes(v), compiled.metadata.shared
    assert want <= got and (consts["ATT"] != 4 or got <= want + 1100), (want, got)


def _probe_of_model(model: str, monkeypatch):
    """``step_probe`` as a module object of its own whose shapes are ``model``'s (they are module
    constants, read when the kernel compiles)."""
    import importlib.util

    monkeypatch.setenv("STEP_PROBE_MODEL", model)
    spec = importlib.util.spec_from_file_location(f"step_probe_{model}", ROOT / "benchmarks" / "step_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Llama-3-8B's batch-1 layer: the weight ring by TMA with the K/V ring of its 128-wide heads in the
# staged input's bytes (apart, the two would not fit: 258648 bytes), and the plain per-head task
@pytest.mark.parametrize(("att", "kvs", "tma"), [(4, 2, 1), (0, 0, 0)])
def test_step_probe_compiles_llama3_8b_layers(att, kvs, tma, monkeypatch):
    """The probe at 8B's shapes: two o_proj and two down tiles a program, 14 chunks of down's
    staged input, the weights laid out at whole rows of both K (TMA's row views), compiled for
    sm_90 within one program per SM and without spills."""
    from monodecode.kernels.triton.offline import cuda_resources

    probe = _probe_of_model("llama3-8b", monkeypatch)
    assert (probe.H_, probe.I_, probe.D_) == (4096, 14336, 128)
    for k in (probe.H_, probe.I_):  # weight_descriptors' row views
        assert probe.OFF_D_ % k == 0 and probe.LAYER_W_ % k == 0, k
    assert probe.LAYER_W_ - probe.WEIGHTS_ < probe.H_ * probe.I_  # padding, not a second copy
    tiles = probe.tiles_for(132)
    assert tiles == {"T0": 3, "TO": 2, "T1": 14, "TD": 2}
    ptrs = ["w", "gin", "gpost", "x", "act", "kc", "vc", "cs", "part", "ctr", "hctr", "epoch", "ts"]
    kinds = ["*bf16"] * 3 + ["*fp32"] * 2 + ["*bf16"] * 2 + ["*fp32"] * 2 + ["*i32"] * 3 + ["*i64"]
    sig = {f"{n}_ptr": t for n, t in zip(ptrs, kinds)} | {"ctx": "i32", "maxctx": "i32"}
    box = f"tensordesc<bf16[{probe.ROWS_}, {probe.BK_ // probe.TB_}, {probe.TB_}],{probe.TMA_LAYOUT!r}>"
    sig = {"w_ptr": sig.pop("w_ptr"), "wh_desc": box, "wi_desc": box} | sig
    consts = {"L": 2, "NPROG": 132, "NBUF": 3, **tiles, "NSPLIT": 16, "ATT": att, "PROF": False, "NW": 8, "ROT": 0,
              "POLL": 0, "EARLY": 1, "GU": 1, "MERGE": 0, "DEPTH": 1, "PW": 16, "KVS": kvs, "LAY": 0, "XBF": 1,
              "TMA": tma, "NB": 1, "MMAV": 0, "PF": 0}  # fmt: skip
    compiled = _compile(probe.step_chain, sig, consts)
    res = cuda_resources("step_chain_8b", 1, 8, compiled)
    assert res.spills == 0, res
    assert compiled.metadata.shared <= SMEM_PER_BLOCK, compiled.metadata.shared
    _shared_as_estimated(probe, consts, compiled)
    # what does not fit is refused in one line before any compile
    v = {"ring": 3, "xbf": 1, "mmav": 0, "attention": 4, "kvs": 3, "merge": 0, "pw": 16, "batch": 1, "tma": 1, "gu": 1}
    assert "shared memory" in probe._refusal(v, 16, 132, tiles)
    assert "shared memory" in probe._refusal(v | {"kvs": 2, "xbf": 0}, 16, 132, tiles)
    assert probe._refusal(v | {"kvs": 2}, 16, 132, tiles) == ""


# the K/V ring probe: head_dim 64 (1B) at every depth it times, 128 (8B) at the two that fit, 32
# positions a warp's step at head_dim 64, and the copies alone
@pytest.mark.parametrize(("d", "kvs", "pw", "copy"), [(64, 2, 16, 0), (64, 3, 16, 0), (64, 6, 16, 0), (128, 2, 16, 0),
                                                      (128, 3, 16, 0), (64, 2, 32, 0), (64, 3, 32, 0), (64, 3, 16, 1),
                                                      (64, 2, 32, 1), (128, 2, 16, 1)])  # fmt: skip
def test_kv_ring_probe_compiles_for_the_h200(d, kvs, pw, copy):
    """``benchmarks/kv_ring_probe.py``'s task (the step kernel's ``_attend`` behind its first K/V
    tiles) compiles for sm_90 without spills at the depths it times, each program holding more
    than half an SM's shared memory (one an SM, as the step's programs are) and no more than a
    program may."""
    from monodecode.kernels.triton.offline import cuda_resources

    probe = _probe("kv_ring_probe")
    slots = probe.held_slots(kvs, pw, d)
    sig = {"act_ptr": "*fp32", "part_ptr": "*fp32", "kc_ptr": "*bf16", "vc_ptr": "*bf16"}
    strides = ("k_sb", "k_st", "k_sh", "v_sb", "v_st", "v_sh")  # multiples of 16, as the launcher specialises them
    sig |= {n: "i32" for n in strides}
    sig |= {"bt_ptr": "*i32", "bt_stride": "i32", "inv_ptr": "*fp32", "ctx": "i32", "slot": "i32"}
    consts = {"QH": 32, "KVH": 8, "D": d, "BS": 16, "SCALE": d**-0.5, "NSPLIT": 2, "KVS": kvs, "SLOTS": slots, "NW": 8,
              "PW": pw, "COPY": copy}  # fmt: skip
    compiled = _compile(probe._task, sig, consts, aligned=strides)
    assert cuda_resources("kv_ring_probe", 1, 8, compiled).spills == 0
    assert ("mma.sync" in compiled.asm["ptx"]) == (not copy)  # the copies alone do no arithmetic
    # more than half an SM's shared memory (228 KiB on sm_90), so one program an SM
    assert 114 * 1024 < compiled.metadata.shared <= SMEM_PER_BLOCK, compiled.metadata.shared


@pytest.mark.parametrize(
    ("args", "says"),
    [(["--depths", "1,3"], "--depths: values must be 2 to 8, got '1,3'"),
     (["--batches", "1,x"], "--batches: not comma-separated integers: '1,x'"),
     (["--profiles", "gemma3-27b"], "--profiles: 'gemma3-27b' is not one of llama3-1b, llama3-8b"),
     (["--layouts", "planes,rows"], "--layouts: 'rows' is not one of planes, heads"),
     (["--warp-positions", "24"], "--warp-positions: values must be multiples of 16 from 16 to 32, got '24'"),
     (["--tasks", "copy,sum"], "--tasks: 'sum' is not one of attend, copy"),
     (["--blocks", "random"], "--blocks: 'random' is not one of shuffled, sequential"),
     ([], "error: kv_ring_probe needs an sm_90 or newer GPU")],
)  # fmt: skip
def test_kv_ring_probe_refuses_in_one_line(args, says):
    """Garbage on the K/V ring probe's command line, or no sm_90 GPU (this machine), ends in one
    error line (exit 2), not a traceback."""
    import torch

    if not args and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        pytest.skip("an sm_90 GPU is present: the probe would run")
    _refused_in_one_line("kv_ring_probe.py", [*args, "--out", "/nonexistent/x"], says)


@pytest.mark.parametrize("dtype", ["*bf16", "*fp8e4nv"])
def test_chunk_probe_compiles_for_the_h200(dtype):
    """The chunk probe's loop (the step's width-1 arithmetic) for bf16 and e4m3 weights: no
    spills, its four chunks and their inputs in shared memory, e4m3 widened by cvt as the step's."""
    from monodecode.kernels.triton.offline import cuda_resources

    probe = _probe("chunk_probe")
    sig = {"w_ptr": dtype, "x_ptr": "*bf16", "out_ptr": "*fp32", "t_ptr": "*i64"}
    compiled = _compile(probe.chunk_loop, sig, {"N": 100, "NW": 8})
    assert cuda_resources("chunk_loop", 1, 8, compiled).spills == 0
    esize = 2 if dtype == "*bf16" else 1
    assert compiled.metadata.shared >= probe.SLOTS * probe.ROWS * probe.BK * esize + probe.SLOTS * probe.BK * 2
    assert ("cvt.rn.f16x2.e4m3x2" in compiled.asm["ptx"]) == (esize == 1)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [(["--dtypes", "fp16"], "--dtypes: 'fp16' is not one of bf16, fp8"), (["--dtypes", ","], "--dtypes: ',' is not one of"),
     (["--chunks", "0"], "--chunks must be 1 to 1000000, got 0")],
)  # fmt: skip
def test_chunk_probe_refuses_bad_arguments_in_one_line(argv, fragment, capsys, tmp_path):
    """Before any GPU work, whatever the machine: one ``error:`` line, exit status 2, nothing written."""
    assert _probe("chunk_probe").main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
