#!/usr/bin/env bash
# Toolchain set-up beyond pip: each step is idempotent. Usage: setup-toolchains.sh VENV
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/.."
for step in scripts/toolchains.d/*.sh; do
  [ -e "$step" ] || continue
  echo "toolchain: $step"
  t=$SECONDS
  bash "$step" "$VENV"
  echo "toolchain: $step took $((SECONDS - t)) s"
done
