#!/usr/bin/env bash
# Runs a command with the services the tests need started beforehand and stopped afterwards.
# Each service script in scripts/services.d/ has `start` and `stop` actions.
set -euo pipefail
cd "$(dirname "$0")/.."
started=()
cleanup() {
  for ((i=${#started[@]}-1; i>=0; i--)); do bash "${started[$i]}" stop || true; done
}
trap cleanup EXIT
for svc in scripts/services.d/*.sh; do
  [ -e "$svc" ] || continue
  bash "$svc" start
  started+=("$svc")
done
"$@"
