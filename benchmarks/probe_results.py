"""Where the GPU probes save their rows: ``<out>/<probe>_<GPU name>.json``, with the GPU's name."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_rows(out: str | Path, probe: str, rows: list) -> Path:
    """``rows`` as ``{"gpu": name, "rows": rows}`` in ``out`` (created), named after the probe
    and this GPU; returns the file's path."""
    Path(out).mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name()
    path = Path(out) / f"{probe}_{name.replace(' ', '-')}.json"
    path.write_text(json.dumps({"gpu": name, "rows": rows}, indent=1))
    return path
