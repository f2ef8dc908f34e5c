"""The decode-latency harness, installed with the CLI: ``harness`` (``run`` and the report
tables), ``stock`` (the stock per-op baselines) and ``timeline`` (per-stage stamp plots).
``monodecode-ops bench`` and ``benchmarks/decode_latency.py`` both call ``harness``."""
