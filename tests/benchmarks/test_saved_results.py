"""The saved benchmark results stay small enough to travel: every device call sends the tracked
tree, and its limit is 64 MiB (what else a call carries, such as wheels, counts too). Session 33's
first call was refused at 70.5 MB, from uncompressed timeline stamps and RGBA plots; this keeps the
saved forms (``timeline.save_stamps``, ``plots.save_png``) and leaves room for the carried files."""

from __future__ import annotations

import subprocess
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
TRACKED_CAP = 56 * 2**20  # the device call's 64 MiB, less 8 MiB for what a call carries


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p]


def _mode(png: Path) -> str:
    with Image.open(png) as im:
        return im.mode


def test_the_tracked_tree_fits_a_device_call_with_room_to_carry():
    files = [p for p in _tracked() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    biggest = sorted(files, key=lambda p: p.stat().st_size)[-3:]
    assert total < TRACKED_CAP, (
        f"tracked files take {total / 2**20:.1f} MiB (cap {TRACKED_CAP / 2**20:.0f} MiB); largest: "
        + ", ".join(f"{p.relative_to(ROOT)} {p.stat().st_size / 2**20:.1f} MiB" for p in biggest)
    )


def test_saved_results_are_in_their_compact_forms():
    results = [p for p in _tracked() if "benchmarks/results/" in p.as_posix()]
    raw = [p.name for p in results if p.name.endswith("_stamps.pt")]
    assert not raw, f"timeline stamps saved uncompressed (timeline.save_stamps writes .pt.xz): {raw[:3]}"
    rgb = [p.name for p in results if p.suffix == ".png" and _mode(p) != "P"]
    assert not rgb, f"plots saved without plots.save_png's palette: {rgb[:3]}"
