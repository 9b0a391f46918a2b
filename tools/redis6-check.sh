#!/usr/bin/env bash
# Runs Tollgate against a real Redis 6.0, which has no Redis Functions: the store must
# notice on its first call (FCALL is an unknown command there), log it once and decide
# every request through EVALSHA. A check, not part of `cargo test`: the Redis 6 binary
# comes from Debian 11 (bullseye), which CI cannot count on finding on the mirror.
#
#   1. Fetches Debian 11's redis-tools (its redis-server) and libssl1.1 from
#      deb.debian.org (names read from bullseye's package index) and unpacks them under
#      target/redis6 (kept for the next run).
#   2. Starts that redis-server on a free port.
#   3. `tollgate conformance tests/cases --store redis://...`: every case must pass.
#   4. `tollgate serve --store redis://...` under `tollgate-load grpc` for 3 s: no errors,
#      EVALSHA calls in INFO commandstats, and the one warning in the server's log.
#   5. `tollgate redis-prune`: nothing to delete on a Redis without functions.
#
# Needs curl, xz, dpkg-deb, redis-cli, and the Lua libraries Debian 11's Redis links to:
# apt-get install liblua5.1-0 lua-bitop lua-cjson liblzf1 libjemalloc2.
# Usage: tools/redis6-check.sh      Environment: MIRROR (http://deb.debian.org/debian; Debian 11
#   will move to http://archive.debian.org/debian), ARCH (amd64)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${CARGO_TARGET_DIR:-$root/target}/release"
cache="${CARGO_TARGET_DIR:-$root/target}/redis6"
mirror="${MIRROR:-http://deb.debian.org/debian}"
arch="${ARCH:-amd64}"
libdir="$cache/root/usr/lib/$(uname -m)-linux-gnu"

bench_name=redis6-check
# shellcheck source=tools/lib.sh
source "$root/tools/lib.sh"
for tool in curl xz dpkg-deb redis-cli; do
  command -v "$tool" >/dev/null || die "$tool is required"
done
[[ -d "$root/tests/cases" ]] || die "tests/cases is missing (run this from a clone of the repository)"

if [[ ! -x "$cache/bin/redis-server" ]]; then
  log "fetching Debian 11's Redis 6.0 into $cache..."
  mkdir -p "$cache/debs"
  curl -fsS "$mirror/dists/bullseye/main/binary-$arch/Packages.xz" -o "$cache/Packages.xz" ||
    die "cannot fetch bullseye's package index from $mirror"
  for package in redis-tools libssl1.1; do
    file="$(xz -dc "$cache/Packages.xz" |
      awk -v p="$package" '$0 == "Package: " p { on = 1 } on && !done && /^Filename: / { print $2; done = 1 }')"
    [[ -n "$file" ]] || die "no $package in bullseye's index"
    curl -fsS "$mirror/$file" -o "$cache/debs/$package.deb" || die "cannot fetch $file"
    dpkg-deb -x "$cache/debs/$package.deb" "$cache/root"
  done
  mkdir -p "$cache/bin"
  # Debian's redis-server is redis-check-rdb under another name (Redis picks its role
  # from argv[0]); the wrapper finds libssl1.1 beside it.
  ln -sf ../root/usr/bin/redis-check-rdb "$cache/bin/redis-6.0-server"
  cat >"$cache/bin/redis-server" <<EOF
#!/usr/bin/env bash
LD_LIBRARY_PATH="$libdir" exec -a redis-server "$cache/bin/redis-6.0-server" "\$@"
EOF
  chmod +x "$cache/bin/redis-server"
fi
missing="$(LD_LIBRARY_PATH="$libdir" ldd "$cache/root/usr/bin/redis-check-rdb" 2>&1 | grep -E 'not found|not a dynamic' || true)"
[[ -z "$missing" ]] || die "Redis 6.0 lacks libraries (apt-get install liblua5.1-0 lua-bitop lua-cjson liblzf1 libjemalloc2): $missing"

(cd "$root" && cargo build --release -q -p tollgate-server -p tollgate-load)

work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

port="$(free_port)"
"$cache/bin/redis-server" --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
  --loglevel warning --dir "$work" >"$work/redis.log" 2>&1 &
pids+=("$!")
for _ in $(seq 1 100); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.05; done
version="$(redis-cli -p "$port" INFO server 2>/dev/null | tr -d '\r' | sed -n 's/^redis_version://p' || true)"
if [[ "$version" != 6.0.* ]]; then
  cat "$work/redis.log" >&2
  die "expected Redis 6.0 on port $port, got '$version' (its log is above)"
fi
log "Redis $version on port $port"

log "1. the conformance cases (tests/cases)..."
if ! "$bin/tollgate" conformance "$root/tests/cases" --store "redis://127.0.0.1:$port" \
  >"$work/cases.txt" 2>&1; then
  cat "$work/cases.txt" >&2
  die "a conformance case failed on Redis $version (above)"
fi
tail -1 "$work/cases.txt"

log "2. tollgate serve under load..."
mkdir "$work/rules"
printf 'domain: bench\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n' \
  >"$work/rules/bench.yaml"
grpc="$(free_port)"; http="$(free_port)"
TOLLGATE_LOG=warn "$bin/tollgate" serve --config "$work/rules" --store "redis://127.0.0.1:$port" \
  --grpc-listen "127.0.0.1:$grpc" --http-listen "127.0.0.1:$http" >"$work/serve.log" 2>&1 &
pids+=("$!")
ready=no
for _ in $(seq 1 100); do
  [[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$http/readyz" || true)" == 200 ]] && { ready=yes; break; }
  sleep 0.1
done
if [[ "$ready" != yes ]]; then
  cat "$work/serve.log" >&2
  die "tollgate serve did not become ready (its log is above)"
fi
report="$("$bin/tollgate-load" grpc --addr "127.0.0.1:$grpc" --concurrency 64 --keys 10000 \
  --duration 3s --json --quiet)"
errors="$(field "$report" errors)"
evalsha="$(redis-cli -p "$port" INFO commandstats | tr -d '\r' |
  sed -nE 's/^cmdstat_evalsha:calls=([0-9]+),.*/\1/p')"
warnings="$(grep -c 'cannot run Tollgate.s scripts as functions' "$work/serve.log" || true)"
printf '%-36s %s\n' "decisions/s" "$(field "$report" rps)" "errors" "$errors" \
  "EVALSHA calls" "${evalsha:-0}" "'functions unusable' warnings" "$warnings"
if [[ "$errors" != 0 || "${evalsha:-0}" -eq 0 || "$warnings" != 1 ]]; then
  cat "$work/serve.log" >&2
  die "expected no errors, EVALSHA calls and one warning (the server's log is above)"
fi
log "3. tollgate redis-prune..."
pruned="$("$bin/tollgate" redis-prune --store "redis://127.0.0.1:$port" 2>&1)" ||
  die "redis-prune failed on Redis $version: $pruned"
log "   $pruned"
log "ok: Redis $version decides through EVALSHA"
