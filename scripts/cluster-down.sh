#!/usr/bin/env bash
# `make cluster-down`: stops what `make cluster-up` started (gateway, nodes: their running
# sandboxes are paused, blockds, scheduler, redis) and removes the nodes' namespaces and the
# bridge. State stays in AENV_CLUSTER_DIR: the next cluster-up resumes from it. Idempotent.
set -euo pipefail
dir=${AENV_CLUSTER_DIR:-/var/lib/aenv-cluster}
timeout=${AENV_DOWN_TIMEOUT:-300}

stop() {  # stop PIDFILE NAME: SIGTERM, wait up to $timeout s, then SIGKILL
  local pid
  pid=$(cat "$1" 2>/dev/null || true)
  if [[ ! $pid =~ ^[0-9]+$ ]] || ! kill -0 "$pid" 2>/dev/null; then
    rm -f "$1"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  local waited=0
  while kill -0 "$pid" 2>/dev/null && [[ -n $(tr -d '\0' <"/proc/$pid/cmdline" 2>/dev/null) ]]
  do
    if (( waited >= timeout * 5 )); then
      echo "cluster-down: $2 (pid $pid) still running after $timeout s, killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.2
    waited=$((waited + 1))
  done
  rm -f "$1"
  echo "$2 stopped"
}

stop "$dir/gateway.pid" gateway
for pidfile in "$dir"/node*/node.pid; do
  [[ -e $pidfile ]] && stop "$pidfile" "$(basename "$(dirname "$pidfile")")"
done
for pidfile in "$dir"/node*/blockd.pid; do
  [[ -e $pidfile ]] && stop "$pidfile" "blockd of $(basename "$(dirname "$pidfile")")"
done
stop "$dir/scheduler.pid" scheduler
stop "$dir/redis.pid" redis
for ns in $(ip netns list 2>/dev/null | awk '/^aenvc-node[0-9]+/ {print $1}'); do
  ip netns delete "$ns"
done
for link in $(ip -o link show 2>/dev/null | awk -F': ' '/ aenvc-n[0-9]+@/ {sub(/@.*/, "", $2); print $2}'); do
  ip link delete "$link" 2>/dev/null || true
done
ip link delete aenvc-br 2>/dev/null || true
echo "cluster down (state kept in $dir)"
