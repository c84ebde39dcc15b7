#!/usr/bin/env bash
# Runs a command in a private network namespace with a private /run/netns (root only), so that
# test or bench runs of several checkouts on one host, or beside a running node, never share
# slot namespaces, veth addresses or nft tables. Nothing outside reaches in or out: anything
# that downloads (apt, debootstrap, npm) must have run once without it.
# Usage: scripts/isolated.sh CMD ARGS...
exec unshare --mount --net --propagation private -- bash -c '
  mkdir -p /run/netns && mount -t tmpfs -o mode=0755 tmpfs /run/netns &&
  ip link set lo up && exec "$@"' isolated "$@"
