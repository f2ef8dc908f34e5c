#!/usr/bin/env bash
# Toolchain set-up beyond pip: each step (scripts/toolchains.d/*.sh) is idempotent.
# Usage: setup-toolchains.sh VENV [PREP...]
#
# The steps marked `# setup-toolchains: own job` build venvs of their own from python3 and the
# network (the two vLLMs: 273 and 250 s of mostly one busy core each on CI's 2 cores, one after the
# other before) and run as jobs of their own, at the same time as the main job: PREP, when given
# (make test-deps: the main venv's pip install), then the other steps in order, as they use VENV.
# Each job logs to a file of its own, printed when it ends (scripts/lib/jobs.sh); a failed job's
# log tail and one `error:` line naming it, and the script fails when any job failed.
set -euo pipefail
VENV=${1:-.venv}
shift || true
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/jobs.sh
. scripts/lib/jobs.sh

own_job() { grep -q '^# setup-toolchains: own job' "$1"; }

step() {
  echo "toolchain: $1"
  local t=$SECONDS
  bash "$1" "$VENV"
  echo "toolchain: $1 took $((SECONDS - t)) s"
}

main_job() {
  if (($#)); then
    echo "toolchain: prep: $*"
    local t=$SECONDS
    "$@"
    echo "toolchain: prep took $((SECONDS - t)) s"
  fi
  local s
  for s in scripts/toolchains.d/*.sh; do
    if [ -e "$s" ] && ! own_job "$s"; then
      step "$s"
    fi
  done
}

t0=$SECONDS
own=()
rest=()
for s in scripts/toolchains.d/*.sh; do
  [ -e "$s" ] || continue
  if own_job "$s"; then
    jobs_start "$(basename "$s")" step "$s"
    own+=("$(basename "$s")")
  else
    rest+=("$(basename "$s")")
  fi
done
jobs_start "main ($VENV)" main_job "$@"
echo "toolchain: $((${#own[@]} + 1)) jobs at once, each printed when it ends: ${own[*]}, main ($VENV: ${1:+prep, then }${rest[*]})"
jobs_wait toolchain
echo "toolchain: all jobs took $((SECONDS - t0)) s"
