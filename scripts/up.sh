#!/usr/bin/env bash
# `make up`, after `make system venv`: builds the guest assets, starts the node server in the
# background and prints how to reach it. Idempotent: a running node is left alone.
#
# Settings (environment): AENV_STATE_DIR (default /var/lib/aenv), AENV_PORT (8000),
# AENV_HOST (127.0.0.1), AENV_LOG_DIR (/var/log/aenv).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
aenv="$root/.venv/bin/aenv"
state_dir=${AENV_STATE_DIR:-/var/lib/aenv}
host=${AENV_HOST:-127.0.0.1}
port=${AENV_PORT:-8000}
log_dir=${AENV_LOG_DIR:-/var/log/aenv}
log_file="$log_dir/node.log"
pidfile="$state_dir/node.pid"
url="http://$host:$port"

[[ -x $aenv ]] || { echo "up: $aenv is missing: run make venv first" >&2; exit 1; }
mkdir -p "$state_dir" "$log_dir"

# The pid in $pidfile, if that process is still our node server.
running_pid() {
  local pid
  pid=$(cat "$pidfile" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "aenv serve" || return 1
  echo "$pid"
}

healthy() {
  curl -fsS --max-time 2 "$url/health" 2>/dev/null | grep -q '"status":"ok"'
}

# Guest assets (kernel, initramfs, tools disk) for the VM backend; only what changed is rebuilt.
"$aenv" guest build --state-dir "$state_dir" -q

if pid=$(running_pid); then
  echo "node already running (pid $pid), not starting another"
else
  if healthy || (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then
    echo "up: something else listens on $host:$port (no node pidfile at $pidfile)" >&2
    exit 1
  fi
  # setsid: the node outlives this shell and make; AENV_API_KEY would override the state dir key.
  env -u AENV_API_KEY setsid "$aenv" serve --state-dir "$state_dir" --host "$host" --port "$port" \
    >>"$log_file" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$pidfile"
  echo "node starting (pid $pid), log $log_file"
fi

for _ in $(seq 1 300); do
  healthy && break
  if ! kill -0 "$pid" 2>/dev/null; then
    rm -f "$pidfile"
    echo "up: the node exited during start; the end of $log_file:" >&2
    tail -n 20 "$log_file" >&2
    exit 1
  fi
  sleep 0.2
done
if ! healthy; then
  echo "up: the node (pid $pid) did not answer $url/health within 60 s; see $log_file" >&2
  exit 1
fi

key=$(cat "$state_dir/secrets/api-key")
cat <<MSG

agentenv node is up (pid $pid)
  API URL:  $url   (OpenAPI document: $url/openapi.json)
  API key:  $key   (from $state_dir/secrets/api-key)
  log:      $log_file
  note:     sandboxes run on the process backend (envd processes on this host, no VM); the VM backend comes later.

For the E2B SDK (Python or TypeScript), export:
  export E2B_API_URL=$url
  export E2B_SANDBOX_URL=$url
  export E2B_API_KEY=$key

Stop it with: make down
MSG
