#!/usr/bin/env bash
# `make cluster-up NODES=3`: a whole cluster on this host. Redis (AOF on; the ACL of
# redis-acl.sh, a user and a generated password per component), `aenv scheduler`,
# `aenv gateway` and NODES nodes, each node in a network namespace of its own (its own address
# on the bridge `aenvc-br`; its sandbox slots' namespaces named aenvcN-sK), with its own state
# directory and blockd, all sharing the host's guest assets. Prints the gateway URL and a team key.
#
# Settings (environment): AENV_CLUSTER_DIR (state of everything, default /var/lib/aenv-cluster),
# CLUSTER_BACKEND (vm, the product; or process for a quick look without VMs: no isolation
# between teams, so it sets AENV_ALLOW_PROCESS_BACKEND_IN_CLUSTER=1 for its nodes),
# AENV_VM_ASSETS_DIR (guest assets, default /var/lib/aenv: the single node's), AENV_VM_DEBIAN_CACHE
# (the base template's debootstrap tarball, default $AENV_VM_ASSETS_DIR/cache/debian),
# AENV_VM_TEMPLATE_CACHE (the built-in templates, built once and shared by the nodes, default
# $AENV_CLUSTER_DIR/template-cache), AENV_GATEWAY_PORT
# (8080), AENV_CLUSTER_NET (first three octets of the nodes' /24, default 10.213.0),
# AENV_CLUSTER_TEAM (the team the printed key belongs to, default "default").
# `make cluster-down` stops it all and removes the namespaces and the bridge.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
aenv="$root/.venv/bin/aenv"
nodes=${NODES:-3}
dir=${AENV_CLUSTER_DIR:-/var/lib/aenv-cluster}
backend=${CLUSTER_BACKEND:-vm}
assets=${AENV_VM_ASSETS_DIR:-/var/lib/aenv}
debian_cache=${AENV_VM_DEBIAN_CACHE:-$assets/cache/debian}
template_cache=${AENV_VM_TEMPLATE_CACHE:-$dir/template-cache}
gw_port=${AENV_GATEWAY_PORT:-8080}
net=${AENV_CLUSTER_NET:-10.213.0}
team=${AENV_CLUSTER_TEAM:-default}
strategy=${AENV_CLUSTER_STRATEGY:-cache-aware}  # the scheduler's placement (docs/control-plane.md §4)
bridge=aenvc-br
host_ip=$net.1
redis_port=${AENV_CLUSTER_REDIS_PORT:-6390}
redis_url="redis://127.0.0.1:$redis_port/0"
logs=$dir/logs

[[ -x $aenv ]] || { echo "cluster-up: $aenv is missing: run make venv first" >&2; exit 1; }
[[ $nodes =~ ^[0-9]+$ ]] && (( nodes >= 1 && nodes <= 200 )) ||
  { echo "cluster-up: NODES=$nodes is not a number from 1 to 200" >&2; exit 1; }
[[ $backend == vm || $backend == process ]] ||
  { echo "cluster-up: CLUSTER_BACKEND=$backend: use vm or process" >&2; exit 1; }
command -v redis-server >/dev/null ||
  { echo "cluster-up: redis-server is missing (make system installs it)" >&2; exit 1; }
mkdir -p "$dir" "$logs" "$dir/redis"
chmod 0711 "$dir"
chmod 0700 "$dir/redis"  # its AOF holds API key hashes and the envd tokens of idempotent creates

alive() { kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }

wait_for() {  # wait_for WHAT SECONDS CMD...: until CMD succeeds
  local what=$1 limit=$2; shift 2
  local began=$SECONDS
  until "$@" 2>/dev/null; do
    if (( SECONDS - began > limit )); then
      echo "cluster-up: $what did not come up within $limit s (logs in $logs)" >&2
      exit 1
    fi
    sleep 0.3
  done
}

new_secret() {  # new_secret FILE: 32 random bytes as hex, readable by root only (kept if there)
  [[ -s $1 ]] || (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$1")
}
# the cluster secret: only the scheduler and the gateway hold it. Each node is given a key of its
# own derived from it (`aenv node-key`): it serves only requests that carry that key (the
# gateway derives it) and calls the scheduler with a token made from it.
secret=$dir/cluster-secret
new_secret "$secret"

# Redis: the scheduler's bindings and node registry, the gateway's teams and ownership records.
# No access without a password: an ACL user per component (scripts/redis-acl.sh), passwords in
# files; the nodes never talk to Redis.
redis_gateway_pw=$dir/redis-gateway.password
redis_scheduler_pw=$dir/redis-scheduler.password
new_secret "$redis_gateway_pw"
new_secret "$redis_scheduler_pw"
(umask 077; bash "$root/scripts/redis-acl.sh" "$redis_gateway_pw" "$redis_scheduler_pw" \
  >"$dir/redis/users.acl")
redis_gateway=(--redis "$redis_url" --redis-user gateway --redis-password-file "$redis_gateway_pw")
redis_ping() {
  [[ $(REDISCLI_AUTH=$(cat "$redis_gateway_pw") redis-cli --no-auth-warning --user gateway \
    -p "$redis_port" ping) == PONG ]]
}
if ! alive "$dir/redis.pid"; then
  redis-server --bind 127.0.0.1 --port "$redis_port" --dir "$dir/redis" --appendonly yes \
    --appendfsync everysec --daemonize yes --pidfile "$dir/redis.pid" \
    --aclfile "$dir/redis/users.acl" --logfile "$logs/redis.log" >/dev/null
  wait_for redis 20 redis_ping
fi
echo "redis on 127.0.0.1:$redis_port (AOF in $dir/redis; users gateway, scheduler)"

# The nodes' network: a bridge on the host, a veth into each node's namespace
if ! ip link show "$bridge" >/dev/null 2>&1; then
  ip link add "$bridge" type bridge
  ip addr add "$host_ip/24" dev "$bridge"
fi
ip link set "$bridge" up
# The nodes reach the outside through the host (their sandboxes' egress, a template build's
# downloads): forwarding and a masquerade of the nodes' /24, in a table of the cluster's own.
sysctl -qw net.ipv4.ip_forward=1
nft -f - <<NFT
table ip aenvc
delete table ip aenvc
table ip aenvc {
  chain forward {
    type filter hook forward priority 0; policy accept;
    iifname "$bridge" accept
    oifname "$bridge" ct state established,related accept
  }
  chain postrouting {
    type nat hook postrouting priority 100; policy accept;
    ip saddr $net.0/24 oifname != "$bridge" masquerade
  }
}
NFT

if ! alive "$dir/scheduler.pid"; then
  setsid "$aenv" scheduler --listen "$host_ip:9090" --cluster-secret-file "$secret" \
    --redis "$redis_url" --redis-user scheduler --redis-password-file "$redis_scheduler_pw" \
    --strategy "$strategy" >>"$logs/scheduler.log" 2>&1 </dev/null &
  echo $! >"$dir/scheduler.pid"
  wait_for scheduler 60 bash -c "exec 3<>/dev/tcp/$host_ip/9090"
fi
echo "scheduler on $host_ip:9090"

if [[ $backend == vm ]]; then
  echo "guest assets (kernel, initramfs, tools disk) in $assets:"
  "$aenv" guest build --state-dir "$assets"
  # Every node builds its built-in templates (base, and code-interpreter-v1 unless
  # AENV_VM_CODE_INTERPRETER=0) from Debian roots: debootstrap them once here, into a cache
  # they all read. The nodes could not: each runs in a namespace without outside network.
  echo "Debian roots of the built-in templates (debootstrap on first use: 1-2 min each):"
  "$root/.venv/bin/python" -c 'import sys; from pathlib import Path
from agentenv.guest.build import debian_root_tarball
from agentenv.node.base_template import BASE, CODE_INTERPRETER
from agentenv.settings import get_settings
for spec in (BASE, CODE_INTERPRETER) if get_settings().vm_code_interpreter else (BASE,):
    print(" ", spec.name, debian_root_tarball(spec.packages, cache_dir=Path(sys.argv[1])))' \
    "$debian_cache"
fi

for ((i = 0; i < nodes; i++)); do
  ns=aenvc-node$i
  addr=$net.$((10 + i))
  state=$dir/node$i
  mkdir -p "$state"
  node_key=$state/node-key
  [[ -s $node_key ]] || (umask 077; "$aenv" node-key --node-id "node$i" \
    --cluster-secret-file "$secret" >"$node_key")
  if ! ip netns list | grep -qw "$ns"; then
    ip netns add "$ns"
    ip link add "aenvc-n$i" type veth peer name eth0 netns "$ns"
    ip link set "aenvc-n$i" master "$bridge" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    ip -n "$ns" route add default via "$host_ip"
  fi
  if [[ $backend == vm ]] && ! alive "$state/blockd.pid"; then
    setsid "$aenv" blockd --state-dir "$state/blockd/state" --socket "$state/blockd/blockd.sock" \
      --no-fuse >>"$logs/blockd$i.log" 2>&1 </dev/null &
    echo $! >"$state/blockd.pid"
  fi
  if ! alive "$state/node.pid"; then
    # In its network namespace (nsenter, not `ip netns exec`: that one also gives it a mount
    # namespace of its own, where blockd's memfs mount, made later on the host, never shows,
    # and whose slot namespaces a restarted node could not find to adopt its running VMs);
    # its slots' namespaces sit in the host's /run/netns under a prefix of its own (aenvcN-sK).
    # The gateway reaches it from $host_ip: a trusted proxy, so the node's per-client
    # connection bounds do not count every client of the gateway as one, and its clients'
    # addresses (X-Forwarded-For) reach the node's logs and the sandboxes
    env -u AENV_API_KEY AENV_BLOCKD_SOCKET="$state/blockd/blockd.sock" \
      AENV_TRUSTED_PROXIES="$host_ip" \
      AENV_BLOCKD_STATE_DIR="$state/blockd/state" AENV_BLOCKD_LOG="$logs/blockd$i.log" \
      AENV_BLOCKD_PIDFILE="$state/blockd.pid" AENV_VM_ASSETS_DIR="$assets" \
      AENV_VM_DEBIAN_CACHE="$debian_cache" AENV_VM_TEMPLATE_CACHE="$template_cache" \
      AENV_VM_NETWORK_PREFIX="aenvc$i" \
      AENV_ALLOW_PROCESS_BACKEND_IN_CLUSTER="$([[ $backend == process ]] && echo 1)" \
      setsid nsenter --net="/run/netns/$ns" -- \
      "$aenv" serve --backend "$backend" --state-dir "$state" --host "$addr" --port 8000 \
      --scheduler "$host_ip:9090" --node-id "node$i" --advertise "$addr:8000" \
      --node-key-file "$node_key" >>"$logs/node$i.log" 2>&1 </dev/null &
    echo $! >"$state/node.pid"
    echo "node$i starting on $addr:8000 (namespace $ns, state $state)"
  fi
done

if ! alive "$dir/gateway.pid"; then
  setsid "$aenv" gateway --host 127.0.0.1 --port "$gw_port" --scheduler "$host_ip:9090" \
    "${redis_gateway[@]}" --cluster-secret-file "$secret" --domain "localhost:$gw_port" \
    >>"$logs/gateway.log" 2>&1 </dev/null &
  echo $! >"$dir/gateway.pid"
  wait_for gateway 60 curl -fsS --max-time 2 -o /dev/null "http://127.0.0.1:$gw_port/health"
fi

"$aenv" team "${redis_gateway[@]}" create "$team" >/dev/null 2>&1 || true
key=$("$aenv" team "${redis_gateway[@]}" key "$team")

echo "waiting for the nodes (a VM node's first start builds its base template: minutes)"
nodes_up() {
  local up i
  for ((i = 0; i < nodes; i++)); do  # a node that died will not come: say so at once
    if ! alive "$dir/node$i/node.pid"; then
      echo "cluster-up: node$i exited; the end of $logs/node$i.log:" >&2
      tail -n 5 "$logs/node$i.log" | cut -c1-800 >&2
      exit 1
    fi
  done
  up=$(curl -fsS --max-time 5 -H "X-API-KEY: $key" "http://127.0.0.1:$gw_port/nodes" |
    "$root/.venv/bin/python" -c \
      "import json,sys; print(sum(n.get('status')=='ready' for n in json.load(sys.stdin)))")
  (( up >= nodes ))
}
wait_for "the nodes" "${AENV_UP_TIMEOUT:-1800}" nodes_up

cat <<MSG

agentenv cluster is up: $nodes $backend node(s), scheduler, gateway, redis (state in $dir)
  gateway:  http://127.0.0.1:$gw_port
  redis:    127.0.0.1:$redis_port, users gateway and scheduler (passwords in $dir/redis-*.password)
  team key: $key   (team "$team"; more: aenv team ${redis_gateway[*]} ...)
  logs:     $logs

For the E2B SDK, export:
  export E2B_API_URL=http://127.0.0.1:$gw_port
  export E2B_SANDBOX_URL=http://127.0.0.1:$gw_port
  export E2B_API_KEY=$key

Stop it with: make cluster-down
MSG
