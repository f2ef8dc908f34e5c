#!/bin/sh
# Precompile stage (runs as the image's non-root user): bakes the kernel artifacts for one arch
# and the given model profiles into $OUT/artifacts (manifest.json + files), the embedded tiny
# model (what `monodecode-ops verify` self-tests with) into $OUT/cache, and $OUT/image.json
# (versions, backends, build keys, manifest digest), which `monodecode-ops build` reads back
# to label the final image.
# Usage: precompile.sh ARCH "PROFILE[,PROFILE...]"
set -eu
ARCH=$1
PROFILES=$2
PY=python3
OUT=/tmp/monodecode-out
rm -rf "$OUT"
mkdir -p "$OUT/artifacts" "$OUT/cache"

for p in $(echo "$PROFILES" | tr ',' ' '); do
  echo "precompile: $ARCH $p"
  monodecode-ops precompile --arch "$ARCH" --profile "$p" --out "$OUT/artifacts"
done
# An arch/profile set with no ahead-of-time kernels still gets a (empty) manifest.
if [ ! -f "$OUT/artifacts/manifest.json" ]; then printf '{"schema": 1, "artifacts": []}\n' > "$OUT/artifacts/manifest.json"; fi
rm -f "$OUT/artifacts/.lock"

MONODECODE_CACHE_DIR="$OUT/cache" "$PY" -c \
  "from monodecode.model.tiny import ensure_tiny_model; print('precompile: tiny model at', ensure_tiny_model())"
"$PY" /opt/monodecode/build/pyenv.py image-info --arch "$ARCH" --profiles "$PROFILES" \
  --artifacts "$OUT/artifacts" --precompile "monodecode-ops precompile --arch $ARCH" --out "$OUT/image.json"
chmod -R a+rX "$OUT"
