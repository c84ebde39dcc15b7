#!/usr/bin/env bash
# `make up`, after `make system venv`: builds the guest assets, starts the block daemon and the
# node server (VM backend, built-in `base` template) in the background and prints how to reach
# it. Idempotent: a running node is left alone and only reported.
#
# Settings (environment): AENV_HOME (state directory, default /var/lib/aenv; AENV_STATE_DIR is
# the older name), AENV_PORT (8000), AENV_HOST (127.0.0.1), AENV_LOG_DIR (<state>/logs),
# AENV_VM_ASSETS_DIR (guest assets, default the state directory), AENV_UP_TIMEOUT (seconds the
# first start may take, default 1800: debootstrap of the base template on a cold cache).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
aenv="$root/.venv/bin/aenv"
python="$root/.venv/bin/python"
state_dir=${AENV_HOME:-${AENV_STATE_DIR:-/var/lib/aenv}}
host=${AENV_HOST:-127.0.0.1}
port=${AENV_PORT:-8000}
# sandbox hosts are {port}-{id}.$domain (sandbox.get_host(port)); *.localhost is loopback
domain=${AENV_DOMAIN:-localhost:$port}
log_dir=${AENV_LOG_DIR:-$state_dir/logs}
assets_dir=${AENV_VM_ASSETS_DIR:-$state_dir}
up_timeout=${AENV_UP_TIMEOUT:-1800}
node_log="$log_dir/node.log"
blockd_log="$log_dir/blockd.log"
node_pidfile="$state_dir/node.pid"
blockd_pidfile="$state_dir/blockd.pid"
blockd_socket="$state_dir/blockd/blockd.sock"
blockd_state="$state_dir/blockd/state"
url="http://$host:$port"

[[ -x $aenv ]] || { echo "up: $aenv is missing: run make venv first" >&2; exit 1; }
mkdir -p "$state_dir" "$log_dir"

# The pid in pidfile $1 if that process still runs and its command line contains $2.
running_pid() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$2" || return 1
  echo "$pid"
}

healthy() {
  curl -fsS --max-time 2 -o /dev/null "$url/health" 2>/dev/null
}

# The reason a running node gives on /health when it is unhealthy (503); empty otherwise.
unhealthy_reason() {
  curl -sS --max-time 2 "$url/health" 2>/dev/null |
    "$python" -c "import json,sys; d=json.load(sys.stdin); print(d.get('reason','') if d.get('status')=='unhealthy' else '')" \
    2>/dev/null || true
}

blockd_answers() {
  "$python" -c "from agentenv.blockd.client import BlockdClient as C; C('$blockd_socket', timeout=2).ping()" \
    2>/dev/null
}

blockd_pid() {
  "$python" -c "from agentenv.blockd.client import BlockdClient as C; print(C('$blockd_socket', timeout=2).ping()['pid'])"
}

report() {
  local key
  key=$(cat "$state_dir/secrets/api-key")
  cat <<MSG

agentenv node is up (pid $1, VM backend, template "base": Debian 12 with python3, git, curl)
  API URL:  $url   (OpenAPI document: $url/openapi.json)
  API key:  $key   (from $state_dir/secrets/api-key)
  logs:     $node_log, $blockd_log

For the E2B SDK (Python or TypeScript), export:
  export E2B_API_URL=$url
  export E2B_SANDBOX_URL=$url
  export E2B_VOLUME_API_URL=$url
  export E2B_API_KEY=$key
Sandbox ports: http://{port}-{sandbox id}.$domain (sandbox.get_host(port); see docs/e2b-api.md §5)

Stop it with: make down (running sandboxes are paused, not lost)
MSG
}

# The block daemon serves every sandbox disk; it outlives node restarts (and node crashes). It
# is started whatever the node's state: a running node whose blockd died gets it back here (the
# node's supervisor restarts it too, node/blockd_supervisor.py).
if bpid=$(running_pid "$blockd_pidfile" "$blockd_socket") && blockd_answers; then
  echo "blockd already running (pid $bpid)"
elif blockd_answers; then
  bpid=$(blockd_pid)
  echo "$bpid" >"$blockd_pidfile"
  echo "blockd already running (pid $bpid)"
else
  mkdir -p "$state_dir/blockd"
  setsid "$aenv" blockd --state-dir "$blockd_state" --socket "$blockd_socket" --no-fuse \
    >>"$blockd_log" 2>&1 </dev/null &
  bpid=$!
  echo "$bpid" >"$blockd_pidfile"
  for _ in $(seq 1 300); do
    blockd_answers && break
    kill -0 "$bpid" 2>/dev/null || break
    sleep 0.2
  done
  if ! blockd_answers; then
    echo "up: blockd did not start; the end of $blockd_log:" >&2
    tail -n 20 "$blockd_log" >&2
    exit 1
  fi
  # The one that answers (a node's supervisor may have started it meanwhile) is in the pidfile.
  bpid=$(blockd_pid)
  echo "$bpid" >"$blockd_pidfile"
  echo "blockd started (pid $bpid), socket $blockd_socket"
fi

if pid=$(running_pid "$node_pidfile" "aenv serve"); then
  # A running node notices a blockd started above within a second or two.
  for _ in $(seq 1 25); do
    healthy && break
    [[ -n $(unhealthy_reason) ]] || break  # no answer at all: the node is still starting
    sleep 0.2
  done
  if healthy; then
    echo "node already running (pid $pid), not starting another"
    report "$pid"
    exit 0
  fi
  if reason=$(unhealthy_reason) && [[ -n $reason ]]; then
    echo "up: the node (pid $pid) runs but is unhealthy: $reason" >&2
    echo "    see $node_log and $blockd_log" >&2
    exit 1
  fi
fi

# Guest assets (kernel, initramfs, tools disk) for the VM backend; only what changed is rebuilt.
echo "guest assets (kernel, initramfs, tools disk) in $assets_dir:"
"$aenv" guest build --state-dir "$assets_dir"

if pid=$(running_pid "$node_pidfile" "aenv serve"); then
  echo "node (pid $pid) is starting already; waiting for it"
else
  if healthy || (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; then
    echo "up: something else listens on $host:$port (no node pidfile at $node_pidfile)" >&2
    exit 1
  fi
  # Created here, not by the background redirection: the wait loop below reads it at once.
  touch "$node_log"
  # setsid: the node outlives this shell and make; AENV_API_KEY would override the state dir key.
  # AENV_BLOCKD_STATE_DIR/_LOG/_PIDFILE: how the node's supervisor starts this blockd again.
  env -u AENV_API_KEY AENV_BLOCKD_SOCKET="$blockd_socket" AENV_BLOCKD_STATE_DIR="$blockd_state" \
    AENV_BLOCKD_LOG="$blockd_log" AENV_BLOCKD_PIDFILE="$blockd_pidfile" AENV_VM_ASSETS_DIR="$assets_dir" \
    setsid "$aenv" serve --backend vm --state-dir "$state_dir" --host "$host" --port "$port" \
    --domain "$domain" >>"$node_log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$node_pidfile"
  echo "node starting (pid $pid), log $node_log"
fi

# Wait for /health; meanwhile show the base template's build steps from the node's log (the
# first start builds it: debootstrap, ext4 image, a boot under QEMU; later starts reuse it).
seen=$(wc -l <"$node_log")
began=$SECONDS
while ! healthy; do
  if ! kill -0 "$pid" 2>/dev/null; then
    rm -f "$node_pidfile"
    echo "up: the node exited during start; the end of $node_log:" >&2
    tail -n 20 "$node_log" >&2
    exit 1
  fi
  if (( SECONDS - began > up_timeout )); then
    echo "up: the node (pid $pid) did not answer $url/health within $up_timeout s; see $node_log" >&2
    exit 1
  fi
  total=$(wc -l <"$node_log")
  if (( total > seen )); then
    tail -n "+$((seen + 1))" "$node_log" | head -n "$((total - seen))" |
      sed -n 's/.*"msg": "\(base template[^"]*\|VM adopted\|guest assets ready\)".*/\1/p' |
      while read -r line; do printf '  [%4ds] %s\n' "$((SECONDS - began))" "$line"; done
    seen=$total
  fi
  sleep 0.3
done
report "$pid"
