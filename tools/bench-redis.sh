#!/usr/bin/env bash
# Benchmarks `tollgate serve --store redis://...` against its ceiling on this machine:
# Redis running the very script call tollgate makes (FCALL on Redis 7, same arguments, same
# concurrency, 10,000 keys) in the same session.
#
# Starts its own redis-server on a free port (no persistence), then:
#   1. tollgate serve on that Redis; tollgate-load over gRPC, closed loop, concurrency
#      64, DURATION, 10,000 keys: max decisions/s, the server's CPU per decision
#      (--server-pid) and Redis's CPU per decision (/proc/PID/task/*/schedstat);
#   2. open loop at half that rate, the load tool on one thread (OPEN_THREADS): p99; the same rate against tollgate serve on the
#      in-memory store gives the p99 that Redis adds; and how long per second tollgate's
#      and Redis's threads ran and waited in the run queue for a CPU on the Redis run;
#   3. the ceiling: the same FCALL over 64 connections, one call in flight each
#      (tollgate-load redis: redis-benchmark cannot send the script's binary argument),
#      and Redis's CPU per call; redis-benchmark SET as this machine's yardstick;
#   4. one hammered key over its limit, blocked-key cache on: Redis calls (INFO
#      commandstats) per rejected request.
# Needs redis-server, redis-cli, redis-benchmark (redis-server, redis-tools), curl.
#
# Usage: tools/bench-redis.sh      Environment: DURATION (10s), CONCURRENCY (64),
#   OPEN_THREADS (1: tollgate-load's threads in the open loop), REDIS_FLAGS (extra flags
#   of the tollgate serve on Redis, e.g. --redis-shared-connection)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
duration="${DURATION:-10s}"
concurrency="${CONCURRENCY:-64}"
open_threads="${OPEN_THREADS:-1}"
read -r -a redis_flags <<<"${REDIS_FLAGS:-}"
keys=10000
bin="${CARGO_TARGET_DIR:-$root/target}/release"

bench_name=bench-redis
# shellcheck source=tools/lib.sh
source "$root/tools/lib.sh"
for tool in redis-server redis-cli redis-benchmark curl; do
  command -v "$tool" >/dev/null || die "$tool is required (apt-get install redis-server redis-tools curl)"
done

log "building release binaries..."
(cd "$root" && cargo build --release -p tollgate-server -p tollgate-load)

work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM


redis_port="$(free_port)"
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
  --loglevel warning --dir "$work" >"$work/redis.log" 2>&1 &
redis_pid=$!
pids+=("$redis_pid")
for _ in $(seq 1 100); do redis-cli -p "$redis_port" PING >/dev/null 2>&1 && break; sleep 0.05; done

mkdir "$work/rules"
cat >"$work/rules/bench.yaml" <<'YAML'
domain: bench
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1000000000}
YAML
cat >"$work/rules/hammer.yaml" <<'YAML'
domain: hammer
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 10}
YAML

# Starts tollgate serve with extra flags; prints "pid grpc_port http_port". Tries new
# ports if the server exits (a port taken between free_port and its bind).
serve() {
  local grpc http pid code
  for _ in 1 2 3; do
    grpc="$(free_port)"; http="$(free_port)"
    [[ "$grpc" != "$http" ]] || continue
    TOLLGATE_LOG=warn "$bin/tollgate" serve --config "$work/rules" \
      --grpc-listen "127.0.0.1:$grpc" --http-listen "127.0.0.1:$http" "$@" \
      >>"$work/server.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do
      kill -0 "$pid" 2>/dev/null || break
      code="$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$http/readyz" || true)"
      [[ "$code" == "200" ]] && { echo "$pid $grpc $http"; return 0; }
      sleep 0.1
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  cat "$work/server.log" >&2
  log "tollgate serve did not become ready"
  return 1
}

# Script calls Redis has run: FCALL (the store's default on Redis 7) and EVALSHA.
script_calls() {
  redis-cli -p "$redis_port" INFO commandstats | tr -d '\r' |
    sed -nE 's/^cmdstat_(fcall|evalsha):calls=([0-9]+),.*/\2/p' | awk '{ s += $1 } END { print s + 0 }'
}

# (`die` inside the command substitution would end only its subshell.)
started="$(serve --store "redis://127.0.0.1:$redis_port" "${redis_flags[@]}")" || die "cannot start tollgate serve on Redis"
read -r redis_tg grpc_r _ <<<"$started"
pids+=("$redis_tg")
started="$(serve)" || die "cannot start tollgate serve in memory"
read -r memory_tg grpc_m _ <<<"$started"
pids+=("$memory_tg")

load() { "$bin/tollgate-load" grpc --addr "127.0.0.1:$1" --concurrency "$concurrency" --json --quiet "${@:2}"; }

log "1. tollgate serve on Redis: closed loop, concurrency $concurrency, $duration..."
r0="$(cpu_ns "$redis_pid")"
max="$(load "$grpc_r" --keys "$keys" --duration "$duration" --server-pid "$redis_tg")"
r1="$(cpu_ns "$redis_pid")"
log "   $max"
rps="$(field "$max" rps)"
decisions="$(( $(field "$max" ok) + $(field "$max" over_limit) ))"
tg_cpu="$(field "$max" server_cpu_us_per_request)"
redis_cpu_tg="$(awk -v a="$r0" -v b="$r1" -v n="$decisions" 'BEGIN { printf "%.1f", (b - a) / 1000 / n }')"
[[ "$(field "$max" errors)" == "0" ]] || log "   warning: errors: $(field "$max" first_error)"

half="$(awk -v r="$rps" 'BEGIN { printf "%.0f", r / 2 }')"
log "2. open loop at $half/s: on Redis, then on the in-memory store..."
read -r tr0 tw0 <<<"$(sched_ns "$redis_tg")"; read -r rr0 rw0 <<<"$(sched_ns "$redis_pid")"; t0="$(now_ns)"
read -r s0 j0 <<<"$(steal_jiffies)"
open_r="$(load "$grpc_r" --keys "$keys" --duration "$duration" --rate "$half" --threads "$open_threads")"
read -r tr1 tw1 <<<"$(sched_ns "$redis_tg")"; read -r rr1 rw1 <<<"$(sched_ns "$redis_pid")"; t1="$(now_ns)"
read -r s1 j1 <<<"$(steal_jiffies)"
sched_tg="$(per_second "$tr0" "$tw0" "$t0" "$tr1" "$tw1" "$t1")"
sched_redis="$(per_second "$rr0" "$rw0" "$t0" "$rr1" "$rw1" "$t1")"
open_m="$(load "$grpc_m" --keys "$keys" --duration "$duration" --rate "$half" --threads "$open_threads")"
p99_r="$(field "$open_r" p99)"; p99_m="$(field "$open_m" p99)"
p50_r="$(field "$open_r" p50)"; p50_m="$(field "$open_m" p50)"

log "3. the ceiling: the same script call, $concurrency connections, one call in flight each..."
# redis-benchmark cannot send the call (its packed argument holds NUL bytes, which no
# command-line argument can), so tollgate-load's redis mode sends it the way
# redis-benchmark -c N would; redis-benchmark runs plain SET as this machine's yardstick.
r0="$(cpu_ns "$redis_pid")"
ceil="$("$bin/tollgate-load" redis --url "redis://127.0.0.1:$redis_port" --keys "$keys" \
  --concurrency "$concurrency" --duration "$duration" --json --quiet)"
r1="$(cpu_ns "$redis_pid")"
ceiling="$(field "$ceil" rps)"
calls="$(( $(field "$ceil" ok) + $(field "$ceil" over_limit) ))"
redis_cpu_rb="$(awk -v a="$r0" -v b="$r1" -v n="$calls" 'BEGIN { printf "%.1f", (b - a) / 1000 / n }')"
set_rps="$(redis-benchmark -p "$redis_port" -c "$concurrency" -n 200000 -r "$keys" --csv \
  SET 'set:__rand_int__' v | tail -1 | cut -d, -f2 | tr -d '"')"

log "4. one hammered key, 10 per hour, blocked-key cache on..."
c0="$(script_calls)"
hammer="$(load "$grpc_r" --keys 1 --domain hammer --duration 5s)"
c1="$(script_calls)"
rejected="$(field "$hammer" over_limit)"
per_reject="$(awk -v a="$c0" -v b="$c1" -v n="$rejected" 'BEGIN { printf "%.5f", (b - a) / (n > 0 ? n : 1) }')"

ratio="$(awk -v a="$rps" -v b="$ceiling" 'BEGIN { printf "%.2f", a / b }')"
printf '\n%-44s %s\n' "measure" "value"
printf '%-44s %s\n' "tollgate serve on Redis, max decisions/s" "$rps"
printf '%-44s %s\n' "the same call, -c $concurrency, calls/s (ceiling)" "$ceiling"
printf '%-44s %s\n' "redis-benchmark SET -c $concurrency, calls/s" "$set_rps"
printf '%-44s %s\n' "ratio tollgate / ceiling" "$ratio"
printf '%-44s %s\n' "tollgate CPU us per decision" "$tg_cpu"
printf '%-44s %s\n' "Redis CPU us per decision (via tollgate)" "$redis_cpu_tg"
printf '%-44s %s\n' "Redis CPU us per call (ceiling run)" "$redis_cpu_rb"
printf '%-44s %s\n' "p50 / p99 us at $half/s, Redis" "$p50_r / $p99_r"
printf '%-44s %s\n' "p50 / p99 us at $half/s, in-memory" "$p50_m / $p99_m"
printf '%-44s %s\n' "tollgate ran / waited ms/s, half load, Redis" "$sched_tg"
printf '%-44s %s\n' "Redis ran / waited ms/s, half load" "$sched_redis"
printf '%-44s %s\n' "CPU time stolen by the hypervisor, half load" "$(stolen "$s0" "$j0" "$s1" "$j1")"
printf '%-44s %s\n' "hammered key: rejected, Redis calls/reject" "$rejected, $per_reject"
