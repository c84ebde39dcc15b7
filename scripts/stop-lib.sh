# Sourced by down.sh and cluster-down.sh: the one way to stop a process from its pid file.
# stop PIDFILE NEEDLE NAME: SIGTERM the process (only if its command line contains NEEDLE, so a
# recycled pid is never hit), wait up to $timeout s, then SIGKILL. Needs $timeout and $me.
stop() {
  local pid
  pid=$(cat "$1" 2>/dev/null || true)
  if [[ ! $pid =~ ^[0-9]+$ ]] || ! tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -- "$2"
  then
    rm -f "$1"
    echo "$3 not running"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  local waited=0
  # A zombie's (or a gone process's) command line reads empty.
  while [[ -n $(tr -d '\0' 2>/dev/null <"/proc/$pid/cmdline") ]]; do
    if (( waited >= timeout * 5 )); then
      echo "$me: $3 (pid $pid) still running after $timeout s, killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.2
    waited=$((waited + 1))
  done
  rm -f "$1"
  echo "$3 stopped (pid $pid)"
}
