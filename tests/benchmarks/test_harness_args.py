"""The decode-latency harness refuses bad arguments with one line before it needs a GPU, and its
command line reaches ``run`` as given."""

from __future__ import annotations

import pytest

from monodecode.errors import MonodecodeError
from monodecode_ops.decode_bench import harness


@pytest.mark.parametrize(
    "profiles, fp8, batches, contexts, extra, fragment",
    [
        (["nope"], [], [1], 16, {}, "unknown model profile 'nope'; known: tiny,"),
        (["tiny"], ["nope8"], [1], 16, {}, "unknown model profile 'nope8'"),
        (["tiny"], [], [0], 16, {}, "batches must be in 1..16"),
        (["tiny"], [], [], 16, {}, "batches must be in 1..16"),
        (["tiny"], [], [1], 0, {}, "contexts must be >= 1"),
        (["tiny"], [], [1], [1024, 0], {}, "contexts must be >= 1, got [1024, 0]"),
        (["tiny"], [], [1], [], {}, "contexts must be >= 1, got []"),
        (["tiny"], [], [1], [1 << 20], {}, "context 1048576 exceeds tiny's max_position_embeddings"),
        (["tiny"], [], [1], [64], {"stock": ["fullgraph", "nope"]}, "unknown stock path 'nope'; known: eager,"),
        (["tiny"], [], [1], [64], {"w8a16_batches": [0]}, "--w8a16-batches must be >= 1"),
        (["tiny"], [], [1], [64], {"tuning_draws": 0}, "--tuning-draws must be >= 1, got 0"),
        (["tiny"], [], [1], [64], {"variants": {"step": {}}}, "variant 'step': its name is the step launch's"),
        (["tiny"], [], [1], [64], {"variants": {"step-pf4": {}}}, "variant 'step-pf4': its name is a step variant's"),
        (["tiny"], [], [1], [64], {"step_variants": {"r": {"ring": 9}}}, "step variant 'r': step launch plan: ring"),
        (["tiny"], [], [1], [64], {"step_variants": [1]}, "--step-variants must be a JSON object"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, profiles, fp8, batches, contexts, extra, fragment):
    with pytest.raises(MonodecodeError) as err:
        harness.run(profiles, batches, contexts, None, fp8, 1, tmp_path, **extra)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--contexts", "1024,x"], "error: bad list '1024,x': expected comma-separated int values"),
        (["--stock", "fullgraph,cudnn"], "error: unknown stock path 'cudnn'"),
        (["--replays", "0"], "error: --replays must be >= 1, got 0"),
        (["--deadline-s", "-5"], "error: --deadline-s must be > 0, got -5.0"),
        (["--variants", "[1]"], "error: --variants must be a JSON object"),
        (["--variants", '{"att_pad": 0}'], "error: variant 'att_pad': att_pad is a step launch plan knob: time it"),
        (["--variants", '{"x": {"ring": 4}}'], "error: variant 'x': ring is a step launch plan knob: time it"),
        (["--tuning-draws", "0"], "error: --tuning-draws must be >= 1, got 0"),
        (["--step-variants", "{pf4: 1}"], "error: --step-variants is not JSON: Expecting property name"),
        (["--step-variants", "[1]"], "error: --step-variants must be a JSON object (name -> step launch plan)"),
        (["--step-variants", '{"a b": {}}'], "error: step variant 'a b': a name is letters, digits, '_' and inner '-'"),
        (["--step-variants", '{"-x": {}}'], "error: step variant '-x': a name is letters"),
        (
            ["--step-variants", '{"x": 4}'],
            "error: step variant 'x': expected an object of step launch plan knobs (ring, stream_down, wide_tma, kv_step, early_down, mma1, span, one_box, att_pad, one_sum, grid)",
        ),
        (["--step-variants", '{"x": {"nbuf": 4}}'], "error: step variant 'x': step launch plan: unknown knob 'nbuf'"),
        (
            ["--step-variants", '{"x": {"pf": 8}}'],
            "error: step variant 'x': step launch plan: unknown knob 'pf' (known: ring, stream_down, wide_tma, kv_step, early_down, mma1, span, one_box, att_pad, one_sum, grid)",
        ),
        (
            ["--step-variants", '{"x": {"ring": 1}}'],
            "error: step variant 'x': step launch plan: ring must be an integer 2-8",
        ),
        (
            ["--step-variants", '{"x": {"ring": 4.0}}'],
            "error: step variant 'x': step launch plan: ring must be an integer",
        ),
        # the prewarm takes the run's arguments (device_run.sh's BENCH_ARGS): a bad one fails it too
        (
            ["--prewarm-only", "--step-variants", '{"x": {"ring": -1}}'],
            "error: step variant 'x': step launch plan: ring",
        ),
    ],
)
def test_command_line_errors_are_one_line(tmp_path, capsys, argv, fragment):
    assert harness.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(fragment) and "\n" not in err, err
    assert not any(tmp_path.iterdir())


def test_contexts_default_to_1k_8k_32k_and_context_selects_one(monkeypatch, tmp_path):
    """``--contexts`` defaults to the three contexts of issue 26; ``--context N`` runs one; the
    profiles, batches and stock paths reach ``run`` as given."""
    seen = {}

    def fake_run(profiles, batches, contexts, *args, **kw):
        seen.update(profiles=profiles, batches=batches, contexts=contexts, stock=kw["stock"], long=kw["long_batches"])
        raise harness.MonodecodeError("stop")

    monkeypatch.setattr(harness, "run", fake_run)
    harness.main(["--profiles", "llama3-8b", "--fp8-profiles", "", "--out", str(tmp_path)])
    assert seen == {
        "profiles": ["llama3-8b"],
        "batches": [1, 2, 4, 8],
        "contexts": [1024, 8192, 32768],
        "stock": ["contig", "fullgraph", "fullgraph-cdt", "fullgraph-splitk", "floor"],
        "long": [1, 8],
    }
    harness.main(["--context", "2048", "--batches", "1,8", "--stock", "fullgraph", "--out", str(tmp_path)])
    assert seen["contexts"] == [2048] and seen["batches"] == [1, 8] and seen["stock"] == ["fullgraph"]
    harness.main(["--long-context-batches", "all", "--out", str(tmp_path)])
    assert seen["long"] is None


def test_each_fp8_profile_runs_right_after_its_bf16_one():
    """A run cut short by its deadline keeps an FP8 profile together with its BF16 bar."""
    order = harness.config_order(["llama3-1b", "llama3-8b", "gemma3-27b"], ["llama3-8b", "qwen3-8b"])
    assert order == [
        ("llama3-1b", "bf16"),
        ("llama3-8b", "bf16"),
        ("llama3-8b", "fp8"),
        ("gemma3-27b", "bf16"),
        ("qwen3-8b", "fp8"),
    ]


def test_a_tuned_stock_is_timed_at_its_fastest_draw():
    """Of several compiles of a tuned stock, the one with the lowest median counts (a lucky fastest
    replay does not), its output and capture time with it; the first of equal medians."""
    from monodecode_ops.decode_bench.fullgraph import fastest_draw

    slow_with_one_fast_replay = ([1.0e-3, 2.0e-3, 2.1e-3], "out-a", 9.0)
    steady = ([1.5e-3, 1.5e-3, 1.6e-3], "out-b", 4.0)
    same_median = ([1.4e-3, 1.5e-3, 1.5e-3], "out-c", 3.0)
    assert fastest_draw([slow_with_one_fast_replay, steady, same_median]) == steady


@pytest.mark.parametrize("callers_setting", [False, True])
def test_draws_after_the_first_compile_with_inductors_caches_off(callers_setting):
    """Each draw runs once; the first under the caller's cache setting (as
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 sets it: not forced back on), the later ones with
    inductor's caches off so they tune afresh; the setting is as it was after; a later draw that
    fails is one line and leaves the others, a failing first draw raises."""
    import torch._inductor.config as inductor_config

    from monodecode_ops.decode_bench.fullgraph import tuning_draws

    seen = []

    def draw():
        seen.append(inductor_config.force_disable_caches)
        if len(seen) == 3:
            raise RuntimeError("out of memory\nthe rest")
        return len(seen)

    with inductor_config.patch(force_disable_caches=callers_setting):
        got, failed = tuning_draws(draw, 4)
        assert inductor_config.force_disable_caches == callers_setting
    assert seen == [callers_setting, True, True, True]
    assert got == [1, 2, 4]
    assert failed == ["draw 2: RuntimeError: out of memory"]

    def broken():
        raise ValueError("no compiler")

    with pytest.raises(ValueError):
        tuning_draws(broken, 3)


def test_every_stock_path_is_wired_through_to_the_verdict_and_the_plots():
    """A stock the command line takes is built (a fullgraph kind or another path), counts in the
    verdict's "strongest stock" and has a plot label; a tuned one is compiled, so it can be drawn."""
    from monodecode_ops.decode_bench import report
    from monodecode_ops.decode_bench.fullgraph import FULLGRAPH_STOCKS

    for backend in harness.STOCK_PATHS.values():
        assert backend in report.LABELS, backend
        if backend.startswith("stock-") and backend != "stock-gemm-floor":
            assert backend in report.STOCK_BACKENDS, backend
    assert set(FULLGRAPH_STOCKS) <= set(harness.COMPILED) & set(harness.STOCK_PATHS.values())
    assert set(harness.TUNED) <= set(FULLGRAPH_STOCKS)
    assert not harness.stock_runs("stock-fullgraph-max", True, 1, (1,))  # FP8 W8A16 would widen every weight


def test_the_prewarm_leaves_stocks_that_tune_while_compiling_to_the_benchmark():
    """max-autotune picks its GEMMs while it compiles: warmed on the prewarm's busy GPU, the cached
    graph would carry those choices into the benchmark."""
    from monodecode_ops.decode_bench import prewarm

    jobs = prewarm.jobs(["llama3-1b"], [], [1], [1024], None, ("fullgraph", "fullgraph-cdt", "fullgraph-max"), ())
    assert jobs and all(job[4] == ["stock-fullgraph", "stock-fullgraph-cdt"] for job in jobs)


def test_no_step_leaves_the_step_launch_out(monkeypatch, tmp_path):
    """The step launch is timed unless ``--no-step`` is given (``run(step=...)``)."""
    seen = []

    def fake_run(*args, **kw):
        seen.append(kw["step"])
        raise harness.MonodecodeError("stop")

    monkeypatch.setattr(harness, "run", fake_run)
    harness.main(["--out", str(tmp_path)])
    harness.main(["--no-step", "--out", str(tmp_path)])
    assert seen == [True, False]


def _platform(kind="cuda", arch="sm_90", usable=True):
    from monodecode.services.platform import Platform

    return Platform(kind=kind, arch=arch, name="GPU", compute_units=132, source="torch", torch_usable=usable)


def _request(profile, widths, platform, weight_dtype="bf16"):
    from monodecode.kernels.base import BuildRequest
    from monodecode.model.profiles import profile_dims

    return BuildRequest(
        dims=profile_dims(profile),
        weight_dtype=weight_dtype,
        tp_size=1,
        widths=widths,
        block_size=harness.BLOCK,
        platform=platform,
    )


def test_the_step_launch_is_timed_where_it_runs_and_says_why_not_elsewhere():
    """The harness asks the ``triton-step`` backend, width by width: on CUDA sm_90+ it serves 1B and
    8B at widths 1-8 and Gemma-3 at width 1; any other platform, fnuz FP8 weights, Gemma-3 above
    1 row and widths over 8 are refused, each with its reason."""
    by_width = harness.step_refusals_by_width
    assert by_width(_request("llama3-1b", (1, 2, 4, 8), _platform())) == {}
    assert by_width(_request("llama3-1b", (1, 8), _platform(arch="sm_100"))) == {}
    assert by_width(_request("llama3-8b", (1, 2, 8), _platform())) == {}
    over = by_width(_request("llama3-1b", (8, 16), _platform()))
    assert list(over) == [16] and "model_dims: the step launch decodes 1-8 rows" in over[16]
    for platform in (_platform("cpu", "cpu", False), _platform(arch="sm_80"), _platform("rocm", "gfx942")):
        refused = by_width(_request("llama3-1b", (1, 8), platform))
        assert sorted(refused) == [1, 8] and all(why.startswith("no_gpu: ") for why in refused.values()), refused
    assert "torch cannot launch" in by_width(_request("llama3-1b", (1,), _platform(usable=False)))[1]
    assert by_width(_request("llama3-8b", (1, 2, 8), _platform(), "fp8")) == {}
    assert by_width(_request("llama3-8b", (1,), _platform(), "fp8_fnuz"))[1].startswith("weight_dtype: fp8_fnuz")
    gemma = by_width(_request("gemma3-27b", (1, 2, 8), _platform()))
    assert sorted(gemma) == [2, 8] and all("Gemma-3 layers at width 1 only" in why for why in gemma.values())


def _ctx(profile, step_not_run, kernels=None, step=True):
    """The part of ``bench_config``'s cell context that a cell's backends and rows read."""
    from monodecode.model.profiles import profile_dims

    return {
        "profile": profile,
        "weight_dtype": "bf16",
        "dims": profile_dims(profile),
        "n_layers": 2,
        "wbytes": 1 << 30,
        "bandwidth": 4e12,
        "spec": 4.8e12,
        "variants": {},
        "stock": ("fullgraph",),
        "paths": {"stock-fullgraph": object()},
        "stock_path": "bf16",
        "kernels": {"triton": object()} if kernels is None else kernels,
        "step": step,
        "step_not_run": step_not_run,
    }


def test_a_refused_width_records_why_in_its_cell(monkeypatch):
    """Width 16 (and any width on a CPU): the cell times every other backend and records the
    step launch as skipped with the refusal's reason; at a width it runs it is timed like triton;
    ``--no-step``: it is not in the cell at all."""
    logs = []
    req = _request("llama3-1b", (1, 16), _platform())
    built = []

    class FakeStep:
        widths = (1,)

        def residency_misfits(self, width=None):
            return []

    def fake_build(req_, widths, weights):
        built.append(widths)
        return FakeStep()

    monkeypatch.setattr(harness, "_step_kernels", fake_build)
    tk, not_run = harness._build_step(req, None, logs.append)
    assert built == [(1,)] and isinstance(tk, FakeStep)
    why, skipped = not_run[16]
    assert skipped and why.startswith("skipped: the step launch refuses width 16: ") and "decodes 1-8 rows" in why
    assert 1 not in not_run
    assert any("not timed at width 16" in line for line in logs)

    ctx = _ctx("llama3-1b", not_run, kernels={"triton": FakeStep(), harness.STEP_BACKEND: tk})
    for rows, timed_step in ((1, True), (16, False)):
        wanted = harness._cell_backends(ctx, rows, floor=False, w8a16_batches=())
        assert wanted == ["reference-graph", "stock-fullgraph", "triton", harness.STEP_BACKEND]
        timed, recorded = harness._step_refused(ctx, rows, 1024, wanted)
        assert (harness.STEP_BACKEND in timed) == timed_step and len(recorded) == (not timed_step)
    (row,) = recorded
    assert row["backend"] == harness.STEP_BACKEND and row["batch"] == 16 and row["skipped"] is True
    assert row["error"] == why and row["step_ms"] is None and row["triton_programs_per_sm"] is None
    assert row["step_floor_ms"] is None  # (no width-16 build: no tiling)

    # a width it built: its floor is the weights at the busiest program's share, the K/V as they are
    from monodecode.kernels.triton.step_plan import StepGeometry

    tk.geometry = {1: StepGeometry(ctx["dims"], 1, 132)}
    row = harness._row(ctx, 1, 1024, harness.STEP_BACKEND, [1e-3], None, 1e-3, 1.0)
    kv = harness.kv_bytes(ctx["dims"], 2, 1024, 1)
    share = 30 / (3712 / 132)  # 1B: the busiest program's 30 chunks a layer against the mean
    assert row["step_floor_ms"] == pytest.approx(((1 << 30) * share + kv) / 4e12 * 1e3)
    assert row["step_floor_ms"] > row["roofline_ms"]
    assert harness._row(ctx, 1, 1024, "triton", [1e-3], None, 1e-3, 1.0)["step_floor_ms"] is None

    # CPU: refused at every width, never built; still one row a cell saying why
    cpu_tk, cpu = harness._build_step(_request("llama3-1b", (1, 8), _platform("cpu", "cpu", False)), None, print)
    assert cpu_tk is None and all(skipped and "no_gpu: " in why for why, skipped in cpu.values())
    ctx = _ctx("llama3-1b", cpu)
    wanted = harness._cell_backends(ctx, 1, floor=False, w8a16_batches=())
    assert wanted[-1] == harness.STEP_BACKEND
    timed, (row,) = harness._step_refused(ctx, 1, 1024, wanted)
    assert harness.STEP_BACKEND not in timed and row["skipped"] is True
    assert row["error"].startswith(
        "skipped: the step launch refuses width 1: no_gpu: the step launch is a Gluon kernel"
    )

    ctx = _ctx("llama3-1b", {}, step=False)
    wanted = harness._cell_backends(ctx, 1, floor=False, w8a16_batches=())
    assert harness.STEP_BACKEND not in wanted and harness._step_refused(ctx, 1, 1024, wanted) == (wanted, [])


def test_a_step_build_that_fails_fails_its_cells_without_ending_the_run(monkeypatch):
    """A build that raises (e.g. the kernel does not compile) is one logged line; the widths it was
    for record the error as failed (not skipped) cells, the refused ones stay skipped."""

    def broken(*args):
        raise RuntimeError("gluon compile failed\ndetails")

    monkeypatch.setattr(harness, "_step_kernels", broken)
    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda *a: None)
    logs = []
    tk, not_run = harness._build_step(_request("llama3-8b", (1, 16), _platform()), None, logs.append)
    assert tk is None and not_run[1] == ("build failed: RuntimeError: gluon compile failed", False)
    assert not_run[16][1] is True
    assert any(f"! {harness.STEP_BACKEND} build failed" in line for line in logs)


def test_step_variants_reach_run_and_the_prewarm_takes_them(monkeypatch, tmp_path):
    """``--step-variants`` JSON reaches ``run`` as given (default ``DEFAULT_STEP_VARIANTS``, ``{}``:
    none); the prewarm (``--prewarm-only``, the same BENCH_ARGS in device_run.sh) accepts it."""
    seen, warmed = [], []

    def fake_run(*args, **kw):
        seen.append(kw["step_variants"])
        raise harness.MonodecodeError("stop")

    monkeypatch.setattr(harness, "run", fake_run)
    monkeypatch.setattr(harness, "_prewarm", lambda a, contexts: warmed.append(a.step_variants) or 0)
    harness.main(["--out", str(tmp_path)])
    harness.main(["--step-variants", "{}", "--out", str(tmp_path)])
    harness.main(["--step-variants", '{"ring4": {"ring": 4}, "ring2": {"ring": 2}}', "--out", str(tmp_path)])
    assert seen == [None, {}, {"ring4": {"ring": 4}, "ring2": {"ring": 2}}]
    assert harness.DEFAULT_STEP_VARIANTS == {}
    harness.check_step_variants(harness.DEFAULT_STEP_VARIANTS)
    assert harness.main(["--prewarm-only", "--step-variants", '{"r4":{"ring":4}}', "--out", str(tmp_path)]) == 0
    assert warmed == ['{"r4":{"ring":4}}']


def test_the_run_records_its_step_variants_and_builds_them_where_the_step_launch_runs(monkeypatch, tmp_path):
    """The result document's header holds the step variants (none with ``step=False``) and every
    profile's build is given them."""
    built = []

    def fake_bench_config(*args, **kw):
        built.append((kw["step"], kw["step_variants"]))
        return []

    monkeypatch.setattr(harness, "DEVICE", "cpu")
    monkeypatch.setattr(harness, "gpu_identity", lambda: ("GPU", "GPU-1"))
    monkeypatch.setattr(harness, "read_probes", lambda device: {"copy": 3e12})
    monkeypatch.setattr(harness, "bench_config", fake_bench_config)
    doc = harness.run(["llama3-1b"], [1], [64], 1, [], 1, tmp_path, log=lambda *a: None)
    assert doc["step_variants"] == harness.DEFAULT_STEP_VARIANTS and doc["step"] is True
    assert (doc["gpu"], doc["gpu_uuid"]) == ("GPU", "GPU-1")
    plan = {"ring4": {"ring": 4}}
    doc = harness.run(["llama3-1b"], [1], [64], 1, [], 1, tmp_path, log=lambda *a: None, step_variants=plan)
    assert doc["step_variants"] == plan
    doc = harness.run(["llama3-1b"], [1], [64], 1, [], 1, tmp_path, log=lambda *a: None, step=False)
    assert doc["step_variants"] == {}
    assert built == [(True, harness.DEFAULT_STEP_VARIANTS), (True, plan), (False, harness.DEFAULT_STEP_VARIANTS)]


def test_a_step_variant_is_timed_at_the_widths_its_plan_fits():
    """The shared-memory budget of a longer weight ring: 1B fits ring 4 at every width with down's
    input streamed (the default above 1 row), only at width 1 when it is staged whole beside the
    ring; a 2-slot ring fits every width; 8B at width 1 has no room for a fourth slot."""
    from monodecode.model.profiles import profile_dims

    one_b, eight_b = profile_dims("llama3-1b"), profile_dims("llama3-8b")
    widths = tuple(range(1, 9))
    fits, why = harness.step_variant_widths(one_b, widths, 132, {"ring": 4, "stream_down": 0})
    assert fits == (1,) and sorted(why) == list(range(2, 9))
    assert all("bytes of shared memory at width" in r for r in why.values()), why
    assert harness.step_variant_widths(one_b, widths, 132, {"ring": 2}) == (widths, {})
    # streamed, down's input needs a few X slots, not all of it: a fourth slot fits every width
    fits, why = harness.step_variant_widths(one_b, widths, 132, {"ring": 4})
    # 4 slots: the default at widths 2-7; at 8 the default's 32-position K/V slots take the room
    assert fits == (1,) and all("default plan's kernel" in why[w] for w in range(2, 8)), why
    assert "shared memory at width 8" in why[8], why
    fits, why = harness.step_variant_widths(eight_b, (1,), 132, {"ring": 4})
    assert fits == () and "does not fit width 1" in why[1] and "shared memory at width 1" in why[1]
    assert harness.step_variant_widths(eight_b, (1,), 132, {"ring": 2}) == ((1,), {})
    # a knob's default at some widths (32 positions a warp from width 8) and the default plan
    # itself: the default's kernel, not timed twice
    fits, why = harness.step_variant_widths(one_b, widths, 132, {"kv_step": 2})
    assert fits == tuple(range(1, 8)) and "default plan's kernel at width 8" in why[8], why
    fits, why = harness.step_variant_widths(one_b, widths, 132, {})
    assert fits == () and "width 1 (nothing in it applies there)" in why[1]
    # FP8's weight chunks span two 1024-column parts (32 KiB, as bf16's): its default ring is
    # bf16's 3 slots, and with one part a chunk (16 KiB) 5 slots hold as many bytes in flight
    fits, why = harness.step_variant_widths(eight_b, (1,), 132, {"ring": 3}, "fp8")
    assert fits == () and "default plan's kernel" in why[1], why
    fits, why = harness.step_variant_widths(eight_b, (1,), 132, {"ring": 4}, "fp8")
    assert fits == () and "shared memory at width 1" in why[1], why
    assert harness.step_variant_widths(eight_b, (1, 2), 132, {"span": 1}, "fp8") == ((1, 2), {})
    from monodecode.kernels.triton.step_plan import StepGeometry

    assert StepGeometry(eight_b, 1, 132, weight_dtype="fp8", span=1).ring_slots == 5


def test_step_variants_sit_beside_the_step_launch_and_say_why_where_they_do_not_run(monkeypatch):
    """Each variant is built for the widths the step launch was built for that its plan fits; the
    others are skipped cells saying why, a failed build fails its cells only; a variant is in a
    cell only where the step launch is built, right after it; its rows carry its plan."""

    class FakeStep:
        def __init__(self, widths):
            self.widths = widths

        def residency_misfits(self, width=None):
            return []

    built, logs = [], []

    def fake_variant(req_, widths, weights, plan, base):
        built.append((widths, plan))
        if plan.get("ring") == 2:
            raise RuntimeError("gluon compile failed\ndetails")
        return FakeStep(widths)

    monkeypatch.setattr(harness, "_step_variant_kernels", fake_variant)
    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda *a: None)
    req = _request("llama3-1b", (1, 2, 8, 16), _platform())
    step = FakeStep((1, 2, 8))  # 16 refused by the step launch
    b = f"{harness.STEP_BACKEND}-ring4"
    staged = {"ring": 4, "stream_down": 0}  # fits width 1 only
    tk, not_run = harness._build_step_variant(req, None, step, b, staged, logs.append)
    assert built == [((1,), staged)] and tk.widths == (1,)
    assert sorted(not_run) == [2, 8] and all(skipped for _, skipped in not_run.values())
    assert not_run[2][0].startswith(f"skipped: the step plan {staged} does not fit width 2: step launch: ")
    assert any(f"{b} not timed at width 8" in line for line in logs)
    bad, failed = harness._build_step_variant(req, None, step, "triton-step-ring2", {"ring": 2}, logs.append)
    assert bad is None and failed == {w: ("build failed: RuntimeError: gluon compile failed", False) for w in (1, 2, 8)}

    kernels = {"triton": FakeStep((1, 2, 8, 16)), harness.STEP_BACKEND: step, b: tk}
    ctx = _ctx("llama3-1b", {16: ("skipped: refused", True)}, kernels=kernels)
    ctx["step_variants"] = {"ring4": staged, "ring2": {"ring": 2}}
    ctx["step_variants_not_run"] = {b: not_run, "triton-step-ring2": failed}
    step_cols = [harness.STEP_BACKEND, b, "triton-step-ring2"]
    for rows, timed, recorded in (
        (1, step_cols[:2], {"triton-step-ring2": False}),
        (2, step_cols[:1], {b: True, "triton-step-ring2": False}),
        (16, [], {harness.STEP_BACKEND: True}),
    ):
        wanted = harness._cell_backends(ctx, rows, floor=False, w8a16_batches=())
        assert wanted[:3] == ["reference-graph", "stock-fullgraph", "triton"]
        assert wanted[3:] == (step_cols if rows != 16 else [harness.STEP_BACKEND])
        got, out = harness._step_refused(ctx, rows, 1024, wanted)
        assert got == wanted[:3] + timed
        assert {r["backend"]: r["skipped"] is True for r in out} == recorded
    row = harness._row(ctx, 1, 1024, b, [1e-3], None, 1e-3, 1.0)
    assert row["triton_change"] == staged and row["backend"] == b
    assert harness._row(ctx, 1, 1024, harness.STEP_BACKEND, None, None, None, None)["triton_change"] == {}
    assert harness._row(ctx, 1, 1024, "triton", None, None, None, None)["triton_change"] == {}
    # a launch-target variant named like a step variant's backend is refused (run: _check_variants),
    # so the lookup by name cannot mislabel one as the other
    ctx["variants"] = {"before": {"pdl": ""}}
    assert harness._row(ctx, 1, 1024, "triton-before", None, None, None, None)["triton_change"] == {"pdl": ""}
    assert harness._row(ctx, 1, 1024, "triton-step-ring2", None, "x", None, None)["triton_change"] == {"ring": 2}


def test_the_step_launch_timeline_is_drawn_with_its_own_layout(monkeypatch, tmp_path):
    """``_timeline`` on the step launch: its kernels are rebuilt with stamps for the run's layers,
    one graph of the step replayed, the stamps summarised and plotted with the step's layout (the
    plot's name ends in ``_step``), and the kernels go back to the build without stamps. The CUDA
    graph and its timing cannot run here: a graph that calls the step and fixed replay times stand in."""
    import torch

    from monodecode_ops.decode_bench import timeline as TL

    calls, ran = [], []

    class FakeStepKernels:
        def enable_timeline(self, num_layers, on=True):
            calls.append((num_layers, on))

        def timeline(self, num_layers, rows):
            st = torch.zeros(num_layers, 2, 4, 5, 4, dtype=torch.int64)
            t = 1_000_000
            for k, s in ((0, 0), (0, 1), (1, 0), (1, 2), (1, 3)):
                st[:, k, :, s] = torch.tensor([t, t + 1000, t + 3000, 0])
                t += 3000
            return st

    class FakeGraph:
        def __init__(self, fn):
            self.fn = fn

        def replay(self):
            ran.append(self.fn())

    monkeypatch.setattr(harness, "capture_graph", lambda fn: (FakeGraph(fn), fn()))
    monkeypatch.setattr(harness, "_time_graph", lambda g, n: [2e-3] * n)
    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda *a: None)
    logs = []
    got = harness._timeline(
        FakeStepKernels(), lambda: "step", 4, "llama3-1b", "bf16", 8, tmp_path, "stem", logs.append, 1024,
        harness.STEP_BACKEND,
    )  # fmt: skip
    assert calls == [(4, True), (4, False)] and ran == ["step", "step"]
    assert got["backend"] == harness.STEP_BACKEND and got["step_ms_with_stamps"] == 2.0
    assert set(got["timeline"]["kernels"]) == {"attention_half", "mlp_half"}
    assert got["timeline"]["gap"] == TL.STEP.gap
    assert got["timeline_png"] == "stem_timeline_llama3-1b_bf16_c1024_b8_step.png"
    assert (tmp_path / got["timeline_png"]).stat().st_size > 5000
    # the raw stamps are saved (compressed) beside the plot and read back whole
    assert got["timeline_stamps"] == "stem_timeline_llama3-1b_bf16_c1024_b8_step_stamps.pt.xz"
    assert torch.equal(TL.load_stamps(tmp_path / got["timeline_stamps"]), FakeStepKernels().timeline(4, 8))
    assert any("last attention end -> first o_proj entry" in line for line in logs)


def test_a_cell_times_each_step_both_ways_and_keeps_the_oracle_to_one(monkeypatch):
    """``_bench_cell`` on the CPU (the tiny model, the reference and the paged stock step run for
    real; the CUDA graph and its two timers stand in): each backend's row carries its median
    one-replay time (``step_ms``) and its median back-to-back time (``step_ms_back_to_back``, the
    host queueing ``BACK_TO_BACK`` replays), a tuned stock's draws each timed both ways, and the
    oracle, whose steps take up to 0.3 s, is timed one way only."""
    import torch

    from monodecode.model.profiles import profile_dims
    from monodecode.model.weights import random_weights

    class FakeGraph:
        def __init__(self, fn):
            self.fn = fn

        def replay(self):
            return self.fn()

    queued = []

    def back_to_back(fn, calls):
        queued.append(calls)
        return [1.5e-3, 1.2e-3, 1.9e-3]

    monkeypatch.setattr(harness, "capture_graph", lambda fn: (FakeGraph(fn), fn()))
    monkeypatch.setattr(harness, "_time_graph", lambda g, n, warm=3: [2e-3, 3e-3, 4e-3][:n])
    monkeypatch.setattr(harness, "time_back_to_back", back_to_back)
    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(harness, "TUNED", ("stock-graph",))  # drawn twice, as a tuned stock is
    dims, device = profile_dims("tiny"), torch.device("cpu")
    weights = random_weights(dims, seed=1, device=device, num_layers=2)
    paths, base = harness._stock_paths(dims, weights, ("paged",), 64, device, False, lambda *a: None)
    ctx = {
        "profile": "tiny", "weight_dtype": "bf16", "dims": dims, "n_layers": 2, "weights": weights,
        "kernels": {}, "paths": paths, "base": base, "stock_path": None, "variants": {}, "step_variants": {},
        "wbytes": harness.weight_bytes(weights), "bandwidth": 3e12, "spec": 3.35e12, "replays": 3,
        "device": device, "log": lambda *a: None, "tuning_draws": 2,
    }  # fmt: skip
    rows = harness._bench_cell(ctx, 2, 64, ["reference-graph", "stock-graph"], False, None, "", None)
    got = {r["backend"]: (r["step_ms"], r["step_ms_back_to_back"]) for r in rows}
    assert got == {"reference-graph": (3.0, None), "stock-graph": (pytest.approx(3.0), pytest.approx(1.5))}
    assert queued == [harness.BACK_TO_BACK] * 2  # the stock's two draws, the oracle's none
    assert rows[1]["tuning_draws_ms"] == [3.0, 3.0] and rows[0]["tuning_draws_ms"] is None
    assert rows[1]["rel_error_vs_reference"] is not None and rows[1]["rel_error_vs_reference"] < 5e-2
