"""The decode-latency harness, installed with the CLI: ``harness`` (``run``: measuring), ``report``
(verdicts, tables, plots), ``stock`` (the stock per-op and compiled-halves baselines),
``fullgraph`` (the whole-layer fullgraph stock step), ``w8a16`` (its split-K FP8 GEMM), ``probes`` (read-bandwidth probes), ``prewarm`` (their compiles ahead of a run) and
``timeline`` (per-stage stamp plots). ``monodecode-ops bench`` and ``benchmarks/decode_latency.py``
both call ``harness``."""
