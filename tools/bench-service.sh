#!/usr/bin/env bash
# Benchmarks `tollgate serve` with tollgate-load, over Envoy's gRPC API and /v1/check.
#
# Builds release binaries, writes a temporary rule file (domain `bench`, key `user`, a
# limit so high every request is admitted), starts the server on free loopback ports,
# waits for GET /readyz to answer 200, then for each API:
#   1. closed loop, concurrency 64, 10 s, 10,000 keys, with the server's CPU time
#      (--server-pid): the maximum throughput;
#   2. open loop at half that rate for 10 s, the load tool on one thread
#      (OPEN_THREADS): the p99 latency at half load, and how
#      long per second the server's threads ran and waited in the run queue for a CPU
#      (/proc/PID/task/*/schedstat; the wait is time the two cores were taken), and
#      the load tool's own CPU per request (the other half of the pair).
# Prints a table and stops the server on exit. Needs bash, cargo and curl.
#
# The load generator runs on the same machine as the server and competes with it for
# CPU, so the maximum is that of the pair; other load on the machine distorts it too.
#
# gRPC goes over CONNECTIONS HTTP/2 connections (default 2: one per server worker, as
# an Envoy with two worker threads opens one connection per worker to its rate limit
# service and multiplexes its calls on it). The server's CPU per call depends on how
# many calls arrive per read, so the figure for CONNECTIONS=4 is higher.
#
# Usage: tools/bench-service.sh
# Environment (optional): DURATION (10s), CONCURRENCY (64), KEYS (10000), CONNECTIONS (2),
#   GRPC_TRANSPORT (native or tonic: the server's), LOAD_TRANSPORT (native or tonic:
#   tollgate-load's gRPC client),
#   OPEN_THREADS (1: tollgate-load's threads in the open loop; one thread hands no
#   wake-up between threads and leaves the server more of the two cores),
#   CARGO_TARGET_DIR (where cargo builds; default: <repo>/target).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
duration="${DURATION:-10s}"
concurrency="${CONCURRENCY:-64}"
keys="${KEYS:-10000}"
connections="${CONNECTIONS:-2}"
grpc_transport="${GRPC_TRANSPORT:-native}" # tollgate serve --grpc-transport
load_transport="${LOAD_TRANSPORT:-native}" # tollgate-load grpc --transport
open_threads="${OPEN_THREADS:-1}"           # tollgate-load --threads, open loop
bin="${CARGO_TARGET_DIR:-$root/target}/release"

bench_name=bench-service
# shellcheck source=tools/lib.sh
source "$root/tools/lib.sh"

command -v curl >/dev/null || die "curl is required"

log "building release binaries..."
(cd "$root" && cargo build --release -p tollgate-server -p tollgate-load)
[[ -x "$bin/tollgate" && -x "$bin/tollgate-load" ]] ||
  die "binaries not found in $bin (set CARGO_TARGET_DIR if cargo builds elsewhere)"

work="$(mktemp -d)"
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mkdir "$work/rules"
cat >"$work/rules/bench.yaml" <<'EOF'
domain: bench
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1000000000}
EOF

grpc_port="$(free_port)"
http_port="$(free_port)"
while [[ "$http_port" == "$grpc_port" ]]; do http_port="$(free_port)"; done

log "starting tollgate serve (gRPC 127.0.0.1:$grpc_port, HTTP 127.0.0.1:$http_port)..."
TOLLGATE_LOG=warn "$bin/tollgate" serve --config "$work/rules" \
  --grpc-listen "127.0.0.1:$grpc_port" --http-listen "127.0.0.1:$http_port" \
  --grpc-transport "$grpc_transport" >"$work/server.log" 2>&1 &
server_pid=$!

ready=""
for _ in $(seq 1 300); do # up to 30 s
  if ! kill -0 "$server_pid" 2>/dev/null; then
    cat "$work/server.log" >&2
    die "tollgate serve exited before becoming ready"
  fi
  code="$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$http_port/readyz" || true)"
  if [[ "$code" == "200" ]]; then ready=1; break; fi
  sleep 0.1
done
if [[ -z "$ready" ]]; then
  cat "$work/server.log" >&2
  die "tollgate serve did not answer 200 on /readyz within 30 s"
fi

# Runs tollgate-load in MODE with extra flags, prints its JSON report on stdout.
load() {
  local mode="$1"; shift
  local target
  case "$mode" in
    grpc) target=(--addr "127.0.0.1:$grpc_port" --transport "$load_transport"
                  --connections "$connections") ;;
    check) target=(--url "http://127.0.0.1:$http_port/v1/check") ;;
  esac
  "$bin/tollgate-load" "$mode" "${target[@]}" --keys "$keys" \
    --concurrency "$concurrency" --duration "$duration" --json --quiet "$@"
}

# Warns on stderr if a report shows errors.
check_errors() {
  local errors
  errors="$(field "$2" errors)"
  if [[ "$errors" != "0" ]]; then
    log "warning: $1 had $errors errors (first: $(field "$2" first_error))"
  fi
}

rows=()
for mode in grpc check; do
  log "$mode: closed loop, concurrency $concurrency, $duration, $keys keys..."
  max="$(load "$mode" --server-pid "$server_pid")"
  log "  $max"
  check_errors "$mode closed loop" "$max"
  rps="$(field "$max" rps)"
  cpu="$(field "$max" server_cpu_us_per_request)"

  half="$(awk -v r="$rps" 'BEGIN { printf "%.0f", r / 2 }')"
  [[ "$half" -gt 0 ]] || die "$mode: no throughput measured"
  log "$mode: open loop at $half req/s, $duration..."
  read -r run0 wait0 <<<"$(sched_ns "$server_pid")"; t0="$(now_ns)"; read -r s0 j0 <<<"$(steal_jiffies)"
  open="$(load "$mode" --rate "$half" --threads "$open_threads")"
  read -r run1 wait1 <<<"$(sched_ns "$server_pid")"; t1="$(now_ns)"; read -r s1 j1 <<<"$(steal_jiffies)"
  log "  $open"
  check_errors "$mode open loop" "$open"
  p99="$(field "$open" p99)"
  sched="$(per_second "$run0" "$wait0" "$t0" "$run1" "$wait1" "$t1")"
  steal="$(stolen "$s0" "$j0" "$s1" "$j1")"

  load_cpu="$(field "$open" load_cpu_us_per_request)"

  rows+=("$(printf '%-6s %10.0f %18s %18s %24s %20s %8s' "$mode" "$rps" "$cpu" "$p99" "$sched" \
    "$load_cpu" "$steal")")
done

printf '\n%-6s %10s %18s %18s %24s %20s %8s\n' "mode" "max req/s" "server CPU us/req" \
  "p99 us @ half max" "server ran/waited ms/s" "load us/req @ half" "stolen"
printf '%s\n' "${rows[@]}"
