"""A live server's Prometheus ``/metrics`` page as samples (``verify --endpoint``, ``bench --endpoint``).

Fetched with ``endpoint_http.get`` (one deadline, a size cap) and parsed by prometheus_client's
text parser; a page that is not UTF-8 or not Prometheus text is an ``HttpFailure`` with one line,
like any other bad answer.
"""

from __future__ import annotations

from monodecode_ops.endpoint_http import HttpFailure, HttpTarget, get

Samples = dict[str, dict[tuple, float]]  # family/sample name -> {sorted label pairs: value}


def parse_samples(text: str, where: str) -> Samples:
    """Prometheus text -> samples by name; ``HttpFailure`` naming ``where`` when it is not that."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    except (ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
        # the parser's reaction to garbage varies by line; each is "not Prometheus text"
        first = (str(e).splitlines() or [""])[0][:120]
        raise HttpFailure(f"{where} is not Prometheus text ({first or type(e).__name__})") from None
    return samples


def scrape_samples(target: HttpTarget, timeout_s: float) -> Samples:
    """GET ``target`` (a /metrics URL) and parse it."""
    body = get(target, timeout_s)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HttpFailure(f"{target.path} is not UTF-8 text (byte {e.start})") from None
    return parse_samples(text, target.path)


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name{labels}``; 0 when absent."""
    return samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)
