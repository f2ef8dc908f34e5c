"""Run a Python module or script with the Triton CUDA launch target changed (experiments, and
the device run's fallback to the previous configuration): ``config.CUDA`` is replaced before
anything builds kernels, exactly as ``experiments.py`` does per variant.

Usage: ``python benchmarks/with_target.py '{"flatten": false}' -m pytest tests/...`` or
``python benchmarks/with_target.py '{"flatten": false}' benchmarks/decode_latency.py --out DIR``.
"""

from __future__ import annotations

import dataclasses
import json
import runpy
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: with_target.py CHANGE_JSON (-m MODULE | SCRIPT) [ARGS...]")
    from monodecode.kernels.triton import config

    change = json.loads(argv[0])
    config.CUDA = dataclasses.replace(config.CUDA, **change)
    print(f"# triton CUDA target: {config.CUDA}", file=sys.stderr, flush=True)
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
