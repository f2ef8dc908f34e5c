#!/usr/bin/env bash
# AITER's Python sources (the `amd-aiter` wheel from PyPI, pure Python) unpacked into .tools/aiter,
# NOT installed into any venv: `import aiter` needs ROCm (its package __init__ builds HIP
# extensions), and vLLM changes its behaviour when it finds the package. The tests load single
# modules from these files as ground truth: `aiter.ops.shuffle.shuffle_weight` (the layout of
# AITER-preshuffled weights) and `aiter.ops.triton.unified_attention` (ROCM_AITER_UNIFIED_ATTN's
# kernel, run under Triton's interpreter); tests/aiter_sources.py loads them.
# Idempotent: skipped when the stamp matches. Usage: 35-aiter.sh VENV
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/../.."
SPEC="amd-aiter==0.1.7.post2.dev18"  # the only release on PyPI
DEST=".tools/aiter"
[ "$(cat "$DEST/.aiter-version" 2>/dev/null)" = "$SPEC" ] && [ -f "$DEST/aiter/ops/shuffle.py" ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$VENV/bin/python" -m pip --disable-pip-version-check -q install --no-deps --no-compile --target "$tmp/out" "$SPEC"
# Replace the destination whole: a half-written tree is never left in place.
rm -rf "$DEST.new" && mkdir -p "$(dirname "$DEST")" && mv "$tmp/out" "$DEST.new"
echo "$SPEC" >"$DEST.new/.aiter-version"
rm -rf "$DEST" && mv "$DEST.new" "$DEST"
echo "aiter sources: $DEST ($SPEC)"
