#!/usr/bin/env bash
# FlyDSL compile-only toolchain (gfx942 / gfx950 code objects on a machine without a GPU).
#
# FlyDSL's ROCDL backend links code objects with $ROCM_PATH/llvm/bin/ld.lld and reads ROCm's
# device bitcode from $ROCM_PATH/amdgcn/bitcode (hashed into its cache key). On a ROCm node
# or image both come from /opt/rocm. Here we lay out the same shape inside the repository's
# ignored area, .tools/rocm, from Debian's lld-19 and rocm-device-libs (apt-packages.txt):
#   .tools/rocm/llvm/bin/ld.lld      -> /usr/lib/llvm-19/bin/ld.lld
#   .tools/rocm/amdgcn/bitcode/*.bc  -> /usr/lib/x86_64-linux-gnu/amdgcn/bitcode/*.bc
# monodecode.kernels.flydsl.toolchain picks ROCM_PATH: $ROCM_PATH if set, else /opt/rocm when it
# has that layout, else .tools/rocm. Idempotent; usage: 20-flydsl.sh VENV
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/../.."

# flydsl itself comes from the pyproject `flydsl` extra; check the pinned version is there.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, sys
try:
    v = md.version("flydsl")
except md.PackageNotFoundError:
    sys.exit("toolchain 20-flydsl: flydsl is not installed in the venv (pip install -e '.[flydsl]')")
if v != "0.5.0":
    sys.exit(f"toolchain 20-flydsl: flydsl {v} installed, the kernels are pinned to 0.5.0")
PY

LLD=/usr/lib/llvm-19/bin/ld.lld
BITCODE=/usr/lib/x86_64-linux-gnu/amdgcn/bitcode
READELF=/usr/lib/llvm-19/bin/llvm-readelf
for f in "$LLD" "$READELF" "$BITCODE/ocml.bc"; do
  [ -e "$f" ] || { echo "toolchain 20-flydsl: $f missing (apt: lld-19 llvm-19 rocm-device-libs)" >&2; exit 1; }
done

ROOT=.tools/rocm
mkdir -p "$ROOT/llvm/bin" "$ROOT/amdgcn"
ln -sfn "$LLD" "$ROOT/llvm/bin/ld.lld"
ln -sfn "$READELF" "$ROOT/llvm/bin/llvm-readelf"
ln -sfn "$BITCODE" "$ROOT/amdgcn/bitcode"
echo "toolchain 20-flydsl: ROCM_PATH layout ready at $(pwd)/$ROOT"
