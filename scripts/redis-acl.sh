#!/usr/bin/env bash
# redis-acl.sh GATEWAY_PASSWORD_FILE SCHEDULER_PASSWORD_FILE [SCHEDULER_PREFIX]
# Prints the ACL file of a cluster's Redis (redis-server --aclfile FILE): the `default` user is
# off, so a connection without a password can do nothing; `gateway` (and `aenv team`) reaches
# its own keys under aenv: (teams, API keys, ownership, names, idempotency records, quotas,
# events and webhooks) and
# not the scheduler's; `scheduler` only its own, under SCHEDULER_PREFIX (default aenv:sched:). Neither may run the dangerous commands
# (CONFIG, KEYS, FLUSHALL, DEBUG, ACL, ...). The file holds the passwords' SHA-256 only.
# Used by scripts/cluster-up.sh and deploy/kubernetes/redis.yaml.
set -euo pipefail
if (( $# < 2 || $# > 3 )); then
  echo "usage: $0 GATEWAY_PASSWORD_FILE SCHEDULER_PASSWORD_FILE [SCHEDULER_PREFIX]" >&2
  exit 2
fi
prefix=${3:-aenv:sched:}
[[ $prefix =~ ^[A-Za-z0-9:._-]+$ ]] ||
  { echo "redis-acl: prefix $prefix: letters, digits and :._- only" >&2; exit 2; }
digest() {  # the password as the components read it (surrounding white space dropped)
  local password
  password=$(tr -d ' \t\r\n' <"$1") || exit 1
  [[ -n $password ]] || { echo "redis-acl: $1 is empty" >&2; exit 1; }
  printf %s "$password" | sha256sum | cut -d' ' -f1
}
gateway=$(digest "$1")
scheduler=$(digest "$2")
echo "user default off resetkeys resetchannels -@all"
# The gateway's own key families (control/gateway/store.py, limits.py), named one by one: a
# pattern of all of aenv:* would also open the scheduler's bindings and node addresses to it.
gateway_keys="~aenv:teams ~aenv:team:* ~aenv:apikey:* ~aenv:own:* ~aenv:name:* ~aenv:idem:*"
gateway_keys+=" ~aenv:idem-node:* ~aenv:buildnodes:* ~aenv:volumehome:* ~aenv:quota:* ~aenv:events:*"
gateway_keys+=" ~aenv:spill:*"
# One channel: the gateways wake each other's webhook workers when events arrive
# (control/gateway/events.py WAKE_CHANNEL)
echo "user gateway on #$gateway $gateway_keys resetchannels &aenv:events:wake +@all -@dangerous"
echo "user scheduler on #$scheduler ~$prefix* resetchannels +@all -@dangerous"
