#!/usr/bin/env bash
# `make down`: stops what `make up` started. SIGTERM lets the node pause every running sandbox
# (they resume after the next `make up`) and close its database; it gets AENV_DOWN_TIMEOUT
# seconds (default 300) before SIGKILL, which loses nothing either: the next start adopts the
# VMs that still run. Then the block daemon stops. Idempotent.
set -euo pipefail
state_dir=${AENV_HOME:-${AENV_STATE_DIR:-/var/lib/aenv}}
timeout=${AENV_DOWN_TIMEOUT:-300}

me=down
# shellcheck source=scripts/stop-lib.sh
source "$(dirname "$0")/stop-lib.sh"

stop "$state_dir/node.pid" "aenv serve" "node"
stop "$state_dir/blockd.pid" "$state_dir/blockd/blockd.sock" "blockd"
