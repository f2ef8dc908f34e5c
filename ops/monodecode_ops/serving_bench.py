"""A/B serving benchmark against live OpenAI-compatible servers (``monodecode-ops bench --endpoint``).

For each endpoint (typically mono decode on and off, same model) and each concurrency level, a
fixed prompt set is replayed through ``/v1/completions`` with streaming, greedy sampling and a
fixed number of output tokens per request (``ignore_eos``, a vLLM extension other servers
ignore). Every streamed chunk is timestamped on arrival:

- TPOT (time per output token) of a request = (last token time - first token time) / (tokens - 1);
- ITL (inter-token latency) = the gaps between consecutive chunks, pooled over all requests;
- tokens/s = output tokens of the level / wall time of the level;
- mono fraction = of the decode steps the server ran during the level, those that ran mono
  decode, from the difference of ``monodecode_steps_total`` / ``monodecode_fallback_steps_total``
  scraped from the server's ``/metrics`` before and after (prefill-only steps are not decode
  steps); ``None`` when the server exports no monodecode series.

Endpoints are benchmarked one after the other, never at once, so they do not share the machine.
Every problem the operator can cause or meet (an unreachable or non-OpenAI endpoint, a model name
that is not served, two endpoints serving different models, a server that stops answering during
the run, an answer that is not what an OpenAI-compatible server sends) is a ``MonodecodeError``
with one line; nothing is written then. Every request (model list, metrics, each streamed
completion) goes through ``endpoint_http``: ``timeout`` bounds it as a whole, and its size is capped.
Results are written under names no earlier run has (``write_results``).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from monodecode.errors import MonodecodeError
from monodecode.jsonio import parse_json
from monodecode_ops.endpoint_http import HttpFailure, HttpTarget, get, parse_http_url, post_stream
from monodecode_ops.plots import save_png
from monodecode_ops.scrape import scrape_samples

PERCENTILES = (50, 90, 99)

# The replayed prompts: fixed, of varied length, plain English (any tokenizer handles them).
PROMPTS: tuple[str, ...] = (
    "The quick brown fox",
    "A decode step reads every weight of every layer once, so",
    "Operators install the chart, watch the metrics, and",
    "Hello world, this is",
    "How many blocks does the cache hold? The answer depends on",
    "Numbers such as 0 1 2 3 appear in text too:",
    "The second launch projects the output, adds the residual, and",
    "Where is the nearest station?",
    "Thank you for reading",
    "It has four layers, a small vocabulary, and",
    "The megakernel keeps each layer in two persistent launches:",
    "What is the weather today?",
    "Memory bandwidth, not arithmetic, sets the time of",
    "Get paged when decoding falls back or stops, then",
    "The model decodes one token at a time while",
    "Questions and answers:",
)


@dataclass(frozen=True)
class Endpoint:
    """A live server: its base URL (``http://host:port``), the model it serves, and a label."""

    url: str
    model: str
    label: str

    @property
    def metrics_path(self) -> str:
        return base_target(self.url).path + "/metrics"


@dataclass
class RequestResult:
    tokens: int = 0
    ttft_s: float = 0.0
    tpot_s: float | None = None
    itls_s: list[float] = field(default_factory=list)


@dataclass
class LevelResult:
    endpoint: str
    label: str
    concurrency: int
    requests: int
    output_tokens: int
    duration_s: float
    tokens_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    mono_steps: float | None
    decode_steps: float | None
    mono_fraction: float | None
    fallback_reasons: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- endpoints -------------------------------------------------------------------------------


SERVER_EXAMPLE = "http://127.0.0.1:8000"
MAX_MODELS_SHOWN = 10


def base_target(url: str) -> HttpTarget:
    """The server of what an operator may paste (a trailing /v1 or /metrics is dropped)."""
    target = parse_http_url(url, "--endpoint", SERVER_EXAMPLE)
    path = target.path.rstrip("/")
    for suffix in ("/metrics", "/v1"):
        path = path.removesuffix(suffix)
    return target.with_path(path)


def base_url(url: str) -> str:
    """``http(s)://host:port[/prefix]`` of what an operator may paste (``base_target``)."""
    return base_target(url).shown


def _served_models(doc: Any, base: str) -> list[str]:
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise MonodecodeError(f"endpoint {base}: /v1/models has no list of model ids: not an OpenAI-compatible server")
    return [m["id"] for m in data]


def _names(models: Sequence[str]) -> str:
    shown = ", ".join(repr(m[:80]) for m in models[:MAX_MODELS_SHOWN])
    return shown + (f" and {len(models) - MAX_MODELS_SHOWN} more" if len(models) > MAX_MODELS_SHOWN else "")


def resolve_endpoint(url: str, model: str | None, label: str, timeout: float = 10.0) -> Endpoint:
    """Ask ``/v1/models`` which model the server serves; one-line errors for anything else."""
    target = base_target(url)
    base = target.shown
    try:
        body = get(target.with_path(target.path + "/v1/models"), timeout)
    except HttpFailure as e:
        if e.status is not None:
            raise MonodecodeError(f"endpoint {base}: {e}: not an OpenAI-compatible server") from None
        raise MonodecodeError(f"endpoint {base}: cannot connect ({e})") from None
    doc = parse_json(body, f"endpoint {base}: /v1/models")
    served = _served_models(doc, base)
    if model is None:
        if len(served) != 1:
            raise MonodecodeError(
                f"endpoint {base} serves {len(served)} models ({_names(served)}): pick one with --model"
            )
        model = served[0]
    elif model not in served:
        raise MonodecodeError(f"endpoint {base} does not serve model {model!r} (it serves: {_names(served) or 'none'})")
    return Endpoint(url=base, model=model, label=label)


def resolve_endpoints(urls: Sequence[str], model: str | None, timeout: float = 10.0) -> list[Endpoint]:
    if not urls:
        raise MonodecodeError("give at least one --endpoint")
    if len(set(base_url(u) for u in urls)) != len(urls):
        raise MonodecodeError("the same --endpoint is given twice")
    eps = []
    for i, url in enumerate(urls):
        ep = resolve_endpoint(url, model, label=chr(ord("A") + i), timeout=timeout)
        eps.append(ep)
    models = {ep.model for ep in eps}
    if len(models) > 1:
        which = "; ".join(f"{ep.url} serves {ep.model!r}" for ep in eps)
        raise MonodecodeError(f"the endpoints serve different models, so an A/B comparison means nothing: {which}")
    return eps


# ---- /metrics --------------------------------------------------------------------------------


def scrape_steps(ep: Endpoint, timeout: float = 10.0) -> dict[str, Any] | None:
    """monodecode step counters and ``monodecode_enabled`` from the server's /metrics (None: no series)."""
    try:
        samples = scrape_samples(base_target(ep.url).with_path(ep.metrics_path), timeout)
    except HttpFailure as e:
        raise MonodecodeError(f"endpoint {ep.url}: cannot scrape /metrics ({e})") from None
    out: dict[str, Any] = {"mono": 0.0, "fallback": 0.0, "reasons": {}, "enabled": None, "seen": False}
    for name in ("monodecode_steps_total", "monodecode_fallback_steps_total", "monodecode_enabled"):
        for labels, v in samples.get(name, {}).items():
            if not (math.isfinite(v) and v >= 0):
                raise MonodecodeError(f"endpoint {ep.url}: /metrics has {name} = {v}, not a count")
            labels = dict(labels)
            if name == "monodecode_steps_total":
                out["seen"] = True
                path = labels.get("path", "")
                out[path] = out.get(path, 0.0) + v
            elif name == "monodecode_fallback_steps_total":
                reason = labels.get("reason", "")
                out["reasons"][reason] = out["reasons"].get(reason, 0.0) + v
            else:
                out["enabled"] = v if out["enabled"] is None else min(out["enabled"], v)
    return out if out["seen"] else None


def step_delta(before: dict[str, Any] | None, after: dict[str, Any] | None, where: str = "") -> dict[str, Any]:
    """Decode steps of one level: mono, decode (mono + fallbacks other than prefill), reasons.
    A counter that went down (the server restarted during the level) is a ``MonodecodeError``."""
    if before is None or after is None:
        return {"mono": None, "decode": None, "fraction": None, "reasons": {}}
    mono = after["mono"] - before["mono"]
    changes = {r: after["reasons"].get(r, 0.0) - before["reasons"].get(r, 0.0) for r in after["reasons"]}
    if mono < 0 or any(v < 0 for v in changes.values()) or set(before["reasons"]) - set(after["reasons"]):
        raise MonodecodeError(
            f"endpoint {where}: the monodecode step counters went down during the run (did the server restart?)"
        )
    reasons = {r: v for r, v in changes.items() if v > 0}
    decode = mono + sum(v for r, v in reasons.items() if r != "prefill")
    return {"mono": mono, "decode": decode, "fraction": (mono / decode) if decode else None, "reasons": reasons}


# ---- one streamed request --------------------------------------------------------------------


class EndpointDied(Exception):
    """A request could not complete: the server refused, reset, closed or stopped answering."""


def _completion_tokens(chunk: dict, max_tokens: int) -> int | None:
    usage = chunk.get("usage")
    if not usage:
        return None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= max_tokens:
        raise EndpointDied(
            f"the usage chunk's completion_tokens {str(tokens)[:40]!r} is not a count in 0..{max_tokens}"
        )
    return tokens


def _carries_text(chunk: dict) -> bool:
    choices = chunk.get("choices")
    if choices is None:
        return False
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise EndpointDied("a stream chunk's 'choices' is not a list of objects")
    return any(c.get("text") for c in choices)


def stream_completion(ep: Endpoint, prompt: str, max_tokens: int, timeout: float) -> RequestResult:
    """POST one streamed greedy completion; timestamps every chunk that carries text. The whole
    request, stream included, ends within ``timeout``."""
    body = json.dumps(
        {
            "model": ep.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    target = base_target(ep.url)
    stamps: list[float] = []
    usage_tokens = None
    done = False
    t0 = time.perf_counter()
    try:
        with post_stream(target.with_path(target.path + "/v1/completions"), body, timeout) as lines:
            for raw in lines:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = parse_json(data, "a stream chunk")
                except MonodecodeError as e:
                    raise EndpointDied(f"an unreadable stream chunk ({e})") from None
                if not isinstance(chunk, dict):
                    raise EndpointDied(f"a stream chunk is a JSON {type(chunk).__name__}, not an object")
                usage_tokens = _completion_tokens(chunk, max_tokens) if usage_tokens is None else usage_tokens
                if _carries_text(chunk):
                    stamps.append(time.perf_counter())
    except HttpFailure as e:
        raise EndpointDied(str(e)) from None
    if not done:
        raise EndpointDied("the response stream ended before [DONE]")
    tokens = usage_tokens if usage_tokens is not None else len(stamps)
    res = RequestResult(tokens=tokens)
    if stamps:
        res.ttft_s = stamps[0] - t0
        res.itls_s = [b - a for a, b in zip(stamps, stamps[1:])]
        if tokens > 1:
            res.tpot_s = (stamps[-1] - stamps[0]) / (tokens - 1)
    return res


# ---- a level and the whole run ---------------------------------------------------------------


def percentiles(values: Sequence[float], scale: float = 1000.0) -> dict[str, float]:
    """p50/p90/p99 by linear interpolation (numpy's default), times ``scale``; NaN when empty."""
    xs = sorted(values)
    out = {}
    for p in PERCENTILES:
        if not xs:
            out[f"p{p}"] = math.nan
            continue
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = scale * (xs[lo] + (xs[hi] - xs[lo]) * (k - lo))
    return out


def run_level(
    ep: Endpoint,
    concurrency: int,
    prompts: Sequence[str],
    max_tokens: int,
    timeout: float,
    on_request_done: Callable[[], None] = lambda: None,
) -> LevelResult:
    before = scrape_steps(ep, timeout)
    results: list[RequestResult] = []
    lock = threading.Lock()
    failure: list[str] = []

    def one(prompt: str) -> None:
        if failure:
            return
        try:
            r = stream_completion(ep, prompt, max_tokens, timeout)
        except EndpointDied as e:
            with lock:
                failure.append(str(e))
            return
        with lock:
            results.append(r)
        on_request_done()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="bench") as pool:
        list(pool.map(one, prompts))
    duration = time.perf_counter() - t0
    if failure:
        raise MonodecodeError(
            f"endpoint {ep.url} stopped answering during the run (concurrency {concurrency}): {failure[0]}"
        )
    after = scrape_steps(ep, timeout)
    delta = step_delta(before, after, ep.url)
    tokens = sum(r.tokens for r in results)
    return LevelResult(
        endpoint=ep.url,
        label=ep.label,
        concurrency=concurrency,
        requests=len(results),
        output_tokens=tokens,
        duration_s=duration,
        tokens_per_s=tokens / duration if duration > 0 else math.nan,
        ttft_ms=percentiles([r.ttft_s for r in results]),
        tpot_ms=percentiles([r.tpot_s for r in results if r.tpot_s is not None]),
        itl_ms=percentiles([x for r in results for x in r.itls_s]),
        mono_steps=delta["mono"],
        decode_steps=delta["decode"],
        mono_fraction=delta["fraction"],
        fallback_reasons=delta["reasons"],
    )


def prompt_set(n: int) -> list[str]:
    """The first ``n`` prompts of the fixed set, cycling when more are asked for."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def run(
    endpoints: Sequence[Endpoint],
    concurrencies: Sequence[int],
    requests: int,
    max_tokens: int,
    timeout: float = 120.0,
    warmup: int = 1,
    progress: Any = None,
) -> dict[str, Any]:
    """Every endpoint x concurrency level; returns the result document (nothing written here)."""
    prompts = prompt_set(requests)
    levels: list[LevelResult] = []
    servers = []
    for ep in endpoints:
        state = scrape_steps(ep, timeout)
        servers.append(
            {
                "label": ep.label,
                "url": ep.url,
                "model": ep.model,
                "monodecode_series": state is not None,
                "monodecode_enabled": None if state is None else state["enabled"],
            }
        )
        # a few requests first: the first requests of a fresh server pay one-time costs
        if warmup:
            run_level(ep, 1, prompt_set(warmup), max_tokens, timeout)
        for c in concurrencies:
            task = None
            if progress is not None:
                task = progress.add_task(f"{ep.label} {ep.url} concurrency {c}", total=len(prompts))
            levels.append(
                run_level(
                    ep,
                    c,
                    prompts,
                    max_tokens,
                    timeout,
                    on_request_done=(lambda t=task: progress.advance(t)) if task is not None else (lambda: None),
                )
            )
    return {
        "kind": "serving_ab",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": endpoints[0].model,
        "settings": {
            "concurrency": list(concurrencies),
            "requests_per_level": requests,
            "max_tokens": max_tokens,
            "sampling": "greedy, ignore_eos, streamed",
            "prompts": prompts,
        },
        "servers": servers,
        "results": [lv.to_dict() for lv in levels],
    }


# ---- reporting -------------------------------------------------------------------------------


def _ms(d: dict[str, float]) -> str:
    return "/".join("n/a" if math.isnan(d[f"p{p}"]) else f"{d[f'p{p}']:.2f}" for p in PERCENTILES)


def server_name(server: dict[str, Any]) -> str:
    state = server["monodecode_enabled"]
    mono = "no monodecode metrics" if state is None else ("mono on" if state >= 1 else "mono degraded/off")
    return f"{server['label']} ({mono})"


def table_rows(doc: dict[str, Any]) -> list[tuple]:
    names = {s["label"]: server_name(s) for s in doc["servers"]}
    by_level = {(r["label"], r["concurrency"]): r for r in doc["results"]}
    first = doc["servers"][0]["label"]
    rows = []
    for r in doc["results"]:
        base = by_level.get((first, r["concurrency"]))
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and base["tokens_per_s"] else "n/a"
        frac = r["mono_fraction"]
        rows.append(
            (
                names[r["label"]],
                r["concurrency"],
                r["requests"],
                r["output_tokens"],
                f"{r['tokens_per_s']:.1f}",
                vs if r["label"] != first else "1.00x",
                _ms(r["tpot_ms"]),
                _ms(r["itl_ms"]),
                "n/a" if frac is None else f"{100 * frac:.1f}%",
            )
        )
    return rows


COLUMNS = (
    "server",
    "concurrency",
    "requests",
    "tokens",
    "tokens/s",
    "vs A",
    "TPOT ms p50/p90/p99",
    "ITL ms p50/p90/p99",
    "mono steps",
)


def plot(doc: dict[str, Any], path: Path) -> None:
    """TPOT and ITL percentiles and tokens/s against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for server in doc["servers"]:
        rows = [r for r in doc["results"] if r["label"] == server["label"]]
        xs = [r["concurrency"] for r in rows]
        name = server_name(server)
        for ax, key in ((axes[0], "tpot_ms"), (axes[1], "itl_ms")):
            line = ax.plot(xs, [r[key]["p50"] for r in rows], marker="o", label=f"{name} p50")[0]
            ax.fill_between(
                xs, [r[key]["p50"] for r in rows], [r[key]["p99"] for r in rows], color=line.get_color(), alpha=0.15
            )
            ax.plot(xs, [r[key]["p90"] for r in rows], ls="--", color=line.get_color(), label=f"{name} p90")
        axes[2].plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=name)
    for ax, title, unit in (
        (axes[0], "TPOT (p50 line, p90 dashed, band to p99)", "ms"),
        (axes[1], "inter-token latency", "ms"),
        (axes[2], "output tokens/s", "tokens/s"),
    ):
        ax.set_title(title)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"serving A/B: {doc['model']}, {doc['settings']['max_tokens']} output tokens per request, {doc['date']}",
        fontsize=9,
        parse_math=False,  # a model name is text: "$" in it is not mathtext
    )
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def check_out_dir(out_dir: Path) -> None:
    """``--out`` can take the results: a directory, or one that can be made, and writable
    (checked before the run; nothing is created here)."""
    probe = out_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise MonodecodeError(f"--out {out_dir}: {probe} exists and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise MonodecodeError(f"--out {out_dir}: {probe} is not writable")


def _publish(tmp: Path, final: Path) -> bool:
    """Give ``tmp`` the name ``final`` unless ``final`` exists (a hard link never replaces)."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def write_results(doc: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """JSON and PNG under ``out_dir``, named after the run's time (``serving_ab_<UTC time>``, with
    ``-2``, ``-3``... when taken): an earlier run's files are never replaced."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = "serving_ab_" + doc["date"].replace(":", "").replace("-", "")
        for n in range(1, 1000):
            name = stem if n == 1 else f"{stem}-{n}"
            jpath, ppath = out_dir / f"{name}.json", out_dir / f"{name}.png"
            if jpath.exists() or ppath.exists():
                continue
            ptmp = out_dir / f".{name}.{os.getpid()}.png"
            plot(doc, ptmp)
            if not _publish(ptmp, ppath):
                continue
            jtmp = out_dir / f".{name}.{os.getpid()}.json"
            jtmp.write_text(json.dumps(doc, indent=2) + "\n")
            if _publish(jtmp, jpath):
                return jpath, ppath
            ppath.unlink(missing_ok=True)
    except OSError as e:
        raise MonodecodeError(f"--out {out_dir}: cannot write the results ({e.strerror or e})") from None
    raise MonodecodeError(f"--out {out_dir}: 999 result files named {stem} already exist")


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MonodecodeError(
            "the benchmark plot needs matplotlib, which is not installed: pip install 'monodecode[bench]'"
        ) from None
