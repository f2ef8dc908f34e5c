#!/usr/bin/env python3
"""Run the decode-latency benchmark from a source checkout (what ``benchmarks/device_run.sh`` runs).

The harness is ``monodecode_ops.decode_bench.harness`` (installed with the CLI, also behind
``monodecode-ops bench``); this script only puts the checkout on the path and calls its ``main``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "ops")]

from monodecode_ops.decode_bench.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
