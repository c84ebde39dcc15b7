#!/usr/bin/env bash
# `make down`: stops the node server `make up` started. SIGTERM lets it pause its running
# sandboxes and close its database; it gets 60 s before SIGKILL. Idempotent.
set -euo pipefail
state_dir=${AENV_STATE_DIR:-/var/lib/aenv}
pidfile="$state_dir/node.pid"

pid=$(cat "$pidfile" 2>/dev/null || true)
if [[ ! $pid =~ ^[0-9]+$ ]] || ! tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "aenv serve"; then
  rm -f "$pidfile"
  echo "node not running"
  exit 0
fi
kill -TERM "$pid"
for _ in $(seq 1 300); do
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.2
done
if kill -0 "$pid" 2>/dev/null; then
  echo "down: node (pid $pid) still running after 60 s, killing it" >&2
  kill -KILL "$pid"
fi
rm -f "$pidfile"
echo "node stopped (pid $pid)"
