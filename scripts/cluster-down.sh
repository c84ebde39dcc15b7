#!/usr/bin/env bash
# `make cluster-down`: stops what `make cluster-up` started (gateway, nodes: their running
# sandboxes are paused, blockds, scheduler, redis) and removes the nodes' namespaces and the
# bridge. State stays in AENV_CLUSTER_DIR: the next cluster-up resumes from it. Idempotent.
set -euo pipefail
dir=${AENV_CLUSTER_DIR:-/var/lib/aenv-cluster}
timeout=${AENV_DOWN_TIMEOUT:-300}

me=cluster-down
# shellcheck source=scripts/stop-lib.sh
source "$(dirname "$0")/stop-lib.sh"

stop "$dir/gateway.pid" gateway gateway
for pidfile in "$dir"/node*/node.pid; do
  [[ -e $pidfile ]] && stop "$pidfile" "serve" "$(basename "$(dirname "$pidfile")")"
done
for pidfile in "$dir"/node*/blockd.pid; do
  [[ -e $pidfile ]] && stop "$pidfile" "blockd" "blockd of $(basename "$(dirname "$pidfile")")"
done
stop "$dir/scheduler.pid" scheduler scheduler
stop "$dir/redis.pid" redis-server redis
# the nodes' namespaces, and their slots' (aenvcN-sK) that a node killed before it closed left
for ns in $(ip netns list 2>/dev/null | awk '/^aenvc(-node[0-9]+|[0-9]+-s[0-9]+)/ {print $1}'); do
  ip netns delete "$ns"
done
for link in $(ip -o link show 2>/dev/null | awk -F': ' '/ aenvc-n[0-9]+@/ {sub(/@.*/, "", $2); print $2}'); do
  ip link delete "$link" 2>/dev/null || true
done
ip link delete aenvc-br 2>/dev/null || true
nft delete table ip aenvc 2>/dev/null || true
echo "cluster down (state kept in $dir)"
