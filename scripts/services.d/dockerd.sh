#!/usr/bin/env bash
# Docker engine for the image tests: `dockerd.sh start|stop|force-stop|status`.
#
# The engine runs the way DESIGN.md describes for machines without a bridge network: no bridge,
# no iptables, no masquerading, so containers use host networking or none. `start` is a no-op
# when an engine already answers on the socket. Several runs may share one engine (parallel
# `make test` on one machine): every `start` takes a lease named after its caller's pid (the
# same process calls `stop` later, e.g. scripts/with-services.sh), and `stop` drops that lease
# and stops the engine only when no live lease is left and this script started it (it owns the
# pidfile); it then waits until dockerd and its containerd are gone. An engine started by
# anything else is never stopped. `force-stop` ignores leases.
set -euo pipefail

# Data root outside the work tree so the locally made base image survives between `make test`
# runs on one machine; exec root + pidfile under /run so a reboot forgets a stale pid.
DATA_ROOT=${MONODECODE_DOCKER_DATA_ROOT:-/var/lib/monodecode-docker}
EXEC_ROOT=${MONODECODE_DOCKER_EXEC_ROOT:-/run/monodecode-docker}
PIDFILE=$EXEC_ROOT/dockerd.pid
LEASES=$EXEC_ROOT/leases
CALLER=${MONODECODE_DOCKER_LEASE:-$PPID}
SOCKET=${MONODECODE_DOCKER_SOCKET:-/var/run/docker.sock}
LOG=${MONODECODE_DOCKER_LOG:-/var/log/monodecode-dockerd.log}
READY_TIMEOUT_S=${MONODECODE_DOCKER_READY_TIMEOUT_S:-60}
# Storage: vfs works on every filesystem but copies a layer in full for every build step and
# container (measured here: 14 min for one arch's image build on a 1.3 GB base, vs 67 s for
# both archs with overlay2). `auto` (default) takes overlay2 when a trial overlay mount works
# on the data root's filesystem, else vfs; set MONODECODE_DOCKER_STORAGE_DRIVER=vfs|overlay2
# to force one. Each driver keeps its own image store under the data root.
STORAGE_DRIVER=${MONODECODE_DOCKER_STORAGE_DRIVER:-auto}

overlay_works() {
  local t
  t=$(mktemp -d "$DATA_ROOT/.overlay-probe.XXXXXX") || return 1
  mkdir -p "$t/l" "$t/u" "$t/w" "$t/m"
  if mount -t overlay overlay -o "lowerdir=$t/l,upperdir=$t/u,workdir=$t/w" "$t/m" 2>/dev/null; then
    umount "$t/m"; rm -rf "$t"; return 0
  fi
  rm -rf "$t"; return 1
}
STOP_TIMEOUT_S=${MONODECODE_DOCKER_STOP_TIMEOUT_S:-30}

answers() {
  # The engine answers when its API returns a server version on the socket.
  [ -S "$SOCKET" ] && timeout 5 docker -H "unix://$SOCKET" version --format '{{.Server.Version}}' >/dev/null 2>&1
}

our_pid() {
  # Prints the pid from our pidfile if that process is still a dockerd.
  [ -s "$PIDFILE" ] || return 1
  local pid
  pid=$(cat "$PIDFILE")
  [ -d "/proc/$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ] && echo "$pid"
}

live_leases() {
  # Prints the pids of callers that still hold a lease (leases of dead callers are dropped).
  local f pid
  for f in "$LEASES"/*; do
    [ -e "$f" ] || continue
    pid=${f##*/}
    if [ -d "/proc/$pid" ]; then echo "$pid"; else rm -f "$f"; fi
  done
}

start() {
  mkdir -p "$LEASES"
  if answers; then
    if our_pid >/dev/null; then : > "$LEASES/$CALLER"; fi
    echo "dockerd: an engine already answers on $SOCKET; using it"
    return 0
  fi
  command -v dockerd >/dev/null || { echo "dockerd: not installed (Debian package docker.io, see scripts/apt-packages.txt)" >&2; return 1; }
  mkdir -p "$DATA_ROOT" "$EXEC_ROOT" "$(dirname "$LOG")"
  if [ "$STORAGE_DRIVER" = auto ]; then
    if overlay_works; then STORAGE_DRIVER=overlay2; else STORAGE_DRIVER=vfs; fi
  fi
  if pid=$(our_pid); then
    echo "dockerd: pid $pid from $PIDFILE does not answer yet; waiting for it"
  else
    rm -f "$PIDFILE"
    # setsid: the engine must outlive this script and not get the caller's signals.
    setsid dockerd \
      --storage-driver="$STORAGE_DRIVER" --bridge=none --iptables=false --ip-masq=false --ip6tables=false \
      --data-root="$DATA_ROOT" --exec-root="$EXEC_ROOT" --pidfile="$PIDFILE" \
      --host="unix://$SOCKET" </dev/null >>"$LOG" 2>&1 &
  fi
  local deadline=$((SECONDS + READY_TIMEOUT_S))
  until answers; do
    if ((SECONDS >= deadline)); then
      echo "dockerd: no answer on $SOCKET after ${READY_TIMEOUT_S}s; last log lines:" >&2
      tail -n 15 "$LOG" >&2 || true
      return 1
    fi
    sleep 0.5
  done
  : > "$LEASES/$CALLER"
  echo "dockerd: ready on $SOCKET ($STORAGE_DRIVER storage, data root $DATA_ROOT, log $LOG)"
}

stop() {
  rm -f "$LEASES/$CALLER"
  local others
  others=$(live_leases | tr '\n' ' ')
  if [ -n "$others" ]; then
    echo "dockerd: still used by pid(s) ${others% }; leaving it running"
    return 0
  fi
  force_stop
}

force_stop() {
  local pid
  rm -rf "$LEASES"
  if ! pid=$(our_pid); then
    echo "dockerd: none started by this script (no live pid in $PIDFILE); nothing to stop"
    rm -f "$PIDFILE"
    return 0
  fi
  kill -TERM "$pid"
  local deadline=$((SECONDS + STOP_TIMEOUT_S))
  while [ -d "/proc/$pid" ]; do
    if ((SECONDS >= deadline)); then
      echo "dockerd: pid $pid still running after ${STOP_TIMEOUT_S}s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.5
  done
  # dockerd stops the containerd it started itself; wait for that one too (it is ours).
  local cpid_file=$EXEC_ROOT/containerd/containerd.pid
  if [ -s "$cpid_file" ]; then
    local cpid
    cpid=$(cat "$cpid_file")
    deadline=$((SECONDS + STOP_TIMEOUT_S))
    while [ -d "/proc/$cpid" ] && [ "$(cat "/proc/$cpid/comm" 2>/dev/null)" = containerd ]; do
      ((SECONDS < deadline)) || { kill -KILL "$cpid" 2>/dev/null || true; break; }
      sleep 0.5
    done
  fi
  rm -f "$PIDFILE"
  echo "dockerd: stopped pid $pid"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  force-stop) force_stop ;;
  status) if answers; then echo "dockerd: answering on $SOCKET"; else echo "dockerd: not answering on $SOCKET"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|force-stop|status" >&2; exit 2 ;;
esac
