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
the run) is a ``MonodecodeError`` with one line; nothing is written then.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from monodecode.errors import MonodecodeError

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
    def metrics_url(self) -> str:
        return self.url + "/metrics"


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


def base_url(url: str) -> str:
    """``http(s)://host:port`` from what an operator may paste (a trailing /v1 or /metrics is dropped)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise MonodecodeError(f"--endpoint must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
    path = parsed.path.rstrip("/")
    for suffix in ("/metrics", "/v1"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return urllib.parse.urlunparse(parsed._replace(path=path, params="", query="", fragment=""))


def _get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (http(s) only, checked)
        return json.load(resp)


def _unreachable(url: str, e: BaseException) -> str:
    reason = getattr(e, "reason", None) or e
    return f"{reason}".strip() or type(e).__name__


def resolve_endpoint(url: str, model: str | None, label: str, timeout: float = 10.0) -> Endpoint:
    """Ask ``/v1/models`` which model the server serves; one-line errors for anything else."""
    base = base_url(url)
    try:
        doc = _get_json(base + "/v1/models", timeout)
    except urllib.error.HTTPError as e:
        raise MonodecodeError(
            f"endpoint {base}: GET /v1/models answered HTTP {e.code}: not an OpenAI-compatible server"
        ) from None
    except (urllib.error.URLError, OSError) as e:
        raise MonodecodeError(f"endpoint {base}: cannot connect ({_unreachable(base, e)})") from None
    except ValueError:
        raise MonodecodeError(
            f"endpoint {base}: /v1/models did not return JSON: not an OpenAI-compatible server"
        ) from None
    try:
        served = [m["id"] for m in doc["data"]]
    except (KeyError, TypeError):
        raise MonodecodeError(
            f"endpoint {base}: /v1/models has no model list: not an OpenAI-compatible server"
        ) from None
    if model is None:
        if len(served) != 1:
            raise MonodecodeError(
                f"endpoint {base} serves {len(served)} models ({', '.join(served)}): pick one with --model"
            )
        model = served[0]
    elif model not in served:
        raise MonodecodeError(
            f"endpoint {base} does not serve model {model!r} (it serves: {', '.join(served) or 'none'})"
        )
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
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(ep.metrics_url, timeout=timeout) as resp:  # noqa: S310
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        raise MonodecodeError(f"endpoint {ep.url}: cannot scrape /metrics ({_unreachable(ep.url, e)})") from None
    out: dict[str, Any] = {"mono": 0.0, "fallback": 0.0, "reasons": {}, "enabled": None, "seen": False}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "monodecode_steps_total":
                out["seen"] = True
                out[s.labels.get("path", "")] = out.get(s.labels.get("path", ""), 0.0) + s.value
            elif s.name == "monodecode_fallback_steps_total":
                reason = s.labels.get("reason", "")
                out["reasons"][reason] = out["reasons"].get(reason, 0.0) + s.value
            elif s.name == "monodecode_enabled":
                out["enabled"] = s.value if out["enabled"] is None else min(out["enabled"], s.value)
    return out if out["seen"] else None


def step_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """Decode steps of one level: mono, decode (mono + fallbacks other than prefill), reasons."""
    if before is None or after is None:
        return {"mono": None, "decode": None, "fraction": None, "reasons": {}}
    mono = after["mono"] - before["mono"]
    reasons = {
        r: after["reasons"].get(r, 0.0) - before["reasons"].get(r, 0.0)
        for r in after["reasons"]
        if after["reasons"].get(r, 0.0) - before["reasons"].get(r, 0.0) > 0
    }
    decode = mono + sum(v for r, v in reasons.items() if r != "prefill")
    return {"mono": mono, "decode": decode, "fraction": (mono / decode) if decode else None, "reasons": reasons}


# ---- one streamed request --------------------------------------------------------------------


class EndpointDied(Exception):
    """A request could not complete: the server refused, reset, closed or stopped answering."""


def stream_completion(ep: Endpoint, prompt: str, max_tokens: int, timeout: float) -> RequestResult:
    """POST one streamed greedy completion; timestamps every chunk that carries text."""
    parsed = urllib.parse.urlparse(ep.url)
    conn_cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
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
    )
    conn = conn_cls(parsed.netloc, timeout=timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            detail = resp.read(300).decode("utf-8", "replace").strip().replace("\n", " ")
            raise EndpointDied(f"HTTP {resp.status} from /v1/completions: {detail}")
        stamps: list[float] = []
        usage_tokens = None
        done = False
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            if any(c.get("text") for c in chunk.get("choices") or ()):
                stamps.append(time.perf_counter())
        if not done:
            raise EndpointDied("the response stream ended before [DONE]")
    except (TimeoutError, OSError, http.client.HTTPException) as e:
        raise EndpointDied(_unreachable(ep.url, e)) from None
    except ValueError as e:
        raise EndpointDied(f"an unreadable stream chunk ({e})") from None
    finally:
        conn.close()
    tokens = int(usage_tokens) if usage_tokens is not None else len(stamps)
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
    before = scrape_steps(ep)
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
    after = scrape_steps(ep)
    delta = step_delta(before, after)
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
        state = scrape_steps(ep)
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
    )
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def write_results(doc: dict[str, Any], out_dir: Path, stem: str) -> tuple[Path, Path]:
    """JSON and PNG under ``out_dir``, each written to a temporary name and renamed."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MonodecodeError(f"--out {out_dir}: cannot create the directory ({e.strerror or e})") from None
    jpath, ppath = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    plot(doc, ppath)
    tmp = jpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(jpath)
    return jpath, ppath


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MonodecodeError(
            "the benchmark plot needs matplotlib, which is not installed: pip install 'monodecode[bench]'"
        ) from None
