#!/usr/bin/env bash
# The real vLLM 0.33.0 in its own virtual environment, `.venv-vllm` next to the main venv, for
# the plugin tests (`.venv-vllm/bin/python -m pytest tests/vllm`).
#
# Why a second venv: vllm==0.33.0 pins torch==2.14.0 while the main venv keeps the CPU build of
# torch 2.13.0. Why this recipe: the full dependency set pulls a multi-GB CUDA torch 2.14.0 from
# PyPI plus GPU-only kernel packages (flashinfer, tilelang, cutlass-dsl, ...) that cannot run on
# a CPU machine anyway. Instead:
#   1. torch==2.14.1 (same minor as vLLM's pin; with its CUDA runtime wheels, about 3 GB, from
#      PyPI or pip's cache),
#   2. vllm==0.33.0 --no-deps (the real package from PyPI, one 336 MB wheel),
#   3. every other requirement vLLM declares, read from its own metadata, except the
#      GPU-kernel packages listed in GPU_ONLY (they are imported lazily by GPU code paths),
#   4. monodecode editable (--no-deps: its own deps are a subset of vLLM's) so the
#      `vllm.general_plugins` entry point is registered, plus pytest.
# Idempotent: a stamp (hash of this script + pyproject.toml) skips the work when nothing changed.
# Usage: 40-vllm.sh MAIN_VENV
# setup-toolchains: own job (a venv of its own: needs python3 and the network, not MAIN_VENV)
set -euo pipefail
MAIN_VENV=${1:-.venv}
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/lib/vllm-venv.sh
. scripts/lib/vllm-venv.sh
VENV="$(dirname "$MAIN_VENV")/.venv-vllm"
PYTHON=${PYTHON:-python3}
TORCH_SPEC="torch==2.14.1"
VLLM_SPEC="vllm==0.33.0"
GPU_ONLY="torch torchaudio torchvision torchcodec pynvvideocodec flashinfer-python apache-tvm-ffi tilelang
nvidia-cudnn-frontend nvtx fastsafetensors instanttensor nvidia-cutlass-dsl quack-kernels tokenspeed-mla
humming-kernels"

stamp_file="$VENV/.monodecode-vllm-stamp"
want_stamp=$(cat "$0" scripts/lib/vllm-venv.sh pyproject.toml | sha256sum | cut -d' ' -f1)
check() {
  # writes .pyc for what it imports (pip installed with --no-compile: scripts/lib/vllm-venv.sh)
  env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import vllm.plugins, vllm.config, vllm.engine.arg_utils  # noqa: F401  (the parts the tests use)
import monodecode.vllm_plugin  # noqa: F401
assert md.version("vllm") == "0.33.0", md.version("vllm")
names = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
assert "monodecode" in names, f"monodecode entry point not registered: {names}"
EOF
}
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$want_stamp" ] && check >/dev/null 2>&1; then
  echo "vllm venv: $VENV is up to date"
  exit 0
fi

t0=$(date +%s)
install_vllm_venv "$VENV" "$PYTHON" "$TORCH_SPEC" "$VLLM_SPEC" vllm "$GPU_ONLY"
scripts/lib/pip-editable.sh "$VENV/bin/python" . --no-deps
check
echo "$want_stamp" >"$stamp_file"
echo "vllm venv: $VENV ready in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
