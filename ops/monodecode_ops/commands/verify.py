"""``monodecode-ops verify``: is this node (and optionally an image / a live server) ready?

Checks, each pass / fail / skip with the reason:

- node: GPU discovery (torch, AMD KFD sysfs topology, amd-smi), arch, CUs, partition mode,
  driver; ``--require-gpu`` makes the absence of a supported GPU a failure;
- backends: which kernel backends can run here and why not;
- self-test (default on): the embedded tiny model (or ``--model DIR``) through the runner
  lifecycle on the best backend (refusal rules, build, warm-up golden check per width), then a
  scripted run of mono steps and deliberately ineligible ones (prefill, mixed batch, too many
  rows, PIECEWISE graph) compared with the reference, and the fallback accounting read back
  from the metrics served on 127.0.0.1 during the run;
- ``--endpoint URL``: a live server's ``/metrics`` carries the monodecode series;
- ``--image IMAGE``: the image's labels and baked artifacts fit this node
  (``monodecode_ops.image_checks.verify_image``);
- inside a monodecode image: its baked manifest and artifacts are intact
  (``monodecode_ops.image_checks.baked_checks``).

Exit 0 when every required check passed, 1 when one failed, 2 for bad arguments.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import typer

from monodecode.config import MAX_WAIT_TIMEOUT_S
from monodecode.errors import MonodecodeError
from monodecode_ops.endpoint_http import HttpFailure, HttpTarget, parse_http_url
from monodecode_ops.options import BlockSizeOpt, WeightDtype, WeightDtypeOpt, WidthsOpt, path_option
from monodecode_ops.output import Check, console, json_output, report_checks
from monodecode_ops.scrape import Samples, scrape_samples, value

METRICS_EXAMPLE = "http://host:8000/metrics"
REQUIRED_SERIES = (
    "monodecode_enabled",
    "monodecode_steps_total",
    "monodecode_fallback_steps_total",
    "monodecode_step_duration_seconds",
    "monodecode_failstop_total",
)


# ---- node ------------------------------------------------------------------------------------


def node_checks(platform: Any, require_gpu: bool) -> list[Check]:
    from monodecode.services.platform import SUPPORTED_AMD_ARCHS

    p = platform
    facts = [
        p.label,
        p.name,
        f"{p.compute_units} {'CUs' if p.kind == 'rocm' else 'SMs' if p.kind == 'cuda' else 'logical CPUs'}",
    ]
    if p.partition_mode:
        facts.append(f"partition {p.partition_mode}")
    if p.driver:
        facts.append(p.driver)
    checks = [Check.passed("node", ", ".join(facts) + f" (from {p.source})", data=p.to_dict())]
    if p.kind == "rocm":
        if p.arch in SUPPORTED_AMD_ARCHS:
            checks.append(Check.passed("gpu", f"supported AMD GPU {p.arch}"))
        else:
            checks.append(
                Check(
                    "gpu",
                    "fail",
                    f"AMD GPU {p.arch} is not a supported arch ({', '.join(SUPPORTED_AMD_ARCHS)})",
                    required=require_gpu,
                )
            )
        if not p.torch_usable:
            checks.append(
                Check(
                    "gpu_torch",
                    "fail",
                    "the GPU is visible in sysfs but torch cannot use it (CPU build of torch or no /dev/kfd access)",
                    required=require_gpu,
                )
            )
        if p.partition_mode and p.partition_mode != "SPX":
            checks.append(
                Check(
                    "partition_mode",
                    "fail",
                    f"compute partition {p.partition_mode}: persistent kernels need the whole GPU (SPX)",
                    required=require_gpu,
                )
            )
        elif p.partition_mode:
            checks.append(Check.passed("partition_mode", "SPX (whole GPU)"))
    elif p.kind == "cuda":
        checks.append(Check.passed("gpu", f"NVIDIA GPU {p.name} ({p.arch}): triton backend"))
    else:
        why = "no GPU found (torch sees none, no KFD topology in sysfs, no amd-smi)"
        checks.append(
            Check.failure("gpu", why + "; --require-gpu was given")
            if require_gpu
            else Check.skipped("gpu", why + "; GPU checks skipped", required=False)
        )
    return checks


def backend_checks(platform: Any) -> list[Check]:
    from monodecode.kernels.registry import backend_status

    out = []
    for st in backend_status(platform):
        if st.available:
            out.append(Check.passed(f"backend {st.name}", "can run here", required=st.name == "reference"))
        else:
            out.append(Check.skipped(f"backend {st.name}", st.reason or "unavailable", required=False))
    return out


# ---- self-test -------------------------------------------------------------------------------


MAX_SERVE_SECONDS = 7 * 24 * 3600  # a week: longer belongs to a server, not a check
INTERPRETER_WIDTHS = [1, 2]  # the interpreter plays every program in turn: ~1 s per layer launch pair


def use_triton_interpreter(platform: Any, backend: str) -> str | None:
    """On a node without a GPU torch can drive, run the Triton K1/K2 under Triton's CPU
    interpreter as the mono backend, so the self-test checks real kernel code, not the reference
    against itself. Returns why not (None = enable it); call before the kernel modules load."""
    if platform.is_gpu and platform.torch_usable:
        return "a GPU is present"
    if backend not in ("auto", "triton"):
        return f"--backend {backend} was asked for"
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'monodecode[triton]')"
    import os
    import sys

    if "monodecode.kernels.triton.launch" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return "the triton kernel modules were imported before the interpreter could be selected"
    from monodecode.kernels.triton import interpret

    interpret.enable()
    return None


def backend_how(runner: Any, platform: Any) -> str:
    """Which backend ran the mono steps and how, in words."""
    name = runner.backend.name if runner.backend else "none"
    if name == "reference":
        return "reference: PyTorch reference layers (no kernel code runs on this node)"
    if name == "triton" and not platform.is_gpu:
        return (
            "triton: the real K1/K2 kernel code under Triton's CPU interpreter (TRITON_INTERPRET=1), "
            "every program played in turn; correctness only, not speed"
        )
    return f"{name}: compiled kernels on {platform.label}"


def _load_model(model: Path | None, weight_dtype: str, device: str):
    from monodecode.model import ensure_tiny_model, load_dims, load_weights

    if model is None:
        model_dir = ensure_tiny_model()
        label = "embedded tiny model"
    else:
        model_dir = model
        if not model_dir.is_dir():
            raise MonodecodeError(f"--model {model_dir}: not a directory")
        label = str(model_dir)
    dims = load_dims(model_dir)
    weights = load_weights(model_dir, dims, weight_dtype=weight_dtype, device=device)
    return label, model_dir, dims, weights


def _scrape(url: str, timeout: float = 10.0) -> Samples:
    """GET a Prometheus text page -> {sample name: {labels tuple: value}} (bounded: ``endpoint_http``)."""
    return scrape_samples(parse_http_url(url, "metrics URL", METRICS_EXAMPLE), timeout)


_value = value


def width_timing_checks(runner: Any) -> list[Check]:
    """The width timing as a table: per width, stock / mono step time at each timed context (the
    ``monodecode_width_speedup`` gauges) and what the stock step was; none when not timed by design."""
    from monodecode.runtime.width_policy import STOCK_UNAVAILABLE, timing_table

    stock, widths = runner.stock_side, runner.summary()["widths"]
    if stock is None:
        return []
    if stock == STOCK_UNAVAILABLE:
        return [Check.skipped("width timing", f"stock step {stock}: {widths['report']}", required=False)]
    head = f"stock step {stock} ({widths['timing_s']:.1f} s); stock / mono time by context:"
    data = {"stock": stock, "speedup": widths["speedup"], "timing_s": widths["timing_s"]}
    return [
        Check.passed("width timing", "\n".join([head, *timing_table(runner.width_timings)]), required=False, data=data)
    ]


def self_test(
    platform: Any,
    model: Path | None,
    cfg_overrides: dict[str, Any],
    weight_dtype: str,
    block_size: int,
    exporter: Any,
) -> tuple[list[Check], dict[str, Any]]:
    from monodecode.config import MonoConfig
    from monodecode.errors import RefusalError
    from monodecode.metrics import FALLBACK_REASONS, get_metrics
    from monodecode.runtime.runner import Runner
    from monodecode_ops.selfcheck import run_scenario

    checks: list[Check] = []
    info: dict[str, Any] = {}
    cfg = MonoConfig.from_dict(
        {"enabled": True, "on_refusal": "degrade", "allow_jit": True, **cfg_overrides}, where="verify options"
    )
    t0 = time.perf_counter()
    label, model_dir, dims, weights = _load_model(model, weight_dtype, platform.torch_device)
    checks.append(
        Check.passed(
            "model",
            f"{label}: {dims.architecture}, {dims.num_layers} layers, hidden {dims.hidden_size}, "
            f"{weight_dtype} weights on {platform.torch_device} ({time.perf_counter() - t0:.1f} s)",
            data={"model_dir": str(model_dir), "dims_digest": dims.digest()},
        )
    )

    metrics = get_metrics()
    before = _scrape(exporter.url)
    runner = Runner(cfg, dims, weights, platform, metrics=metrics, block_size=block_size)
    try:
        runner.start()
    except RefusalError as e:  # only with on_refusal=raise given explicitly
        checks.append(Check.failure("runner", str(e)))
        return checks, info
    info["runner"] = runner.summary()
    backend = runner.backend.name if runner.backend else "none"
    info["mono_backend"] = backend_how(runner, platform)
    checks.append(Check.passed("mono backend", info["mono_backend"], required=False))
    if runner.enabled:
        checks.append(
            Check.passed("refusal rules", f"backend {backend}: no refusal reasons (build key {runner.build_key[:16]})")
        )
        checks.append(Check.passed("width policy", runner.width_report(), required=False))
    elif runner.reasons and all(r.startswith("slower_than_stock:") for r in runner.reasons):
        checks.append(Check.skipped("width policy", "stock decode serves: " + runner.reasons[0], required=False))
    else:
        checks.append(Check.failure("refusal rules", f"backend {backend} refused: " + "; ".join(runner.reasons)))
    checks.extend(width_timing_checks(runner))
    w = runner.warmup
    if w is not None:
        per = ", ".join(f"w{x.width}: {x.max_abs_error:.3g}" for x in w.widths)
        detail = (
            f"{backend} vs reference, every layer, widths {','.join(str(x.width) for x in w.widths)}: "
            f"max abs error {w.max_abs_error:.3g} ({per}); {w.duration_s:.2f} s"
        )
        checks.append(
            Check(
                "warm-up golden check",
                "pass" if w.passed else "fail",
                detail,
                data={"max_abs_error": w.max_abs_error, "duration_s": w.duration_s},
            )
        )
    elif runner.enabled is False and runner.backend is not None:
        checks.append(Check.skipped("warm-up golden check", "not run: the deployment was refused", required=False))
    for note in runner.notes:
        checks.append(Check.skipped("note", note, required=False))
    if not runner.enabled:
        return checks, info

    seen_notes = len(runner.notes)
    result = run_scenario(runner)
    info["steps"] = [s.__dict__ for s in result.steps]
    for note in runner.notes[seen_notes:]:  # e.g. a drill the backend could not inject
        checks.append(Check.skipped("note", note, required=False))
    if result.failstop is not None:
        ev = result.failstop
        checks.append(
            Check.failure(
                "decode",
                f"fail-stop at step {ev.step} (site {ev.site}"
                f"{', layer ' + str(ev.layer) if ev.layer is not None else ''}): no token was returned for it; "
                f"marker {runner.marker_path}",
            )
        )
        return checks, info
    wrong = [s for s in result.steps if not s.as_expected]
    mismatch = [s for s in result.steps if not s.tokens_match]
    if wrong:
        s = wrong[0]
        checks.append(
            Check.failure(
                "step decisions",
                f"step '{s.name}' took {s.path}/{s.reason}, expected {s.expected_path}/{s.expected_reason}",
            )
        )
    else:
        n_mono = sum(1 for s in result.steps if s.path == "mono")
        checks.append(
            Check.passed(
                "step decisions",
                f"{len(result.steps)} steps: {n_mono} mono, {len(result.steps) - n_mono} fallback, each as expected",
            )
        )
    if mismatch:
        s = mismatch[0]
        checks.append(
            Check.failure(
                "decode vs reference",
                f"step '{s.name}': logits differ by {s.max_abs_logit_diff:.3g} or greedy tokens differ",
            )
        )
    else:
        checks.append(
            Check.passed(
                "decode vs reference",
                f"{result.tokens_emitted} tokens identical to the reference; max |logit diff| {result.max_abs_logit_diff:.3g}",
            )
        )

    # fallback accounting, read back over HTTP from the exporter
    after = _scrape(exporter.url)
    exp = result.expected_counts()
    got = {
        p: _value(after, "monodecode_steps_total", path=p) - _value(before, "monodecode_steps_total", path=p)
        for p in ("mono", "fallback")
    }
    for r in FALLBACK_REASONS:
        got[r] = _value(after, "monodecode_fallback_steps_total", reason=r) - _value(
            before, "monodecode_fallback_steps_total", reason=r
        )
    want = {k: float(exp.get(k, 0)) for k in got}
    reasons = ", ".join(f"{r} {int(got[r])}" for r in FALLBACK_REASONS if got[r])
    text = f"mono {int(got['mono'])}, fallback {int(got['fallback'])} ({reasons or 'none'}) scraped from {exporter.url}"
    checks.append(
        Check(
            "fallback accounting",
            "pass" if got == want else "fail",
            text if got == want else text + f"; expected {want}",
            data={"counted": got},
        )
    )
    return checks, info


# ---- live endpoint ---------------------------------------------------------------------------


def _metrics_target(url: str) -> HttpTarget:
    target = parse_http_url(url, "--endpoint", METRICS_EXAMPLE)
    return target.with_path("/metrics") if target.path == "/" else target


ENDPOINT_TIMEOUT_S = 10.0  # the whole scrape of a live server's /metrics


def endpoint_checks(url: str) -> list[Check]:
    target = _metrics_target(url)
    try:
        samples = scrape_samples(target, ENDPOINT_TIMEOUT_S)
    except HttpFailure as e:
        return [Check.failure("endpoint", f"cannot scrape {target.shown}: {e}")]
    families = {
        n[: -len(sfx)] if n.endswith(sfx) else n
        for n in samples
        for sfx in ("_bucket", "_count", "_sum", "_created", "")
        if n.endswith(sfx)
    }
    missing = [n for n in REQUIRED_SERIES if n not in families and n not in samples]
    if missing:
        return [
            Check.failure(
                "endpoint",
                f"{target.shown} lacks {', '.join(missing)} (is mono decode installed and the plugin loaded?)",
            )
        ]
    enabled = samples.get("monodecode_enabled", {})
    mono = _value(samples, "monodecode_steps_total", path="mono")
    fb = _value(samples, "monodecode_steps_total", path="fallback")
    if not all(math.isfinite(v) and v >= 0 for v in (mono, fb, *enabled.values())):
        return [Check.failure("endpoint", f"{target.shown}: the monodecode series hold negative or non-finite values")]
    en = ", ".join(f"{v:g}" for v in enabled.values()) or "?"
    return [
        Check.passed(
            "endpoint",
            f"{target.shown}: monodecode series present; enabled={en}, steps mono {mono:.0f} / fallback {fb:.0f}",
            data={"url": target.shown, "enabled": list(enabled.values()), "mono": mono, "fallback": fb},
        )
    ]


# ---- command ---------------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    @app.command("verify")
    def verify(
        model: Optional[Path] = path_option("--model", "HF model directory (default: the embedded tiny model)."),
        require_gpu: bool = typer.Option(False, "--require-gpu", help="Fail when no supported GPU is present."),
        metrics_port: int = typer.Option(
            0, "--metrics-port", help="Serve metrics on 127.0.0.1:PORT during the run (0 = any free port)."
        ),
        endpoint: Optional[str] = typer.Option(
            None, "--endpoint", help="Also check a live server's /metrics, e.g. http://vllm:8000/metrics."
        ),
        image: Optional[str] = typer.Option(
            None, "--image", help="Also check that IMAGE's labels and artifacts fit this node."
        ),
        self_test_on: bool = typer.Option(
            True, "--self-test/--no-self-test", help="Run the runner lifecycle and decode self-test."
        ),
        backend: str = typer.Option(
            "auto",
            "--backend",
            help="Kernel backend: auto, flydsl, triton, triton-step (only when named) or reference.",
        ),
        widths: WidthsOpt = None,
        weight_dtype: WeightDtypeOpt = WeightDtype("bf16"),
        block_size: BlockSizeOpt = 16,
        artifact_dir: Optional[Path] = path_option("--artifact-dir", "Baked kernel artifacts (manifest.json)."),
        failstop_dir: Optional[Path] = path_option(
            "--failstop-dir", "Fail-stop markers (default: a temporary directory)."
        ),
        serve_seconds: float = typer.Option(
            0.0, "--serve-seconds", help="Keep serving metrics this long after the checks."
        ),
        wait_timeout_s: float = typer.Option(
            10.0, "--wait-timeout-s", help="Bound on every kernel wait (fail-stop drills use a short one)."
        ),
    ) -> None:
        """Check this node (GPU, arch, CUs, partition, driver), run the mono-decode self-test, and optionally check an image and a live server's metrics."""
        as_json = json_output()
        from monodecode.metrics import start_exporter
        from monodecode.services.platform import detect_platform

        if not (math.isfinite(serve_seconds) and 0 <= serve_seconds <= MAX_SERVE_SECONDS):
            raise MonodecodeError(f"--serve-seconds must be between 0 and {MAX_SERVE_SECONDS}, got {serve_seconds}")
        if endpoint is not None:
            _metrics_target(endpoint)  # bad URL: usage error before any work
        if image is not None and not image.strip():
            raise MonodecodeError("--image must name an image, got ''")
        if math.isfinite(wait_timeout_s) and wait_timeout_s > MAX_WAIT_TIMEOUT_S:
            raise MonodecodeError(f"--wait-timeout-s must be at most {MAX_WAIT_TIMEOUT_S:g} s, got {wait_timeout_s:g}")
        overrides: dict[str, Any] = {"backend": backend, "wait_timeout_s": wait_timeout_s}
        if widths is not None:
            overrides["widths"] = list(widths)
        if artifact_dir is not None:
            overrides["artifact_dir"] = str(artifact_dir)
        from monodecode.config import MonoConfig

        MonoConfig.from_dict({**overrides}, where="verify options")  # validate before starting anything

        import prometheus_client

        prometheus_client.disable_created_metrics()  # this process only: keeps the page to the contract
        exporter = start_exporter(metrics_port) if self_test_on else None
        tmp = tempfile.TemporaryDirectory(prefix="monodecode-verify-")
        try:
            overrides["failstop_dir"] = str(failstop_dir) if failstop_dir else tmp.name
            overrides["termination_log"] = str(Path(overrides["failstop_dir"]) / "termination-log")
            overrides["exit_on_failstop"] = False
            platform = detect_platform()
            not_interpreted = use_triton_interpreter(platform, backend) if self_test_on else "no self-test"
            if not_interpreted is None:
                if widths is None:
                    overrides["widths"] = INTERPRETER_WIDTHS
                overrides["width_policy"] = "force"  # interpreted kernels are for correctness, not speed
            checks = node_checks(platform, require_gpu)
            checks += backend_checks(platform)
            info: dict[str, Any] = {"platform": platform.to_dict()}
            if exporter is not None:
                info["metrics_url"] = exporter.url
                if not as_json:
                    console().print(f"metrics served at {exporter.url} during the run")
                st_checks, st_info = self_test(platform, model, overrides, weight_dtype.value, block_size, exporter)
                checks += st_checks
                info.update(st_info)
                checks.append(Check.passed("metrics", f"served at {exporter.url} (127.0.0.1 only)"))
            else:
                checks.append(Check.skipped("self-test", "--no-self-test given", required=False))
            if endpoint:
                checks += endpoint_checks(endpoint)
            if image is not None:
                try:
                    from monodecode_ops.image_checks import verify_image  # lazy (Docker SDK)
                except ImportError as e:
                    raise MonodecodeError(
                        f"--image needs monodecode_ops.image_checks, which cannot be imported: {e}"
                    ) from None
                image_dims = None
                if model is not None:  # only an explicit model is checked against the image's artifacts
                    from monodecode.model import load_dims

                    image_dims = load_dims(model)
                checks += verify_image(image, platform, dims=image_dims)
            # Inside a monodecode image: its baked manifest and every artifact's sha256 (IMG).
            from monodecode_ops.image_checks import artifact_dir_checks, baked_checks

            if artifact_dir is not None:
                checks += artifact_dir_checks(artifact_dir)
            checks += baked_checks()
            code = report_checks(checks, as_json=as_json, title="monodecode verify", extra=info)
            if exporter is not None and serve_seconds > 0:
                if not as_json:
                    console().print(f"serving metrics at {exporter.url} for {serve_seconds:g} s")
                time.sleep(serve_seconds)
        finally:
            if exporter is not None:
                exporter.stop()
            tmp.cleanup()
        raise typer.Exit(code)
