"""Saving the benchmarks' matplotlib figures as small PNGs, written whole or not at all.

The plots are lines and bars in a few colours: a 256-colour palette keeps them as they look at
about a third of the bytes of the RGBA PNG matplotlib writes. The saved results are tracked in git
and travel with every device call, whose working tree has a size limit.
"""

from __future__ import annotations

import io
import os
import secrets
from pathlib import Path


def save_png(fig, path: Path, dpi: int) -> None:
    """Write ``fig`` to ``path`` as a palette PNG (through a temporary file, so a failed save
    leaves no partial plot and the old one in place) and close it."""
    import matplotlib.pyplot as plt
    from PIL import Image  # matplotlib's own dependency

    path = Path(path)
    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(colors=256)
    # a fresh name, created exclusively: a link planted beside the plot is never written through
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            image.save(f, format="PNG", optimize=True)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
