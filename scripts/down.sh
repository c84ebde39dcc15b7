#!/usr/bin/env bash
# `make down`: stops what `make up` started. SIGTERM lets the node pause every running sandbox
# (they resume after the next `make up`) and close its database; it gets AENV_DOWN_TIMEOUT
# seconds (default 300) before SIGKILL, which loses nothing either: the next start adopts the
# VMs that still run. Then the block daemon stops. Idempotent.
set -euo pipefail
state_dir=${AENV_HOME:-${AENV_STATE_DIR:-/var/lib/aenv}}
timeout=${AENV_DOWN_TIMEOUT:-300}

# stop PIDFILE NEEDLE NAME: SIGTERM the process, wait, SIGKILL after $timeout s.
stop() {
  local pid
  pid=$(cat "$1" 2>/dev/null || true)
  if [[ ! $pid =~ ^[0-9]+$ ]] || ! tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$2"
  then
    rm -f "$1"
    echo "$3 not running"
    return 0
  fi
  kill -TERM "$pid"
  local waited=0
  # A zombie's (or a gone process's) command line reads empty.
  while [[ -n $(tr -d '\0' <"/proc/$pid/cmdline" 2>/dev/null) ]]; do
    if (( waited >= timeout * 5 )); then
      echo "down: $3 (pid $pid) still running after $timeout s, killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.2
    waited=$((waited + 1))
  done
  rm -f "$1"
  echo "$3 stopped (pid $pid)"
}

stop "$state_dir/node.pid" "aenv serve" "node"
stop "$state_dir/blockd.pid" "$state_dir/blockd/blockd.sock" "blockd"
