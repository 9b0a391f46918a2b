#!/usr/bin/env bash
# Multi-region limits on one machine: two regions, each with its own redis-server and
# INSTANCES `tollgate serve --workers 1 --region rN --store <its Redis> --global-store
# <the global Redis>` (release build), and one global redis-server reached only through
# tools/delay-proxy.py, which adds DELAY_MS to each direction (a distant store: a round
# trip of 2 × DELAY_MS, 80 ms by default) and can cut the path (a partition) and heal it.
#
# One domain per failure mode of FAILURE_MODES (local_fallback: `local_fallback_divisor:
# DIVISOR`, `regions: 2`; fail_open; fail_closed), each with two limits, one request
# descriptor each:
#   g  `scope: global`, LIMIT per 1 s fixed window (leased from the global store,
#      `lease_period: LEASE_PERIOD`): one limit shared by both regions;
#   r  `scope: region`, REGION_LIMIT per 1 s fixed window: one limit per region, counted
#      on the region's own Redis (the default consistency, exact).
# Each run uses new descriptor values (fresh counters). The load: per instance two
# h2load (-c 1 -m STREAMS, open loop at --rps, ShouldRateLimit over gRPC, as in
# tools/bench-scale-vs-limitador.sh), one for g and one for r, all started together
# 200 ms after a second boundary and running DURATION s + 600 ms. g is offered LOAD ×
# LIMIT per second in all, split between the regions as SPLITS says (80/20: region r1
# gets 80 %, shared evenly by its instances); r is offered REGION_LOAD × REGION_LIMIT
# per second in each region.
#
# Runs, in this order:
#   latency runs: for each split of SPLITS, ROUNDS rounds, each round once with the
#     delay (DELAY_MS) and once without it (the proxy still in the path, delay 0: the
#     baseline), the order alternating between rounds; domain of local_fallback (the
#     failure mode plays no part while the store answers);
#   partition runs: for each failure mode of FAILURE_MODES, one run of PART_BEFORE +
#     PART_LENGTH + PART_AFTER s at PARTITION_SPLIT with the delay; the proxy is
#     partitioned (PARTITION: blackhole, nothing forwarded and bytes held until the heal,
#     as on a cut link; or reset, every connection reset and new ones refused) from 500 ms
#     into second PART_BEFORE of the run (mid-window) for PART_LENGTH s.
#
# Measured per one-second window (the fixed windows: second boundaries), by a sampler
# (tools/bench-regions.py sample) that scrapes every instance's /metrics 10 ms before each
# window ends and polls the global Redis directly (not through the proxy; every 20 ms,
# every 2 ms in a window's last 60 ms) for the run's state key, whose count the next
# window's first call resets. target/bench-regions/windows.csv, one row per run and window:
#   rN_admitted, rN_limited   g's tollgate_within_limit_total / over_limit_total
#                             deltas, summed over the region's instances: answers by
#                             the time they were GIVEN (a decision that waited into the
#                             next window counts there; answers of the window's last
#                             10 ms count in the next one);
#   rN_region_admitted        the same for r (limit REGION_LIMIT per region);
#   rN_p50_ms, rN_p99_ms      g's latency in the region (h2load --log-file: from a
#                             request's send to its answer, requests sent in the window);
#   rN_failed                 h2load requests that failed (status not 200) in the window;
#   admitted, admitted_per_limit, over   g admitted by both regions, ÷ LIMIT, and OVER
#                             when above LIMIT (by answer time, see above);
#   global_store_count        the count in the global Redis's state key for the window
#                             (the highest seen: units leased, less those returned): what
#                             the global store let through in that window;
#   global_store_calls, global_store_failures, fallback_s   Σ deltas of
#                             tollgate_global_store_calls_total, _failures_total and
#                             tollgate_global_fallback_seconds_total;
#   global_calls_timed, global_call_seconds   Σ deltas of the count and sum of
#                             tollgate_global_lease_duration_seconds (calls that answered);
#   scrape_skew_ms            the latest scrape's lateness past its target.
# latency.csv: per run, region, descriptor and phase (all; before, cut, during, heal,
# after for partition runs): requests, failed, p50, p99, p99.9, max (ms); descriptor
# "server": the instances' own tollgate_decision_duration_seconds over the run (g and r
# decisions together), as the upper bound of the bucket holding each percentile.
# runs.csv: per run and region: offered g per s, h2load's answered per s (g and r),
# failed, and per run: the delay proxy's own lateness (the latest it wrote a chunk past
# its due time, and how many chunks it wrote more than 1, 5, 20 ms late; chunks held by
# a partition left out: tools/delay-proxy.py's stats), INFO commandstats of the global Redis (requests sent by the
# instances: script calls and plain commands, without the commands run inside scripts
# and the sampler's own SCAN/MGET/INFO).
# summary.md (tools/bench-regions.py report), medians over the rounds:
#   decisions/s          g's answers per second, summed over the region's h2loads;
#   p50 / p99 ms         g's latency over the whole run, per region; Δ p99: with the
#                        delay minus without it (same split, same round); server p99:
#                        the histogram's bucket bound; r p99: the regional limit's;
#   admitted ÷ L         g admitted by answer time ÷ LIMIT per full window (the first and
#                        last windows are partial and left out): median and max, and
#                        the windows over LIMIT by answer time;
#   whole run            Σ admitted ÷ (LIMIT × windows touched) (at 2× every window,
#                        partial ones too, is offered more than LIMIT: 1 is exact);
#   highest global-store count ÷ L, admitted ÷ global-store count   the store's own
#                        count per window, and whether every admission was leased from it;
#   share                each region's part of the global admitted;
#   calls / decision     global-store calls (the metric) per g decision, and the global
#                        Redis's requests (INFO commandstats) per g decision;
#   mean global call ms  tollgate_global_lease_duration_seconds' sum ÷ count;
#   r admitted ÷ RL      each region's r admitted ÷ REGION_LIMIT per full window (median).
# And per partition run: admitted per region and in all per phase (mean per window),
# latency and failures per phase, the global Redis's counts against the admitted, the
# global-store calls and failures, and the run window by window;
# target/bench-regions/partition-MODE.svg: admitted per second per region and in all
# against LIMIT; partition.svg: local_fallback's regions and total with the other modes'
# totals. Every h2load log is kept (logs/, gzip).
#
# Usage: tools/bench-regions.sh
# Environment (optional): LIMIT (1000), LOAD (2), REGION_LIMIT (250), REGION_LOAD (2),
#   SPLITS ("80/20 50/50"), ROUNDS (3), DURATION (10: seconds per latency run),
#   DELAY_MS (40: each way), INSTANCES (2 per region), STREAMS (256), LEASE_PERIOD
#   (100ms), GLOBAL_ALGORITHM (fixed_window; token_bucket or gcra: g as a bucket of
#   LIMIT per second with a burst of LIMIT, whose leases never stop at a window's turn;
#   the per-window "over" and global-store count columns then mean nothing: a bucket may
#   admit its burst and a second's refill in one window), DIVISOR (2: local_fallback_divisor), FAILURE_MODES ("local_fallback
#   fail_open fail_closed"; empty: no partition runs), PARTITION (blackhole | reset),
#   PARTITION_SPLIT (80/20), PART_BEFORE (10), PART_LENGTH (10), PART_AFTER (10),
#   LATENCY (1: 0 skips the latency runs), SERVE_ARGS (more `tollgate serve` flags),
#   GLOBAL (1; 0: a check of the plumbing on a build without multi-region: no --region,
#   --global-store, scope or regions, each region counting g alone), OUT
#   (target/bench-regions), CARGO_TARGET_DIR.
# Needs h2load, redis-server, redis-cli, curl, python3 and the release build of
# tollgate-server (cargo build --release -p tollgate-server).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
limit="${LIMIT:-1000}"
load="${LOAD:-2}"
region_limit="${REGION_LIMIT:-250}"
region_load="${REGION_LOAD:-2}"
read -r -a splits <<<"${SPLITS:-80/20 50/50}"
rounds="${ROUNDS:-3}"
duration="${DURATION:-10}"
duration="${duration%s}"
delay_ms="${DELAY_MS:-40}"
instances="${INSTANCES:-2}"
streams="${STREAMS:-256}"
lease_period="${LEASE_PERIOD:-100ms}"
global_algorithm="${GLOBAL_ALGORITHM:-fixed_window}"
divisor="${DIVISOR:-2}"
read -r -a failure_modes <<<"${FAILURE_MODES-local_fallback fail_open fail_closed}"
partition="${PARTITION:-blackhole}"
partition_split="${PARTITION_SPLIT:-80/20}"
part_before="${PART_BEFORE:-10}"
part_length="${PART_LENGTH:-10}"
part_after="${PART_AFTER:-10}"
latency_runs="${LATENCY:-1}"
read -r -a serve_args <<<"${SERVE_ARGS:-}"
global="${GLOBAL:-1}"
out="${OUT:-$root/target/bench-regions}"
bin="${CARGO_TARGET_DIR:-$root/target}/release"
path=/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit
helper="$root/tools/bench-regions.py"
regions=(r1 r2)

bench_name=bench-regions
# shellcheck source=tools/lib.sh
source "$root/tools/lib.sh"

for tool in h2load redis-server redis-cli curl python3; do
  command -v "$tool" >/dev/null ||
    die "$tool is required (Debian: apt-get install nghttp2-client redis-server redis-tools curl python3)"
done
[[ -x "$bin/tollgate" ]] ||
  die "no release build at $bin/tollgate; build it first: cargo build --release -p tollgate-server (with the same CARGO_TARGET_DIR as here)"
if [[ -n "$(find "$root/crates" -name '*.rs' -newer "$bin/tollgate" -print -quit)" ]]; then
  log "$bench_name: warning: sources are newer than $bin/tollgate (cargo build --release -p tollgate-server)"
fi
if [[ "$global" == 1 ]] && ! "$bin/tollgate" serve --help 2>/dev/null | grep -q -- '--global-store'; then
  die "$bin/tollgate has no --global-store (a build without multi-region limits; GLOBAL=0 checks the plumbing only)"
fi
posint() { [[ "$2" =~ ^[0-9]+$ && "$2" -ge 1 ]] || die "$1 must be a positive integer"; }
posint LIMIT "$limit"; posint REGION_LIMIT "$region_limit"; posint ROUNDS "$rounds"
posint INSTANCES "$instances"; posint STREAMS "$streams"; posint DIVISOR "$divisor"
posint PART_BEFORE "$part_before"; posint PART_LENGTH "$part_length"; posint PART_AFTER "$part_after"
[[ "$duration" =~ ^[0-9]+$ && "$duration" -ge 3 ]] || die "DURATION must be whole seconds, at least 3"
[[ "$delay_ms" =~ ^[0-9]+$ ]] || die "DELAY_MS must be whole milliseconds"
for x in "$load" "$region_load"; do [[ "$x" =~ ^[0-9]*\.?[0-9]+$ ]] || die "LOAD and REGION_LOAD must be positive numbers"; done
for s in "${splits[@]}" "$partition_split"; do
  [[ "$s" =~ ^([0-9]+)/([0-9]+)$ && $((BASH_REMATCH[1] + BASH_REMATCH[2])) -eq 100 ]] ||
    die "a split is two percentages adding up to 100 (80/20), not '$s'"
done
for m in "${failure_modes[@]}"; do
  [[ "$m" =~ ^(local_fallback|fail_open|fail_closed)$ ]] || die "unknown failure mode '$m' in FAILURE_MODES"
done
[[ "$partition" =~ ^(blackhole|reset)$ ]] || die "PARTITION is blackhole or reset"

mkdir -p "$out"
work="$(mktemp -d)"
pids=()          # every server, Redis and the proxy, stopped at the end
client_pids=()   # the h2loads and the sampler of the current run
cleanup() {
  local p
  for p in "${client_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for ((p = ${#pids[@]} - 1; p >= 0; p--)); do kill "${pids[$p]}" 2>/dev/null || true; done
  for p in "${client_pids[@]}" "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The Redis servers: the global one, and one per region.
start_redis "$work" "$out/redis-global.log"
pids+=("$redis_pid"); global_port="$redis_port"
declare -A region_url
for reg in "${regions[@]}"; do
  start_redis "$work" "$out/redis-$reg.log"
  pids+=("$redis_pid"); region_url[$reg]="$redis_url"
done

# The delay proxy in front of the global Redis.
proxy_port="$(free_port)"
control_port="$(free_port)"
python3 "$root/tools/delay-proxy.py" --listen "$proxy_port" --upstream "127.0.0.1:$global_port" \
  --delay-ms "$delay_ms" --control-port "$control_port" >"$work/proxy.out" 2>"$out/proxy.log" &
pids+=("$!")
for _ in $(seq 1 100); do grep -q ready "$work/proxy.out" 2>/dev/null && break; sleep 0.05; done
grep -q ready "$work/proxy.out" || die "the delay proxy did not start (see $out/proxy.log)"
# One command to the proxy; prints its answer.
proxy_ctl() {
  local reply
  exec 3<>"/dev/tcp/127.0.0.1/$control_port"
  printf '%s\n' "$*" >&3
  read -r reply <&3
  exec 3>&-
  [[ "$reply" == ok* || "$1" == stats ]] || die "delay proxy: '$*' answered '$reply'"
  printf '%s\n' "$reply"
}
global_url="redis://127.0.0.1:$proxy_port"

# The rules: one domain per failure mode.
mkdir -p "$work/rules"
declare -A domain_of=([local_fallback]=lf [fail_open]=open [fail_closed]=closed)
for m in local_fallback fail_open fail_closed; do
  {
    echo "domain: ${domain_of[$m]}"
    echo "failure_mode: $m"
    if [[ "$m" == local_fallback ]]; then
      echo "local_fallback_divisor: $divisor"
      [[ "$global" != 1 ]] || echo "regions: ${#regions[@]}"
    fi
    echo "lease_period: $lease_period"
    echo "descriptors:"
    echo "  - key: g"
    [[ "$global" != 1 ]] || echo "    scope: global"
    echo "    rate_limit: {unit: second, requests_per_unit: $limit, algorithm: $global_algorithm}"
    echo "  - key: r"
    [[ "$global" != 1 ]] || echo "    scope: region"
    echo "    rate_limit: {unit: second, requests_per_unit: $region_limit}"
  } >"$work/rules/${domain_of[$m]}.yaml"
done
"$bin/tollgate" validate "$work/rules" >&2 || die "the rules do not validate"

# The instances: INSTANCES per region. inst_names[i] = rN-I; http/grpc ports alike.
inst_names=(); inst_regions=(); grpc_ports=(); http_ports=()
start_instance() { # REGION I; prints "pid grpc http"
  local reg="$1" i="$2" grpc http pid code args
  args=(serve --config "$work/rules" --store "${region_url[$reg]}" --workers 1)
  [[ "$global" != 1 ]] || args+=(--region "$reg" --global-store "$global_url")
  for _ in 1 2 3; do
    grpc="$(free_port)"; http="$(free_port)"
    [[ "$grpc" != "$http" ]] || continue
    TOLLGATE_LOG=warn "$bin/tollgate" "${args[@]}" "${serve_args[@]}" \
      --grpc-listen "127.0.0.1:$grpc" --http-listen "127.0.0.1:$http" >>"$out/tollgate-$reg-$i.log" 2>&1 &
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
  tail -20 "$out/tollgate-$reg-$i.log" >&2
  return 1
}
for reg in "${regions[@]}"; do
  for ((i = 0; i < instances; i++)); do
    started="$(start_instance "$reg" "$i")" || die "cannot start instance $i of $reg (see $out/tollgate-$reg-$i.log)"
    read -r pid grpc http <<<"$started"
    pids+=("$pid"); inst_names+=("$reg-$i"); inst_regions+=("$reg"); grpc_ports+=("$grpc"); http_ports+=("$http")
  done
done

# The gRPC frame of one ShouldRateLimit call (uncompressed, 4-byte length):
# RateLimitRequest {domain: DOMAIN, descriptors: [{entries: [{key: KEY, value: VALUE}]}],
# hits_addend: 1}. (Every length fits one byte of varint: the strings are short.)
call_bin() { # DOMAIN KEY VALUE FILE
  local d="$1" k="$2" v="$3" entry desc total
  entry=$((2 + ${#k} + 2 + ${#v}))
  desc=$((2 + entry))
  total=$((2 + ${#d} + 2 + desc + 2))
  # shellcheck disable=SC2059 # the format is built here on purpose (\x escapes)
  printf "\\x00\\x00\\x00\\x00\\x$(printf %02x "$total")\\x0a\\x$(printf %02x "${#d}")%s\\x12\\x$(printf %02x "$desc")\\x0a\\x$(printf %02x "$entry")\\x0a\\x$(printf %02x "${#k}")%s\\x12\\x$(printf %02x "${#v}")%s\\x18\\x01" \
    "$d" "$k" "$v" >"$4"
}

# Sleeps until the wall clock reaches NS (nanoseconds since the epoch).
sleep_until() {
  local ns
  ns=$(($1 - $(now_ns)))
  ((ns > 0)) || return 0
  sleep "$(printf '%d.%09d' $((ns / 1000000000)) $((ns % 1000000000)))"
}

# The global Redis's command counts so far, "name calls" a line.
global_commands() {
  redis-cli -p "$global_port" INFO commandstats | tr -d '\r' |
    sed -nE 's/^cmdstat_([^:]+):calls=([0-9]+),.*/\1 \2/p' || true
}
# Requests between two global_commands files: commands the instances sent (the commands
# Tollgate's scripts run inside Redis, as in tools/bench-scale-vs-limitador.sh, and this
# script's INFO and the sampler's SCAN / MGET left out); prints "requests breakdown".
global_requests() { # BEFORE AFTER
  awk -v skip="info scan mget get set setrange del pexpire pttl time zadd zcard zremrangebyscore zscore lindex llen lpop lpush lrange lrem lset rpop rpush" '
    BEGIN { n = split(skip, a, " "); for (i = 1; i <= n; i++) s[a[i]] = 1 }
    FNR == NR { b[$1] = $2; next }
    { d = $2 - b[$1]; if (d <= 0) next
      if (!($1 in s)) req += d
      br = br (br == "" ? "" : ";") $1 "=" d }
    END { printf "%.0f %s\n", req, (br == "" ? "-" : br) }' "$1" "$2"
}

# "answered failed elapsed_s" of one h2load output.
parse_h2load() { # FILE
  awk '
    function secs(x) {
      if (x ~ /ms$/) return x / 1000; if (x ~ /us$/) return x / 1e6; return x + 0 }
    /^finished in / { el = $3; sub(/,$/, "", el); el = secs(el) }
    /^requests: / { ok = $8; fail = $10 + $12 + $14 }
    END { printf "%d %d %.3f\n", ok, fail, el }' "$1"
}

windows_csv="$out/windows.csv"
latency_csv="$out/latency.csv"
runs_csv="$out/runs.csv"
: >"$windows_csv"
echo "run,region,descriptor,phase,requests,failed,p50_ms,p99_ms,p999_ms,max_ms,over_1ms,over_50ms" >"$latency_csv"
echo "run,kind,failure_mode,split,delay_ms,round,region,offered_g_per_s,g_answered_per_s,r_answered_per_s,failed,start,windows,partition_at,heal_at,proxy_max_lag_ms,proxy_chunks,proxy_late_1ms,proxy_late_5ms,proxy_late_20ms,global_requests,global_commands" >"$runs_csv"
run_no=0

# One run: KIND (latency | partition), failure MODE, SPLIT (80/20), DELAY (ms), ROUND,
# SECONDS (the clients run SECONDS s + 600 ms). Appends to the CSVs.
run() {
  local kind="$1" mode="$2" split="$3" delay="$4" round="$5" secs="$6"
  local domain="${domain_of[$mode]}" id value i reg share rate s0 start_ns part_at="" heal_at="" nwin
  run_no=$((run_no + 1))
  id="$(printf '%02d' "$run_no")"
  value="run$id"
  proxy_ctl delay "$delay" >/dev/null
  proxy_ctl stats reset >/dev/null
  call_bin "$domain" g "$value" "$work/g-$id.bin"
  call_bin "$domain" r "$value" "$work/r-$id.bin"
  local -A share_of=([r1]="${split%/*}" [r2]="${split#*/}")
  nwin=$((secs + 1))
  # The first window starts at the next second boundary but one (time to start the sampler).
  s0=$(($(now_ns) / 1000000000 + 2))
  start_ns=$((s0 * 1000000000 + 200000000))
  global_commands >"$work/cmd0"
  local sampler_args=()
  for ((i = 0; i < ${#inst_names[@]}; i++)); do
    sampler_args+=(--instance "${inst_names[$i]}:${inst_regions[$i]}:${http_ports[$i]}")
  done
  client_pids=()
  python3 "$helper" sample --out "$work/samples-$id.jsonl" --start "$s0" --windows "$nwin" \
    --domain "$domain" --global-redis "$global_port" --match "$value" "${sampler_args[@]}" &
  client_pids+=("$!")
  sleep_until "$start_ns"
  local logs=()
  for ((i = 0; i < ${#inst_names[@]}; i++)); do
    reg="${inst_regions[$i]}"
    share="${share_of[$reg]}"
    # g: LOAD × LIMIT × the region's share, evenly over its instances; r: REGION_LOAD ×
    # REGION_LIMIT per region.
    for d in g r; do
      if [[ "$d" == g ]]; then
        rate="$(awk -v l="$limit" -v x="$load" -v s="$share" -v n="$instances" 'BEGIN { r = int(l * x * s / 100 / n + 0.5); print (r < 1 ? 1 : r) }')"
      else
        rate="$(awk -v l="$region_limit" -v x="$region_load" -v n="$instances" 'BEGIN { r = int(l * x / n + 0.5); print (r < 1 ? 1 : r) }')"
      fi
      echo "$rate" >"$work/rate-$id-$d-$i"
      h2load -c 1 -t 1 -m "$streams" --rps "$rate" -D "$((secs * 1000 + 600))ms" -d "$work/$d-$id.bin" \
        -H 'content-type: application/grpc' -H 'te: trailers' --log-file "$work/log-$id-$d-$i.tsv" \
        "http://127.0.0.1:${grpc_ports[$i]}$path" >"$work/h2load-$id-$d-$i.out" 2>&1 &
      client_pids+=("$!")
      logs+=(--log "$reg:$d:$work/log-$id-$d-$i.tsv")
    done
  done
  local partition_args=()
  if [[ "$kind" == partition ]]; then
    part_at=$(((s0 + part_before) * 1000000000 + 500000000))
    heal_at=$((part_at + part_length * 1000000000))
    sleep_until "$part_at"
    log "    $(date -u +%T.%N | cut -c1-12) partition ($partition): $(proxy_ctl partition "$partition")"
    sleep_until "$heal_at"
    log "    $(date -u +%T.%N | cut -c1-12) heal: $(proxy_ctl heal)"
    partition_args=(--partition-at "$(awk -v n="$part_at" 'BEGIN { printf "%.3f", n / 1e9 }')"
      --heal-at "$(awk -v n="$heal_at" 'BEGIN { printf "%.3f", n / 1e9 }')")
  fi
  for i in "${client_pids[@]}"; do wait "$i" || true; done
  client_pids=()
  global_commands >"$work/cmd1"
  local pstats lag
  pstats="$(proxy_ctl stats)"
  lag="$(field "$pstats" max_lag_ms),$(field "$pstats" timed_chunks),$(field "$pstats" late_1ms),$(field "$pstats" late_5ms),$(field "$pstats" late_20ms)"
  local req breakdown
  read -r req breakdown <<<"$(global_requests "$work/cmd0" "$work/cmd1")"
  local header=()
  [[ -s "$windows_csv" ]] || header=(--header)
  python3 "$helper" windows --samples "$work/samples-$id.jsonl" --run "$id" --start "$s0" \
    --windows "$nwin" --limit "$limit" "${logs[@]}" "${partition_args[@]}" "${header[@]}" \
    --latency-out "$latency_csv" >>"$windows_csv"
  cp "$work/samples-$id.jsonl" "$out/"
  mkdir -p "$out/logs"
  for f in "$work"/log-"$id"-*.tsv; do gzip -c "$f" >"$out/logs/$(basename "$f").gz"; done
  # Per region: offered g, h2load's answers per second (g, r), failures.
  for reg in "${regions[@]}"; do
    local offered=0 gps=0 rps=0 failed=0 a f el
    for ((i = 0; i < ${#inst_names[@]}; i++)); do
      [[ "${inst_regions[$i]}" == "$reg" ]] || continue
      offered=$((offered + $(cat "$work/rate-$id-g-$i")))
      for d in g r; do
        read -r a f el <<<"$(parse_h2load "$work/h2load-$id-$d-$i.out")"
        ((a > 0)) || { log "h2load $d on ${inst_names[$i]} answered nothing:"; cat "$work/h2load-$id-$d-$i.out" >&2; }
        failed=$((failed + f))
        if [[ "$d" == g ]]; then
          gps="$(awk -v x="$gps" -v a="$a" -v e="$el" 'BEGIN { printf "%.1f", x + (e > 0 ? a / e : 0) }')"
        else
          rps="$(awk -v x="$rps" -v a="$a" -v e="$el" 'BEGIN { printf "%.1f", x + (e > 0 ? a / e : 0) }')"
        fi
      done
    done
    ((failed == 0)) || log "WARNING: run $id $reg: h2load counted $failed failed/errored/timed-out calls"
    echo "$id,$kind,$mode,$split,$delay,$round,$reg,$offered,$gps,$rps,$failed,$s0,$nwin,${part_at:+$((part_at / 1000000))},${heal_at:+$((heal_at / 1000000))},$lag,$req,$breakdown" >>"$runs_csv"
  done
  python3 "$helper" brief --windows "$windows_csv" --latency "$latency_csv" --run "$id" \
    --label "$kind $mode $split, delay ${delay} ms, round $round" >&2
}

started_at="$(now_ns)"
read -r load_before _ </proc/loadavg
log "$bench_name: regions ${regions[*]}, $instances instances each; global Redis :$global_port behind the delay proxy :$proxy_port (${delay_ms} ms each way); g: $limit/s global, offered $load×; r: $region_limit/s per region, offered $region_load×"
if [[ "$latency_runs" == 1 ]]; then
  for split in "${splits[@]}"; do
    for ((round = 1; round <= rounds; round++)); do
      if ((round % 2)); then order=("$delay_ms" 0); else order=(0 "$delay_ms"); fi
      for d in "${order[@]}"; do
        run latency local_fallback "$split" "$d" "$round" "$duration"
      done
    done
  done
fi
for m in "${failure_modes[@]}"; do
  run partition "$m" "$partition_split" "$delay_ms" 1 $((part_before + part_length + part_after))
done
wall=$((($(now_ns) - started_at) / 1000000000))
read -r load_after _ </proc/loadavg
proxy_ctl stats >"$out/proxy-stats.json"

# The plots of the partition runs: one per failure mode, and all of them in one
# (partition.svg: local_fallback's regions and total, the other modes' totals).
part_id() { awk -F, -v m="$1" '$2 == "partition" && $3 == m { r = $1 } END { print r }' "$runs_csv"; }
per_region_bound=$((instances * limit / (divisor * ${#regions[@]})))
title="Global limit $limit/s offered ${load}× ($partition_split), global store ${delay_ms} ms away each way, cut for ${part_length} s"
note="${#regions[@]} regions × $instances instances|admitted by answer time, per 1 s window|$partition partition"
overlays=()
for m in "${failure_modes[@]}"; do
  python3 "$helper" plot --csv "$windows_csv" --run "$(part_id "$m")" --limit "$limit" --out "$out/partition-$m.svg" \
    --partition-from "$part_before".5 --partition-to "$((part_before + part_length))".5 \
    --label "$m: total" --title "$title" --note "$note"
  [[ "$m" == local_fallback ]] || overlays+=(--overlay "$(part_id "$m"):$m: total")
done
if [[ " ${failure_modes[*]} " == *" local_fallback "* ]]; then
  python3 "$helper" plot --csv "$windows_csv" --run "$(part_id local_fallback)" --limit "$limit" --out "$out/partition.svg" \
    --partition-from "$part_before".5 --partition-to "$((part_before + part_length))".5 \
    --label "local_fallback: total" "${overlays[@]}" \
    --bound "$per_region_bound:a region's fallback bound ($instances × $((limit / (divisor * ${#regions[@]}))))" \
    --title "$title" --note "$note"
fi

python3 "$helper" report --windows "$windows_csv" --latency "$latency_csv" --runs "$runs_csv" \
  --limit "$limit" --region-limit "$region_limit" --divisor "$divisor" --regions "${#regions[@]}" \
  --context "wall ${wall}s; 1-minute load average $load_before before, $load_after after, on $(nproc) cores; $(tr -d '\n' <"$out/proxy-stats.json")" \
  --commands "$(
    echo "redis-server --port PORT --bind 127.0.0.1 --save '' --appendonly no   # × 3: global, r1, r2"
    echo "python3 tools/delay-proxy.py --listen PROXY --upstream 127.0.0.1:GLOBAL --delay-ms $delay_ms --control-port CTL"
    echo "$bin/tollgate serve --config rules/ --store redis://127.0.0.1:REGIONAL --workers 1 $([[ "$global" != 1 ]] || echo "--region rN --global-store redis://127.0.0.1:PROXY ")${serve_args[*]}${serve_args[*]:+ }--grpc-listen 127.0.0.1:GRPC --http-listen 127.0.0.1:HTTP   # × $instances per region"
    echo "h2load -c 1 -t 1 -m $streams --rps RATE -D $((duration * 1000 + 600))ms -d call.bin -H 'content-type: application/grpc' -H 'te: trailers' --log-file log.tsv http://127.0.0.1:GRPC$path   # × 2 per instance (g, r)"
  )" \
  --rules "$(for f in "$work"/rules/*.yaml; do cat "$f"; echo "---"; done)" | tee "$out/summary.md"
