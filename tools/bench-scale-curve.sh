#!/usr/bin/env bash
# The measured error curve of leased and synced counting: INSTANCES ScaleOut instances
# (default 4), each over its own connection to one real redis-server, on a simulated
# clock; fixed window (exact, leased, synced) and token bucket (leased) at 0.5 to 3
# times the limit, steady and bursty, 1 hot key and 1000 keys, lease periods and sync
# intervals of 10 to 1000 ms. Prints one line per configuration and writes
# OUT/curve.csv and OUT/curve.svg (default target/bench-scale). Deterministic traffic (a
# fixed seed); see crates/tollgate/benches/scale_out.rs for what each column means.
#
#   bash tools/bench-scale-curve.sh
#   INSTANCES=8 MODES=leased,synced KEYS=1 LOADS=2 bash tools/bench-scale-curve.sh
#
# Environment (passed to the bench): INSTANCES, LIMIT, WINDOWS, MANY_KEYS, MANY_LIMIT,
# MANY_WINDOWS, SEED, SPREAD (random | round-robin), OUT, and the comma-list filters
# ALGORITHMS, MODES, PATTERNS, LOADS, KEYS, PERIODS_MS.
# Needs redis-server and redis-cli (apt-get install redis-server redis-tools).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck disable=SC2034 # read by tools/lib.sh (die)
bench_name=bench-scale-curve
# shellcheck source=tools/lib.sh
source tools/lib.sh
for tool in redis-server redis-cli; do
  command -v "$tool" >/dev/null || die "$tool is required (apt-get install redis-server redis-tools)"
done

work="$(mktemp -d)"
redis_pid=""
cleanup() {
  if [[ -n "$redis_pid" ]]; then
    kill "$redis_pid" 2>/dev/null || true
    wait "$redis_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A port found free can be taken before Redis binds it: try a few.
for _ in 1 2 3 4 5; do
  port="$(free_port)"
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --loglevel warning --dir "$work" >"$work/redis.log" 2>&1 &
  redis_pid=$!
  for _ in $(seq 1 100); do
    redis-cli -p "$port" PING >/dev/null 2>&1 && break
    kill -0 "$redis_pid" 2>/dev/null || break
    sleep 0.05
  done
  redis-cli -p "$port" PING >/dev/null 2>&1 && break
  kill "$redis_pid" 2>/dev/null || true
  wait "$redis_pid" 2>/dev/null || true
  redis_pid=""
done
[[ -n "$redis_pid" ]] || { cat "$work/redis.log" >&2; die "redis-server did not start"; }
log "redis-server on 127.0.0.1:$port; building and running the bench (release)..."

REDIS_URL="redis://127.0.0.1:$port" OUT="${OUT:-$root/target/bench-scale}" \
  cargo bench -q -p tollgate --features redis --bench scale_out
