#!/usr/bin/env bash
# Same-run comparison of `tollgate serve` and limitador-server 2.4.0 (../shared/peers),
# both in memory, over Envoy's rate limit gRPC API, with a client neither project wrote:
# nghttp2's h2load, closed loop, CONNECTIONS connections × STREAMS streams each, CALLS
# calls per run (h2load's own CPU per call is reported too: on two cores the client
# can be what limits the faster server). Every call is the same ShouldRateLimit (domain `bench`, descriptor
# `k=v`) under a limit too high to reach, so both servers count one counter and answer
# OK. The servers take turns, ROUNDS times (tollgate's transports, then limitador);
# each run reports calls/s (h2load's) and the server's CPU per call (its threads' run
# time from /proc/PID/task/*/schedstat over the run, divided by the calls) and the
# share of the machine's CPU time the hypervisor took meanwhile (steal). Prints
# every run and the medians, and the ratios of tollgate's medians to limitador's.
#
# The load client runs on the same 2 cores as the server: the figures are those of
# the pair. Each server runs with its defaults (tollgate: one worker per core;
# limitador: its own runtime).
#
# Usage: tools/bench-vs-limitador.sh
# Environment (optional): CALLS (300000), ROUNDS (3), CONNECTIONS (4), STREAMS (16),
#   THREADS (1: h2load's threads),
#   TRANSPORTS ("native tonic": tollgate's gRPC transports to run), TOLLGATE_ARGS (more
#   flags for `tollgate serve`, e.g. "--workers 1"),
#   LIMITADOR (../shared/peers/limitador-server), CARGO_TARGET_DIR.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
calls="${CALLS:-300000}"
rounds="${ROUNDS:-3}"
connections="${CONNECTIONS:-4}"
streams="${STREAMS:-16}"
threads="${THREADS:-1}" # h2load's threads
transports="${TRANSPORTS:-native tonic}"
tollgate_args="${TOLLGATE_ARGS:-}" # more flags for tollgate serve, e.g. "--workers 1"
limitador="${LIMITADOR:-$root/../shared/peers/limitador-server}"
bin="${CARGO_TARGET_DIR:-$root/target}/release"

bench_name=bench-vs-limitador
# shellcheck source=tools/lib.sh
source "$root/tools/lib.sh"

command -v h2load >/dev/null && command -v nghttp >/dev/null ||
  die "h2load and nghttp are required (Debian: nghttp2-client)"
command -v curl >/dev/null || die "curl is required"
[[ -x "$limitador" ]] || die "limitador-server not found at $limitador (set LIMITADOR)"

log "building tollgate (release)..."
(cd "$root" && cargo build --release -q -p tollgate-server)

work="$(mktemp -d)"
server_pid=""
stop_server() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  server_pid=""
}
trap 'stop_server; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

mkdir "$work/rules"
cat >"$work/rules/bench.yaml" <<'EOF'
domain: bench
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 1000000000}
EOF
cat >"$work/limits.yaml" <<'EOF'
- namespace: bench
  max_value: 1000000000000
  seconds: 60
  conditions: []
  variables: ["descriptors[0].k"]
EOF
# The call: a gRPC frame (uncompressed, 4-byte length) holding RateLimitRequest
# {domain: "bench", descriptors: [{entries: [{key: "k", value: "v"}]}], hits_addend: 1}.
printf '\x00\x00\x00\x00\x13\x0a\x05bench\x12\x08\x0a\x06\x0a\x01k\x12\x01v\x18\x01' >"$work/call.bin"
path=/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit

wait_ready() { # URL
  for _ in $(seq 1 100); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  die "the server did not become ready ($1)"
}

start() { # tollgate-native | tollgate-tonic | limitador; sets server_pid, grpc_port
  grpc_port="$(free_port)"
  local http_port
  http_port="$(free_port)"
  while [[ "$http_port" == "$grpc_port" ]]; do http_port="$(free_port)"; done
  case "$1" in
  tollgate-*)
    TOLLGATE_LOG=warn "$bin/tollgate" serve --config "$work/rules" \
      --grpc-transport "${1#tollgate-}" \
      --grpc-listen "127.0.0.1:$grpc_port" --http-listen "127.0.0.1:$http_port" \
      $tollgate_args >"$work/server.log" 2>&1 &
    server_pid=$!
    wait_ready "http://127.0.0.1:$http_port/readyz"
    ;;
  limitador)
    RUST_LOG=error "$limitador" -b 127.0.0.1 -p "$grpc_port" -B 127.0.0.1 -P "$http_port" \
      "$work/limits.yaml" memory --cache 100000 >"$work/server.log" 2>&1 &
    server_pid=$!
    wait_ready "http://127.0.0.1:$http_port/status"
    ;;
  esac
}

# One run against a started server: "calls/s server_us_per_call client_us_per_call
# steal%"; checks that every call
# got a response.
run() {
  local cpu0 cpu1 out rps done_
  # A short warm-up (connections, first allocations), not counted.
  h2load -n 2000 -c "$connections" -m "$streams" -d "$work/call.bin" \
    -H 'content-type: application/grpc' -H 'te: trailers' \
    "http://127.0.0.1:$grpc_port$path" >/dev/null
  cpu0="$(cpu_ns "$server_pid")"
  read -r s0 t0 < <(steal_jiffies)
  out="$(/usr/bin/time -f 'client-cpu %U %S' -o "$work/client.time" \
    h2load -n "$calls" -c "$connections" -m "$streams" -t "$threads" -d "$work/call.bin" \
    -H 'content-type: application/grpc' -H 'te: trailers' \
    "http://127.0.0.1:$grpc_port$path")"
  cpu1="$(cpu_ns "$server_pid")"
  read -r s1 t1 < <(steal_jiffies)
  rps="$(sed -nE 's/^finished in .*, ([0-9.]+) req\/s.*/\1/p' <<<"$out")"
  done_="$(sed -nE 's/^requests: .* ([0-9]+) succeeded.*/\1/p' <<<"$out")"
  [[ "$done_" == "$calls" ]] || die "only $done_ of $calls calls succeeded: $out"
  read -r _ cu cs <"$work/client.time"
  awk -v r="$rps" -v c0="$cpu0" -v c1="$cpu1" -v n="$calls" -v cu="$cu" -v cs="$cs" \
    'BEGIN { printf "%.0f %.2f %.2f ", r, (c1 - c0) / 1e3 / n, (cu + cs) * 1e6 / n }'
  stolen "$s0" "$t0" "$s1" "$t1" | tr -d ' '
  echo
}

# The answer to one call (nghttp, which shows the trailers): grpc-status must be 0.
check_ok() {
  nghttp -v -d "$work/call.bin" -H 'content-type: application/grpc' -H 'te: trailers' \
    "http://127.0.0.1:$grpc_port$path" 2>&1 | grep -aq 'grpc-status: 0' ||
    die "$1 does not answer OK to the benchmark's call"
}

servers=()
for t in $transports; do servers+=("tollgate-$t"); done
servers+=(limitador)
declare -A results
printf '%-17s %5s %12s %14s %14s %8s\n' server round "calls/s" "CPU µs/call" "h2load µs/call" stolen >&2
for round in $(seq 1 "$rounds"); do
  for s in "${servers[@]}"; do
    start "$s"
    check_ok "$s"
    read -r rps cpu client steal < <(run)
    stop_server
    results[$s]+="$rps $cpu;"
    printf '%-17s %5d %12s %14s %14s %8s\n' "$s" "$round" "$rps" "$cpu" "$client" "$steal" >&2
  done
done

median() { sort -n | awk '{ v[NR] = $1 } END { print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
echo
printf '%-17s %12s %14s %16s %18s\n' server "calls/s" "CPU µs/call" "× limitador c/s" "× limitador CPU"
lim_rps="$(tr ';' '\n' <<<"${results[limitador]}" | awk 'NF { print $1 }' | median)"
lim_cpu="$(tr ';' '\n' <<<"${results[limitador]}" | awk 'NF { print $2 }' | median)"
for s in "${servers[@]}"; do
  rps="$(tr ';' '\n' <<<"${results[$s]}" | awk 'NF { print $1 }' | median)"
  cpu="$(tr ';' '\n' <<<"${results[$s]}" | awk 'NF { print $2 }' | median)"
  awk -v s="$s" -v r="$rps" -v c="$cpu" -v lr="$lim_rps" -v lc="$lim_cpu" \
    'BEGIN { printf "%-17s %12.0f %14.2f %16.2f %18.2f\n", s, r, c, r / lr, c / lc }'
done
