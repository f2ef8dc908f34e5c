# Background jobs, each with a log file of its own (sourced, not run; bash >= 5.1 for `wait -p`).
#
#   jobs_start NAME COMMAND...  start COMMAND (a program or a shell function) in the background:
#                               stdin /dev/null, stdout and stderr to its log, in a process group
#                               of its own
#   jobs_wait [WHAT]            wait for every job; as each ends, print its name and time, then
#                               its log (a failed job: the log's last $JOBS_TAIL lines); when any
#                               failed, end with one line `error: WHAT: N of M jobs failed: ...`
#                               naming each failed job and its whole log, and return 1
#
# The first jobs_start sets EXIT, INT and TERM traps in the calling shell: a caller that exits
# (or is interrupted) before jobs_wait returns stops the jobs still running, whole process groups.
JOBS_TAIL=${JOBS_TAIL:-150}
_jobs_dir=""
_jobs_name=()
_jobs_pid=()
_jobs_log=()
_jobs_t0=()
_jobs_running=()

_jobs_stop_running() {
  local pid
  for pid in "${_jobs_running[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || true
  done
}

jobs_start() {
  local name=$1
  shift
  if [ -z "$_jobs_dir" ]; then
    _jobs_dir=$(mktemp -d "${TMPDIR:-/tmp}/monodecode-jobs.XXXXXX")
    trap _jobs_stop_running EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
  fi
  local log="$_jobs_dir/${#_jobs_name[@]}-${name//[^A-Za-z0-9._-]/_}.log"
  set -m # a process group of its own, so that stopping the job stops what it started
  "$@" </dev/null >"$log" 2>&1 &
  local pid=$!
  set +m
  _jobs_name+=("$name")
  _jobs_pid+=("$pid")
  _jobs_log+=("$log")
  _jobs_t0+=("$SECONDS")
  _jobs_running+=("$pid")
}

jobs_wait() {
  local what=${1:-jobs}
  local failed=() pid rc i s p still
  while ((${#_jobs_running[@]})); do
    pid=""
    rc=0
    wait -n -p pid "${_jobs_running[@]}" || rc=$?
    if [ -z "$pid" ]; then
      echo "error: jobs_wait: wait -n returned $rc without a job" >&2
      return 1
    fi
    still=()
    for p in "${_jobs_running[@]}"; do
      [ "$p" = "$pid" ] || still+=("$p")
    done
    _jobs_running=("${still[@]+"${still[@]}"}")
    for i in "${!_jobs_pid[@]}"; do
      [ "${_jobs_pid[$i]}" = "$pid" ] && break
    done
    s=$((SECONDS - _jobs_t0[i]))
    if ((rc == 0)); then
      echo "== ${_jobs_name[$i]}: done in $s s; its output:"
      cat "${_jobs_log[$i]}"
    else
      echo "== ${_jobs_name[$i]}: FAILED (exit $rc) after $s s; the last $JOBS_TAIL lines of its log:"
      tail -n "$JOBS_TAIL" "${_jobs_log[$i]}"
      failed+=("${_jobs_name[$i]} (exit $rc, log ${_jobs_log[$i]})")
    fi
  done
  if ((${#failed[@]})); then
    local list
    list=$(printf '%s; ' "${failed[@]}")
    echo "error: $what: ${#failed[@]} of ${#_jobs_name[@]} jobs failed: ${list%; }" >&2
    return 1
  fi
  rm -rf "$_jobs_dir"
}
