#!/usr/bin/env bash
# Benchmarks the caller's side of a rate limit: what tollgate-client's RetryLayer saves
# the server, and what it gives its callers, against callers that retry a 429 at once.
#
# This is a benchmark, not a test: it prints numbers, it asserts nothing (it fails only
# if something cannot start or the load program fails).
#
# What it starts (all on 127.0.0.1, free ports, all stopped on exit):
#   upstream  nginx, 1 worker, `return 200 "ok\n"` on every path, keep-alive on;
#   tollgate  `tollgate proxy` (release build) in front of it, with a rule file limiting
#             each `x-api-key` to LIMIT requests per second (token bucket, burst LIMIT).
# Then `bench-callers` (tools/tollgate-load/src/bin/bench-callers.rs, release build):
# CALLERS concurrent callers, all with one API key, each looping "GET until 2xx, then
# the next request", for DURATION seconds, twice:
#   (a) immediate  a 429 is retried at once;
#   (b) crate      through tollgate-client's RetryLayer (default backoff and retry
#                  budget) with the pre-check on, keyed by the API key, waiting up to
#                  5 s for a reset; when the layer gives up, the caller calls it again.
# Each run gets a fresh proxy (a full bucket), after a PAUSE.
#
# Output (stdout, markdown): the commands, one row per mode (requests sent, 429s, 2xx,
# goodput = 2xx per second, p50/p99 time from a logical request's first send to its
# success), the share of 429s (b) avoids and (b)'s goodput as a share of the limit.
# Progress goes to stderr.
#
# Caveats: the callers, the proxy and the upstream share the machine's cores; the
# immediate callers' request rate is bounded by that CPU, so their 429 count is a floor
# of what faster callers would send.
#
# Usage: tools/bench-client.sh
# Environment (all optional):
#   DURATION (20, seconds)  CALLERS (50)  LIMIT (100, per second)  PAUSE (2, seconds)
#   THREADS (2, the callers' tokio workers)  MODES ("immediate crate")
#   TOLLGATE_BIN, BENCH_CALLERS_BIN (default: $CARGO_TARGET_DIR or <repo>/target,
#   then release/...; built with cargo if missing)
#   NGINX (default: from PATH or /usr/sbin/nginx)  KEEP_TMP=1
# Needs: nginx, curl, cargo (if a binary is missing).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC2034 # read by lib.sh's die()
bench_name=bench-client
# shellcheck source=tools/lib.sh
source "$root/tools/lib.sh"

duration="${DURATION:-20}"
callers="${CALLERS:-50}"
limit="${LIMIT:-100}"
pause="${PAUSE:-2}"
threads="${THREADS:-2}"
modes="${MODES:-immediate crate}"
# shellcheck disable=SC2034 # read by lib.sh's stop_all_and_clean
keep_tmp="${KEEP_TMP:-}"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
tg_bin="${TOLLGATE_BIN:-$target_dir/release/tollgate}"
callers_bin="${BENCH_CALLERS_BIN:-$target_dir/release/bench-callers}"
nginx_bin="${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}"

[[ -x "$nginx_bin" ]] || die "nginx not found (apt-get install -y nginx, or set NGINX)"
command -v curl >/dev/null || die "curl not found"
if [[ ! -x "$tg_bin" ]] || ! "$tg_bin" proxy --help >/dev/null 2>&1; then
  log "building: cargo build --release -p tollgate-server"
  (cd "$root" && cargo build --release -p tollgate-server)
fi
if [[ ! -x "$callers_bin" ]]; then
  log "building: cargo build --release -p tollgate-load --bin bench-callers"
  (cd "$root" && cargo build --release -p tollgate-load --bin bench-callers)
fi
[[ -x "$tg_bin" ]] || die "$tg_bin not found (set CARGO_TARGET_DIR or TOLLGATE_BIN)"
[[ -x "$callers_bin" ]] || die "$callers_bin not found (set CARGO_TARGET_DIR or BENCH_CALLERS_BIN)"

# Process bookkeeping: only processes this script started are ever signalled, by pid.
work="$(mktemp -d -t bench-client.XXXXXX)"
begin_run 'stop_all_and_clean 5'

wait_http() { # URL LOG
  for _ in $(seq 1 100); do
    curl -s -o /dev/null "$1" && return 0
    sleep 0.05
  done
  die "nothing answers $1 (see $2)"
}

# Upstream: nginx answering 200 "ok\n" on every path.
up_port="$(free_port)"
mkdir -p "$work/upstream"
cat >"$work/upstream/nginx.conf" <<CONF
daemon off;
master_process on;
worker_processes 1;
pid $work/upstream/nginx.pid;
error_log $work/upstream/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    default_type text/plain;
    keepalive_timeout 75s;
    keepalive_requests 1000000;
    client_body_temp_path $work/upstream/client_body;
    proxy_temp_path $work/upstream/proxy;
    fastcgi_temp_path $work/upstream/fastcgi;
    uwsgi_temp_path $work/upstream/uwsgi;
    scgi_temp_path $work/upstream/scgi;
    server {
        listen 127.0.0.1:$up_port;
        location / { return 200 "ok\n"; }
    }
}
CONF
"$nginx_bin" -p "$work/upstream" -c "$work/upstream/nginx.conf" >"$work/upstream/out.log" 2>&1 &
started+=($!)
wait_http "http://127.0.0.1:$up_port/" "$work/upstream/error.log"

# The proxy's rules: LIMIT per second per API key, token bucket.
cat >"$work/rules.yaml" <<YAML
domain: bench
descriptors:
  - key: api_key
    rate_limit: {unit: second, requests_per_unit: $limit, algorithm: token_bucket, name: per_key}
http:
  routes:
    - match: {path_prefix: /}
      rate_limits:
        - actions: [{request_headers: {header_name: x-api-key, descriptor_key: api_key}}]
YAML

tg_port="$(free_port)"
while [[ "$tg_port" == "$up_port" ]]; do tg_port="$(free_port)"; done
tg_cmd=("$tg_bin" proxy --listen "127.0.0.1:$tg_port" --upstream "http://127.0.0.1:$up_port"
  --config "$work/rules.yaml")
url="http://127.0.0.1:$tg_port/api/items"

echo "## tollgate-client: immediate retries vs RetryLayer"
echo
echo "- $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "- upstream: nginx 1 worker, \`return 200\`; proxy: \`tollgate proxy --listen 127.0.0.1:$tg_port --upstream http://127.0.0.1:$up_port --config rules.yaml\` (release build)"
echo "- rule: ${limit} per second per \`x-api-key\`, token bucket (burst ${limit}); one key"
echo "- callers: \`bench-callers --url URL --mode MODE --callers $callers --duration $duration --threads $threads\`"
echo

results=()
for mode in $modes; do
  "${tg_cmd[@]}" >"$work/tollgate-$mode.log" 2>&1 &
  tg_pid=$!
  started+=("$tg_pid")
  wait_http "http://127.0.0.1:$tg_port/healthz-probe" "$work/tollgate-$mode.log"
  # A fresh proxy, a full bucket; let the machine settle.
  sleep "$pause"
  log "mode $mode: $callers callers for ${duration}s"
  out="$("$callers_bin" --url "$url" --mode "$mode" --callers "$callers" \
    --duration "$duration" --threads "$threads")" || die "bench-callers --mode $mode failed"
  log "$out"
  results+=("$out")
  stop_pid "$tg_pid"
done

echo "| mode | sent | 429s | 2xx | other | goodput (2xx/s) | p50 to success | p99 to success | gave up (layer) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
for r in "${results[@]}"; do
  printf '| %s | %s | %s | %s | %s | %s | %s ms | %s ms | %s |\n' \
    "$(field "$r" mode | tr -d '"')" "$(field "$r" sent)" "$(field "$r" rejected)" \
    "$(field "$r" ok)" "$(( $(field "$r" other) + $(field "$r" errors) ))" \
    "$(field "$r" goodput)" "$(field "$r" p50_ms)" "$(field "$r" p99_ms)" "$(field "$r" gave_up)"
done
echo
if ((${#results[@]} == 2)); then
  a="${results[0]}" b="${results[1]}"
  awk -v ra="$(field "$a" rejected)" -v rb="$(field "$b" rejected)" -v gb="$(field "$b" goodput)" \
    -v limit="$limit" 'BEGIN {
      saved = ra > 0 ? 100 * (1 - rb / ra) : 0
      share = 100 * gb / limit
      printf "- 429s avoided by (b): %.1f %% (target >= 90 %%: %s)\n", saved, (saved >= 90 ? "met" : "missed")
      printf "- (b) goodput: %.1f %% of the limit (target >= 95 %%: %s)\n", share, (share >= 95 ? "met" : "missed")
    }'
fi
echo "- load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
