"""``monodecode_ops.plots.save_png``: the benchmarks' figures saved as palette PNGs that look as
matplotlib drew them, written whole or not at all."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest
from PIL import Image

from monodecode_ops.plots import save_png


def _figure():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(["a", "b", "c"], [3, 1, 2], color=["tab:blue", "tab:orange", "tab:green"])
    ax.plot([0, 2], [0, 3], color="tab:red")
    ax.set_title("synthetic")
    return fig


def test_the_saved_plot_is_a_palette_png_that_matches_matplotlibs_render(tmp_path):
    fig = _figure()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=80, format="png")
    drawn = np.asarray(Image.open(buf).convert("RGB"), dtype=np.int16)
    path = tmp_path / "p.png"
    save_png(fig, path, dpi=80)
    saved = Image.open(path)
    assert saved.mode == "P" and saved.size == (320, 240)
    diff = np.abs(np.asarray(saved.convert("RGB"), dtype=np.int16) - drawn)
    # a 256-colour palette of a few-colour plot: exact where the colours are flat, a few levels
    # off in the antialiased edges
    assert diff.mean() < 1.0 and np.percentile(diff, 99) <= 16
    assert not plt.fignum_exists(fig.number), "the figure is closed"
    assert list(tmp_path.iterdir()) == [path]


def test_a_failed_save_leaves_the_old_plot_and_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "p.png"
    path.write_bytes(b"the previous plot")

    real_save = Image.Image.save

    def disk_full(self, fp, *args, **kwargs):
        if isinstance(fp, io.BytesIO):  # matplotlib's own render into memory
            return real_save(self, fp, *args, **kwargs)
        fp.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", disk_full)
    fig = _figure()
    with pytest.raises(OSError, match="No space left"):
        save_png(fig, path, dpi=80)
    assert path.read_bytes() == b"the previous plot"
    assert list(tmp_path.iterdir()) == [path]
    assert not plt.fignum_exists(fig.number)


def test_a_link_planted_beside_the_plot_is_not_written_through(tmp_path):
    """The temporary file's name is fresh and created exclusively, so a symlink planted where a
    predictable temporary name would be (``p.tmp.png``, the old scheme) leaves its target alone."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"not a plot")
    path = tmp_path / "p.png"
    (tmp_path / "p.tmp.png").symlink_to(victim)
    save_png(_figure(), path, dpi=80)
    assert victim.read_bytes() == b"not a plot"
    with Image.open(path) as saved:
        assert saved.mode == "P"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "p.tmp.png", "victim"]
