#!/usr/bin/env bash
# A multi-node Ray cluster on one machine: a head and N worker nodes, each its own `ray start`
# with its own --num-cpus/--resources, ports and temp dir, all under one state dir. `stop` ends only the
# processes this script started (never `ray stop`, which kills every Ray cluster on the machine).
#
#   cluster/local.sh start 2      # head + 2 workers; prints the dashboard (job API) address
#   cluster/local.sh status
#   cluster/local.sh stop
#
# Settings (environment):
#   RAYPACK_LOCAL_DIR   state dir: pids, logs, and each node's Ray temp dir t0 (head), t1, ...
#                       (default /tmp/rp-$UID). Keep it short: Ray's unix socket paths live
#                       under it and are limited to 107 bytes.
#   RAYPACK_LOCAL_PORT  head GCS port (default 6390); every other port is derived from it.
#   RAYPACK_DASH_PORT   dashboard / job API port (default 8270), bound to 127.0.0.1 only.
#   RAYPACK_NODE_CPUS   logical CPUs per node (default 4). More than the cores is fine and avoids
#                       Ray Data read tasks starving behind trainer workers on small hosts.
#   RAY                 the `ray` executable (default: the one next to this venv's python, else
#                       PATH). Workers run the Python that started the node, so use the venv's.
#   RAY_JOB_STOP_WAIT_TIME_S  how long `ray job stop` waits after its SIGTERM before SIGKILL (default
#                       40; Ray's own is 3 s): a raypack job stops after its step with a
#                       checkpoint within train.stop_grace_s (25 s), then exits.
# Token auth: RAY_AUTH_MODE=token is set unless you set it; the token comes from RAY_AUTH_TOKEN,
# RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, and is generated there (`ray get-auth-token
# --generate`) if none exists. Clients (`ray job submit`) need the same RAY_AUTH_MODE and token.
set -euo pipefail

DIR=${RAYPACK_LOCAL_DIR:-/tmp/rp-$(id -u)}
PORT=${RAYPACK_LOCAL_PORT:-6390}
DASH=${RAYPACK_DASH_PORT:-8270}
CPUS=${RAYPACK_NODE_CPUS:-4}
HERE=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z "${RAY:-}" ]]; then
  if [[ -x "$HERE/.venv/bin/ray" ]]; then RAY="$HERE/.venv/bin/ray"; else RAY=ray; fi
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
export RAY_JOB_STOP_WAIT_TIME_S=${RAY_JOB_STOP_WAIT_TIME_S:-40}  # read by the head's job supervisor
# A job's entrypoint `python ...` runs with the head's PATH: put this Ray's venv first, so that
# jobs (and every worker) get the interpreter that has raypack's dependencies.
PATH="$(dirname "$(command -v "$RAY")"):$PATH"
export PATH

# Ports of node i (0 = head), in a block of 20 above the GCS port; worker processes get a range
# of their own so that nodes never race for a port.
node_ports() {
  local i=$1 b=$((PORT + 20 + 20 * $1)) w=$((PORT + 1000 + 200 * $1))
  echo "--node-manager-port=$b --object-manager-port=$((b + 1)) --metrics-export-port=$((b + 2))" \
       "--dashboard-agent-listen-port=$((b + 3)) --dashboard-agent-grpc-port=$((b + 4))" \
       "--runtime-env-agent-port=$((b + 5)) --min-worker-port=$w --max-worker-port=$((w + 199))"
}

ensure_token() {
  [[ "$RAY_AUTH_MODE" == token ]] || return 0
  [[ -n "${RAY_AUTH_TOKEN:-}" || -n "${RAY_AUTH_TOKEN_PATH:-}" || -s "$HOME/.ray/auth_token" ]] && return 0
  "$RAY" get-auth-token --generate >/dev/null
}

start_node() {  # start_node <index> <log> <args...>: a blocking `ray start` in its own session
  local i=$1 log=$2; shift 2
  # --block keeps `ray start` as the parent of the node's processes; SIGTERM to it tears them down.
  # 127.0.0.1 everywhere: nodes find each other without guessing the host's outside address.
  # Each node gets its own temp dir: nodes sharing one would share runtime_resources/, and one
  # node's runtime-env GC would delete a job's working dir under the other's feet.
  setsid "$RAY" start --block --temp-dir="$DIR/t$i" --node-ip-address=127.0.0.1 \
    --num-cpus="$CPUS" --disable-usage-stats \
    $(node_ports "$i") "$@" >"$log" 2>&1 </dev/null &
  echo $! >>"$DIR/pids"
}

wait_nodes() {  # until the cluster reports N nodes alive; fail as soon as a node's `ray start` dies
  local want=$1 pid
  for _ in $(seq 1 90); do
    for pid in $(cat "$DIR/pids"); do
      if ! kill -0 "$pid" 2>/dev/null; then
        echo "local.sh: a node failed to start; see the logs in $DIR" >&2; cmd_stop >&2; return 1
      fi
    done
    if [[ $("$RAY" status --address="127.0.0.1:$PORT" 2>/dev/null | grep -c ' node_') -ge $want ]]; then
      return 0
    fi
    sleep 2
  done
  echo "local.sh: cluster did not reach $want nodes; logs in $DIR" >&2
  cmd_stop >&2
  return 1
}

cmd_start() {
  local n=${1:-1}
  if [[ -s "$DIR/pids" ]]; then echo "local.sh: already started ($DIR/pids); stop it first" >&2; exit 1; fi
  mkdir -p "$DIR"
  ensure_token
  # The dashboard binds to 127.0.0.1: reach it from elsewhere through an SSH tunnel only.
  start_node 0 "$DIR/head.log" --head --port="$PORT" --dashboard-host=127.0.0.1 \
    --dashboard-port="$DASH" --resources='{"head": 1}'
  wait_nodes 1
  for i in $(seq 1 "$n"); do
    start_node "$i" "$DIR/worker$i.log" --address="127.0.0.1:$PORT" --resources="{\"worker$i\": 1}"
  done
  wait_nodes $((n + 1))
  echo "RAY_ADDRESS=http://127.0.0.1:$DASH   (GCS 127.0.0.1:$PORT, $((n + 1)) nodes, logs in $DIR)"
}

# Every process whose command line names our temp dir (raylet, gcs, workers, agents): ours only.
our_pids() {
  local p
  for p in /proc/[0-9]*; do
    if tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -qF -- "$DIR/t"; then echo "${p#/proc/}"; fi
  done
}

cmd_stop() {
  local pid
  if [[ -s "$DIR/pids" ]]; then
    # Workers first, then the head (first line).
    for pid in $(tac "$DIR/pids"); do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 1 15); do
      local alive=0
      for pid in $(cat "$DIR/pids"); do kill -0 "$pid" 2>/dev/null && alive=1; done
      [[ $alive == 0 ]] && break
      sleep 1
    done
  fi
  # What did not go on SIGTERM (a node stuck joining, orphaned workers) is killed by pid.
  for pid in $(cat "$DIR/pids" 2>/dev/null) $(our_pids); do
    [[ $pid != $$ ]] && kill -KILL "$pid" 2>/dev/null || true
  done
  rm -f "$DIR/pids"
  echo "local.sh: stopped the cluster under $DIR"
}

cmd_status() {
  if [[ ! -s "$DIR/pids" ]]; then echo "local.sh: not started (no $DIR/pids)"; return 1; fi
  "$RAY" status --address="127.0.0.1:$PORT"
  echo "job API: http://127.0.0.1:$DASH"
}

case "${1:-}" in
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 start [N_WORKERS] | status | stop" >&2; exit 2 ;;
esac
