"""Agreement of two servers' greedy continuations, measured in log-probabilities.

The tiny model has random bf16 weights and many exact top-2 ties, so two correct decoders (stock
compiled vs stock eager, or mono vs stock) part ways at a tie and from then on write different
text: token equality is not a usable check. Instead every continuation a server generated is
re-scored by a reference server (stock eager) with ``prompt_logprobs``: for each generated token
we compare

- ``drift``: |logprob the generating server gave the token - logprob the reference gives it|
  (the same token in the same context: a direct bound on how far the two models' numbers differ);
- ``regret``: reference's best logprob at that position - reference's logprob of the token
  (0 when the generating server picked the reference's greedy token; small only at near-ties).

A decoder that reads the KV cache wrongly produces contexts the reference finds very unlikely:
both numbers jump by nats, not by the hundredths a bf16 rounding difference gives.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Continuation:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the generating server's logprob of each of its tokens


@dataclass
class Agreement:
    max_drift: float
    max_regret: float
    tokens: int
    worst: str  # where the largest drift was (prompt index, position)

    def as_dict(self) -> dict:
        return {"max_drift": self.max_drift, "max_regret": self.max_regret, "tokens": self.tokens}


def generate(client, model: str, prompts: list[str], max_tokens: int) -> list[Continuation]:
    """Greedy continuations of ``prompts`` in one batched request (all rows decode together)."""
    resp = client.completions.create(
        model=model,
        prompt=prompts,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=1,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    out = []
    for choice in sorted(resp.model_dump()["choices"], key=lambda c: c["index"]):
        ids = choice["token_ids"]
        lps = choice["logprobs"]["token_logprobs"]
        assert len(ids) == max_tokens == len(lps), (len(ids), len(lps), max_tokens)
        out.append(Continuation(list(choice["prompt_token_ids"]), list(ids), [float(x) for x in lps]))
    return out


def agreement(conts: list[Continuation], prompt_logprobs: list[list[dict]]) -> Agreement:
    """Drift and regret of ``conts`` against the reference's prompt logprobs of each prompt +
    continuation (per position, ``{token id (int or str): logprob}`` holding at least the token
    and the reference's best)."""
    drift = regret = 0.0
    worst = ""
    tokens = 0
    for i, (c, plp) in enumerate(zip(conts, prompt_logprobs, strict=True)):
        base = len(c.prompt_ids)
        for t, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            entry = {int(k): v for k, v in plp[base + t].items()}
            ref = entry[tok]
            d = abs(lp - ref)
            if d > drift:
                drift, worst = d, f"prompt {i}, token {t}"
            regret = max(regret, max(entry.values()) - ref)
            tokens += 1
    return Agreement(drift, regret, tokens, worst)


def rescore(client, model: str, conts: list[Continuation]) -> Agreement:
    """Re-score every continuation with the reference server's prompt logprobs."""
    scored = []
    for c in conts:
        resp = client.completions.create(
            model=model,
            prompt=c.prompt_ids + c.token_ids,
            max_tokens=1,
            temperature=0.0,
            extra_body={"prompt_logprobs": 1},
        )
        plp = resp.model_dump()["choices"][0]["prompt_logprobs"]
        scored.append([{k: v["logprob"] for k, v in (entry or {}).items()} for entry in plp])
    return agreement(conts, scored)
