#!/usr/bin/env bash
# A fleet of `tollgate serve` instances on ONE Redis, for each `consistency` (exact,
# leased, synced): throughput, Redis calls and CPU per decision, p99, and how close the
# fleet keeps to the limit, under a client we did not write (wrk).
#
# Starts its own redis-server on a free port (--save '' --appendonly no), then, for each
# key count of KEYS_LIST (1: one hot key; 1000: keys taken round-robin):
#   1. calibration: INSTANCES instances (release build, --workers WORKERS), one rule with
#      a limit too high to reach, consistency exact; one wrk per instance, closed loop,
#      3 runs of CALIBRATION seconds: the fleet's exact-mode decisions/s, R (median);
#   2. for each offered load ÷ limit L of LOADS (2 and 0.5), the per-key limit
#      requests_per_unit = R / (L × keys) per second (fixed window, the default
#      algorithm), in one domain per mode and load; the fleet restarted on those rules;
#   3. ROUNDS rounds; in each, for each load, each mode of MODES in turn: one wrk per
#      instance (-t1 -c CONNECTIONS -d DURATION --latency -s tools/wrk-check.lua), all
#      starting 50 ms after a second boundary.
# Per run it reads: wrk's requests, elapsed time, p99 and non-2xx count (and the Lua
# script's count of 200 / 429 / other statuses: any other status is reported); Redis
# script calls (INFO commandstats: fcall, fcall_ro, evalsha, evalsha_ro, eval, eval_ro)
# and CPU (/proc/PID/task/*/schedstat) before and after; each instance's CPU and its
# /metrics counters (leases, expired units, local decisions, sync calls, store errors).
#
# The figures (medians over the rounds; "instance" ones are the median of the
# instances within a run first):
# - decisions/s per instance and for the fleet (the sum): MEASURED. wrk is closed loop,
#   so these are what the 2 cores gave the whole fleet (instances + Redis + wrk);
# - offered ÷ limit: the fleet's decisions/s ÷ (limit × keys): the load actually
#   offered in that run (a faster mode offers more than the calibrated L);
# - admitted ÷ limit per window: wrk cannot see windows, so this is total admitted ÷
#   (limit × keys × wrk's elapsed seconds), i.e. per one-second window on average over
#   the ~DURATION windows. Runs start 50 ms after a second boundary, so a run touches
#   DURATION + 1 windows, the last one by a sliver; expect ≈ 1.0 at 2× (a little above
#   for that sliver) and ≈ offered ÷ limit at 0.5× (everything admitted). Admitting
#   more than limit × keys × (windows touched) breaks a fixed window's guarantee: the
#   run is flagged OVER (a bug in exact or leased mode; synced mode may over-admit by
#   what the other instances admit within one sync interval, by design);
# - Redis calls/decision, server and Redis CPU µs/decision: MEASURED;
# - Redis-bound decisions/s = 1 s ÷ Redis CPU per decision: DERIVED, what one Redis
#   core could serve if the instances and the client were elsewhere (it assumes Redis
#   CPU per decision stays the same at that rate; batching makes it fall with load);
# - the ratios leased ÷ exact and synced ÷ exact are medians of per-round ratios (the
#   runs of one round follow each other within a minute, on the same Redis).
#
# --redis-deadline is 1 s, not the default 20 ms: with 64 requests in flight on 2 cores a
# Redis call waits for a CPU for longer than 20 ms now and then (the other processes
# hold both), and each call past its deadline is then decided by the rule's failure mode
# (fail open: admitted) and a sync call past it is sent again an interval later, neither
# of which is what this benchmark measures. Store errors, fallbacks and sync failures
# are still counted and shown ("store errors" column) and warned about.
#
# On 2 cores with INSTANCES instances, Redis and wrk, the fleet is CPU-bound on the
# instances and the client: its decisions/s cannot show what Redis could carry, which is
# what the Redis-per-decision figures are for. With 1000 keys, a key's rate on one
# instance is a few per second, below one per lease_period: leases are a unit each (a
# cold key costs a call per decision, as lease.rs says), so leased costs what exact does.
#
# Then tools/bench-scale-curve.sh (unless CURVE=0): the error curve, over- and
# under-admission against lease_period and sync_interval (10 to 1000 ms) on a simulated
# clock, as a table and OUT/curve.csv, OUT/curve.svg.
#
# A full default run takes about 15 minutes (8 for the fleet, 7 for the curve).
#
# Usage: tools/bench-scale.sh
# Environment (optional): ROUNDS (3), DURATION (10: seconds per run), CALIBRATION (5:
#   seconds), MODES ("exact leased synced"), KEYS_LIST ("1 1000"), LOADS ("2 0.5":
#   offered ÷ limit), INSTANCES (4), WORKERS (1: --workers of each instance),
#   CONNECTIONS (16: wrk -c per instance), LEASE_PERIOD (100ms), SYNC_INTERVAL (100ms),
#   REDIS_DEADLINE (1s: --redis-deadline; see above),
#   SERVE_ARGS (more flags for tollgate serve), OUT (target/bench-scale: fleet.csv,
#   instances.csv and the logs), CARGO_TARGET_DIR (where the release build is).
# Needs wrk, redis-server, redis-cli and curl, and the release build of tollgate-server.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${ROUNDS:-3}"
duration="${DURATION:-10}"
duration="${duration%s}"
calibration="${CALIBRATION:-5}"
calibration="${calibration%s}"
read -r -a modes <<<"${MODES:-exact leased synced}"
read -r -a keys_list <<<"${KEYS_LIST:-1 1000}"
read -r -a loads <<<"${LOADS:-2 0.5}"
instances="${INSTANCES:-4}"
workers="${WORKERS:-1}"
connections="${CONNECTIONS:-16}"
lease_period="${LEASE_PERIOD:-100ms}"
sync_interval="${SYNC_INTERVAL:-100ms}"
redis_deadline="${REDIS_DEADLINE:-1s}"
read -r -a serve_args <<<"${SERVE_ARGS:-}"
out="${OUT:-$root/target/bench-scale}"
bin="${CARGO_TARGET_DIR:-$root/target}/release"
lua="$root/tools/wrk-check.lua"

bench_name=bench-scale
# shellcheck source=tools/lib.sh
source "$root/tools/lib.sh"

for tool in wrk redis-server redis-cli curl; do
  command -v "$tool" >/dev/null ||
    die "$tool is required (Debian: apt-get install wrk redis-server redis-tools curl)"
done
[[ -x "$bin/tollgate" ]] ||
  die "no release build at $bin/tollgate; build it first: cargo build --release -p tollgate-server (with the same CARGO_TARGET_DIR as here)"
if [[ -n "$(find "$root/crates" -name '*.rs' -newer "$bin/tollgate" -print -quit)" ]]; then
  log "$bench_name: warning: sources are newer than $bin/tollgate (cargo build --release -p tollgate-server)"
fi
[[ "$duration" =~ ^[0-9]+$ && "$duration" -ge 2 ]] || die "DURATION must be whole seconds, at least 2"
[[ "$calibration" =~ ^[0-9]+$ && "$calibration" -ge 1 ]] || die "CALIBRATION must be whole seconds"
[[ "$rounds" =~ ^[0-9]+$ && "$rounds" -ge 1 ]] || die "ROUNDS must be a positive integer"
[[ "$instances" =~ ^[0-9]+$ && "$instances" -ge 1 ]] || die "INSTANCES must be a positive integer"
for m in "${modes[@]}"; do
  [[ "$m" =~ ^(exact|leased|synced)$ ]] || die "unknown mode '$m' in MODES (exact, leased, synced)"
done
for k in "${keys_list[@]}"; do
  [[ "$k" =~ ^[0-9]+$ && "$k" -ge 1 ]] || die "KEYS_LIST holds key counts (positive integers), not '$k'"
done
for l in "${loads[@]}"; do
  [[ "$l" =~ ^[0-9]*\.?[0-9]+$ ]] || die "LOADS holds positive numbers, not '$l'"
done

mkdir -p "$out"
for ((i = 0; i < instances; i++)); do : >"$out/server-$i.log"; done
work="$(mktemp -d)"
redis_pid=""
fleet_pids=()
wrk_pids=()
stop_fleet() {
  local p
  for p in "${fleet_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${fleet_pids[@]}"; do wait "$p" 2>/dev/null || true; done
  fleet_pids=()
}
cleanup() {
  local p
  # (each wrk runs in a subshell of ours, which `times` it: stop wrk, then the subshell)
  for p in "${wrk_pids[@]}"; do pkill -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  stop_fleet
  [[ -z "$redis_pid" ]] || { kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; }
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_redis "$work" "$out/redis.log"

# Script calls Redis has run so far (commands run inside the scripts are not counted).
script_calls() {
  redis-cli -p "$redis_port" INFO commandstats | tr -d '\r' |
    sed -nE 's/^cmdstat_(fcall|fcall_ro|evalsha|evalsha_ro|eval|eval_ro):calls=([0-9]+),.*/\2/p' |
    awk '{ s += $1 } END { printf "%.0f", s }'
}

# Starts tollgate serve on RULES_DIR as instance I; prints "pid http_port". Tries new
# ports if the server exits (a port taken between free_port and its bind).
serve() {
  local rules="$1" i="$2" grpc http pid code
  for _ in 1 2 3; do
    grpc="$(free_port)"; http="$(free_port)"
    [[ "$grpc" != "$http" ]] || continue
    TOLLGATE_LOG=warn "$bin/tollgate" serve --config "$rules" --store "$redis_url" \
      --workers "$workers" --redis-deadline "$redis_deadline" --grpc-listen "127.0.0.1:$grpc" --http-listen "127.0.0.1:$http" \
      "${serve_args[@]}" >>"$out/server-$i.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do
      kill -0 "$pid" 2>/dev/null || break
      code="$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$http/readyz" || true)"
      [[ "$code" == "200" ]] && { echo "$pid $http"; return 0; }
      sleep 0.1
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  tail -20 "$out/server-$i.log" >&2
  log "tollgate serve did not become ready"
  return 1
}

http_ports=()
start_fleet() {
  local rules="$1" i started pid http
  stop_fleet
  http_ports=()
  for ((i = 0; i < instances; i++)); do
    # (`die` inside the command substitution would end only its subshell.)
    started="$(serve "$rules" "$i")" || die "cannot start instance $i (see $out/server-$i.log)"
    read -r pid http <<<"$started"
    fleet_pids+=("$pid")
    http_ports+=("$http")
  done
}

# The fleet's /metrics counters that matter here, summed over the instances, in a
# fixed order (see metric_names).
metric_names=(tollgate_redis_calls_total tollgate_leases_total tollgate_leased_units_total
  tollgate_leased_units_expired_total tollgate_leases_refused_total
  'tollgate_local_decisions_total{consistency="leased"}'
  'tollgate_local_decisions_total{consistency="synced"}'
  tollgate_sync_calls_total tollgate_sync_failures_total tollgate_store_errors_total
  tollgate_store_fallbacks_total)
fleet_metrics() {
  local port
  for port in "${http_ports[@]}"; do
    curl -s "http://127.0.0.1:$port/metrics" || true
  done | awk -v names="${metric_names[*]}" '
    BEGIN { n = split(names, order, " ") }
    /^#/ { next }
    {
      name = $1
      # A counter with labels other than the consistency is summed over them.
      if (name !~ /^tollgate_local_decisions_total/) sub(/\{.*/, "", name)
      v[name] += $NF
    }
    END { for (i = 1; i <= n; i++) printf "%.0f ", v[order[i]] + 0; print "" }'
}

fleet_cpu() {
  local p s=0
  for p in "${fleet_pids[@]}"; do s=$((s + $(cpu_ns "$p"))); done
  echo "$s"
}

# Machine CPU jiffies so far: "busy total" (busy: all but idle and iowait).
machine_jiffies() { awk '/^cpu / { t = 0; for (i = 2; i <= NF; i++) t += $i; print t - $5 - $6, t; exit }' /proc/stat; }

# Sleeps until 50 ms after the next second boundary (fixed windows start on them).
align_to_second() {
  local ns ms
  ns="$(now_ns)"
  ms=$(((1000000000 - ns % 1000000000 + 50000000) / 1000000))
  sleep "$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))"
}

# One wrk per instance on DOMAIN with KEYS keys for SECONDS; their outputs in
# $work/wrk-I.out, each ending with `times` (wrk's user and system CPU).
run_wrk() {
  local domain="$1" keys="$2" seconds="$3" i
  wrk_pids=()
  for ((i = 0; i < instances; i++)); do
    (
      wrk -t1 -c"$connections" -d"${seconds}s" --latency -s "$lua" \
        "http://127.0.0.1:${http_ports[$i]}" -- "$domain" "$keys"
      times
    ) >"$work/wrk-$i.out" 2>&1 &
    wrk_pids+=("$!")
  done
  for i in "${wrk_pids[@]}"; do wait "$i" || true; done
  wrk_pids=()
}

# One line of figures from a wrk output: requests elapsed_s p99_us non2xx socket_errors
# ok limited other first_other wrk_cpu_s. Any field wrk did not print is 0 (or -).
parse_wrk() {
  awk '
    function secs(x) {
      if (x ~ /ms$/) return x / 1000; if (x ~ /us$/) return x / 1e6
      if (x ~ /m$/) return x * 60; return x + 0 }
    function us(x) {
      if (x ~ /us$/) return x + 0; if (x ~ /ms$/) return x * 1000
      if (x ~ /s$/) return x * 1e6; return x + 0 }
    function mins(x,  p) { split(x, p, "m"); return p[1] * 60 + p[2] }
    / requests in / { req = $1; el = $4; sub(/,$/, "", el); el = secs(el) }
    /^ +99% / { p99 = us($2) }
    /Non-2xx or 3xx responses:/ { non = $NF }
    /Socket errors:/ { gsub(/,/, ""); serr = $4 + $6 + $8 + $10 }
    /^STATUS / { for (i = 2; i <= NF; i++) { split($i, kv, "="); st[kv[1]] = kv[2] } }
    /^[0-9]+m[0-9.]+s [0-9]+m[0-9.]+s$/ { tl++; if (tl == 2) cpu = mins($1) + mins($2) }
    END {
      printf "%d %.3f %.0f %d %d %d %d %d %s %.3f\n", req, el, p99, non, serr,
        st["ok"], st["limited"], st["other"], (st["first_other"] == "" ? "-" : st["first_other"]), cpu
    }' "$1"
}

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ a[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

csv="$out/fleet.csv"
icsv="$out/instances.csv"
echo "round,keys,load,mode,limit_per_key,decisions,elapsed_s,fleet_dps,instance_dps_median,p99_us_median,admitted,non2xx,status_other,first_other,socket_errors,windows_touched,admitted_per_limit_window,offered_per_limit,over,redis_calls,redis_calls_per_decision,server_cpu_ns,server_cpu_us_per_decision,redis_cpu_ns,redis_cpu_us_per_decision,wrk_cpu_s,wrk_cpu_us_per_decision,machine_busy_pct,steal_pct,tg_redis_calls,leases,leased_units,leased_units_expired,leases_refused,local_leased,local_synced,sync_calls,sync_failures,store_errors,store_fallbacks" >"$csv"
echo "round,keys,load,mode,instance,requests,elapsed_s,dps,p99_us,non2xx,socket_errors,ok,limited,other,first_other,server_cpu_ns,wrk_cpu_s" >"$icsv"

# Domain of MODE at the I-th load.
domain_of() { echo "${1}_l$2"; }

# Runs MODE's domain at load index LI with KEYS keys; appends to the CSVs.
# Args: round keys load_index mode limit
measure() {
  local round="$1" keys="$2" li="$3" mode="$4" limit="$5" load="${loads[$3]}"
  local i c0 c1 r0 r1 t0 t1 s0 j0 s1 j1 b0 b1 bt0 bt1 flag=""
  local -a tg0 tg1 ic0 ic1
  for ((i = 0; i < instances; i++)); do ic0[i]="$(cpu_ns "${fleet_pids[$i]}")"; done
  read -r -a tg0 <<<"$(fleet_metrics)"
  c0="$(script_calls)"; r0="$(cpu_ns "$redis_pid")"
  align_to_second
  read -r s0 j0 <<<"$(steal_jiffies)"; read -r b0 bt0 <<<"$(machine_jiffies)"
  t0="$(now_ns)"
  run_wrk "$(domain_of "$mode" "$li")" "$keys" "$duration"
  t1="$(now_ns)"
  read -r s1 j1 <<<"$(steal_jiffies)"; read -r b1 bt1 <<<"$(machine_jiffies)"
  r1="$(cpu_ns "$redis_pid")"; c1="$(script_calls)"
  read -r -a tg1 <<<"$(fleet_metrics)"
  for ((i = 0; i < instances; i++)); do ic1[i]="$(cpu_ns "${fleet_pids[$i]}")"; done
  local req=0 el=0 non=0 serr=0 ok=0 lim=0 other=0 first="-" wcpu=0 server=0 dps_list="" p99_list=""
  local r e p n se o l x f w d
  for ((i = 0; i < instances; i++)); do
    read -r r e p n se o l x f w <<<"$(parse_wrk "$work/wrk-$i.out")"
    if [[ "$r" -eq 0 ]]; then
      log "instance $i: wrk reported no requests:"; cat "$work/wrk-$i.out" >&2
    fi
    d="$(awk -v r="$r" -v e="$e" 'BEGIN { printf "%.1f", (e > 0 ? r / e : 0) }')"
    echo "$round,$keys,$load,$mode,$i,$r,$e,$d,$p,$n,$se,$o,$l,$x,$f,$((ic1[i] - ic0[i])),$w" >>"$icsv"
    req=$((req + r)); non=$((non + n)); serr=$((serr + se)); ok=$((ok + o)); lim=$((lim + l))
    other=$((other + x)); [[ "$first" != "-" ]] || first="$f"
    el="$(awk -v a="$el" -v b="$e" 'BEGIN { print (b > a ? b : a) }')"
    wcpu="$(awk -v a="$wcpu" -v b="$w" 'BEGIN { print a + b }')"
    server=$((server + ic1[i] - ic0[i]))
    dps_list+=" $d"; p99_list+=" $p"
  done
  local admitted=$((req - non))
  ((admitted == ok)) || log "note: $mode: requests − non-2xx = $admitted but the Lua script counted $ok 200s"
  ((other == 0)) || log "WARNING: $mode, $keys keys: $other answers neither 200 nor 429 (first: $first)"
  ((serr == 0)) || log "WARNING: $mode, $keys keys: $serr socket errors"
  local windows=$((t1 / 1000000000 - t0 / 1000000000 + 1))
  local deltas=() k
  for k in "${!tg1[@]}"; do deltas+=($((tg1[k] - tg0[k]))); done
  local busy steal
  busy="$(awk -v a=$((b1 - b0)) -v t=$((bt1 - bt0)) 'BEGIN { printf "%.1f", (t > 0 ? 100 * a / t : 0) }')"
  steal="$(awk -v a=$((s1 - s0)) -v t=$((j1 - j0)) 'BEGIN { printf "%.1f", (t > 0 ? 100 * a / t : 0) }')"
  local fleet dps p99 apl opl over calls cpd scpd rcpd
  read -r fleet dps p99 apl opl over calls cpd scpd rcpd <<<"$(awk -v req="$req" -v el="$el" \
    -v admitted="$admitted" -v limit="$limit" -v keys="$keys" -v windows="$windows" \
    -v calls=$((c1 - c0)) -v server="$server" -v redis=$((r1 - r0)) \
    -v dps="$(median <<<"$dps_list")" -v p99="$(median <<<"$p99_list")" '
    BEGIN {
      n = (req > 0 ? req : 1); s = (el > 0 ? el : 1)
      printf "%.1f %.1f %.0f %.4f %.3f %s %d %.5f %.2f %.2f\n", req / s, dps, p99,
        admitted / (limit * keys * s), req / s / (limit * keys),
        (admitted > limit * keys * windows ? "OVER" : "ok"),
        calls, calls / n, server / 1000 / n, redis / 1000 / n
    }')"
  echo "$round,$keys,$load,$mode,$limit,$req,$el,$fleet,$dps,$p99,$admitted,$non,$other,$first,$serr,$windows,$apl,$opl,$over,$calls,$cpd,$server,$scpd,$((r1 - r0)),$rcpd,$wcpu,$(awk -v w="$wcpu" -v n="$req" 'BEGIN { printf "%.2f", (n > 0 ? w * 1e6 / n : 0) }'),$busy,$steal,$(IFS=,; echo "${deltas[*]}")" >>"$csv"
  [[ "$over" != OVER ]] || flag=" OVER THE LIMIT"
  log "$(printf '  round %s, %4s keys, load %-3s %-6s fleet %8.0f/s, inst %7.0f/s, p99 %6.0f us, admitted/limit/window %s (offered %s)%s, Redis calls/dec %s, CPU us/dec server %s Redis %s, busy %s%%, steal %s%%' \
    "$round" "$keys" "$load" "$mode" "$fleet" "$dps" "$p99" "$apl" "$opl" \
    "$flag" "$cpd" "$scpd" "$rcpd" "$busy" "$steal")"
  if [[ "$over" == OVER && "$mode" != synced ]]; then
    log "WARNING: $mode admitted $admitted > limit $limit × $keys keys × $windows windows touched"
  fi
  local errs=$((deltas[9] + deltas[10] + deltas[8]))
  ((errs == 0)) || log "WARNING: store errors/fallbacks/sync failures: ${deltas[9]}/${deltas[10]}/${deltas[8]}"
}

# Rule files in DIR: one domain per mode and load index, with the limit of KEYS keys.
write_rules() { # DIR KEYS
  local dir="$1" keys="$2" li m extra
  rm -rf "$dir"; mkdir -p "$dir"
  for li in "${!loads[@]}"; do
    for m in exact leased synced; do
      case "$m" in
        exact) extra="consistency: exact" ;;
        leased) extra="consistency: leased"$'\n'"lease_period: $lease_period" ;;
        synced) extra="consistency: synced"$'\n'"sync_interval: $sync_interval" ;;
      esac
      cat >"$dir/$(domain_of "$m" "$li").yaml" <<EOF
domain: $(domain_of "$m" "$li")
$extra
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: ${limits[$keys,$li]}}
EOF
    done
  done
}

started_at="$(now_ns)"
log "$bench_name: $instances instances (--workers $workers) on redis-server :$redis_port; wrk -t1 -c$connections per instance; ${duration}s runs; $rounds rounds; modes ${modes[*]}; keys ${keys_list[*]}; loads ${loads[*]}× the limit"
declare -A limits
for keys in "${keys_list[@]}"; do
  # 1. Calibration: exact mode, a limit nobody reaches.
  rm -rf "$work/calibrate"; mkdir -p "$work/calibrate"
  cat >"$work/calibrate/calibrate.yaml" <<'EOF'
domain: calibrate
consistency: exact
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1000000000}
EOF
  start_fleet "$work/calibrate"
  run_wrk calibrate "$keys" 1 # warm-up: connections, scripts, allocator
  rates=""
  for ((c = 1; c <= 3; c++)); do
    run_wrk calibrate "$keys" "$calibration"
    rate=0
    for ((i = 0; i < instances; i++)); do
      read -r r e _ <<<"$(parse_wrk "$work/wrk-$i.out")"
      rate="$(awk -v a="$rate" -v r="$r" -v e="$e" 'BEGIN { printf "%.1f", a + (e > 0 ? r / e : 0) }')"
    done
    rates+=" $rate"
  done
  rate="$(median <<<"$rates")"
  awk -v r="$rate" 'BEGIN { exit !(r > 0) }' || die "calibration measured no throughput (see $work/wrk-0.out)"
  log "calibration, $keys keys: exact fleet $rate decisions/s (median of$rates)"
  # 2. The limits: offered ≈ LOAD × limit.
  for li in "${!loads[@]}"; do
    limits[$keys,$li]="$(awk -v r="$rate" -v l="${loads[$li]}" -v k="$keys" 'BEGIN { x = int(r / (l * k) + 0.5); print (x < 1 ? 1 : x) }')"
    log "  load ${loads[$li]}×: limit ${limits[$keys,$li]}/s per key"
  done
  write_rules "$work/rules" "$keys"
  start_fleet "$work/rules"
  run_wrk "$(domain_of exact 0)" "$keys" 1 # warm-up
  # 3. The runs.
  for ((round = 1; round <= rounds; round++)); do
    for li in "${!loads[@]}"; do
      for mode in "${modes[@]}"; do
        measure "$round" "$keys" "$li" "$mode" "${limits[$keys,$li]}"
      done
    done
  done
  stop_fleet
done
wall=$((($(now_ns) - started_at) / 1000000000))

# The summary: medians over the rounds, from the CSV.
col() { head -1 "$csv" | tr ',' '\n' | grep -nx "$1" | cut -d: -f1; }
med() { # KEYS LOAD MODE COLUMN
  awk -F, -v k="$1" -v l="$2" -v m="$3" -v c="$(col "$4")" \
    'NR > 1 && $2 == k && $3 == l && $4 == m { printf "%s ", $c }' "$csv" | median
}
sum_col() {
  awk -F, -v k="$1" -v l="$2" -v m="$3" -v c="$(col "$4")" \
    'NR > 1 && $2 == k && $3 == l && $4 == m { s += $c } END { printf "%.0f", s }' "$csv"
}
# Median over rounds of the per-round ratio MODE ÷ exact of COLUMN (INVERT: exact ÷ MODE).
ratio() { # KEYS LOAD MODE COLUMN [invert]
  awk -F, -v k="$1" -v l="$2" -v m="$3" -v c="$(col "$4")" -v inv="${5:-}" '
    NR > 1 && $2 == k && $3 == l && $4 == "exact" { e[$1] = $c }
    NR > 1 && $2 == k && $3 == l && $4 == m { x[$1] = $c }
    END { for (r in x) if ((r in e) && e[r] > 0 && x[r] > 0) printf "%s ", (inv ? e[r] / x[r] : x[r] / e[r]) }' "$csv" | median
}
f0() { awk -v x="$1" 'BEGIN { printf "%.0f", x }'; }
f1() { awk -v x="$1" 'BEGIN { printf "%.1f", x }'; }
f2() { awk -v x="$1" 'BEGIN { printf "%.2f", x }'; }
f3() { awk -v x="$1" 'BEGIN { printf "%.3f", x }'; }

{
  echo
  echo "## tollgate fleet on one Redis ($instances instances × --workers $workers, wrk -t1 -c$connections each, ${duration}s runs, median of $rounds rounds, wall ${wall}s)"
  echo
  echo "| keys | load × limit | limit /s/key | mode | decisions/s per instance | fleet decisions/s | offered ÷ limit | admitted ÷ limit per window | p99 ms | Redis calls / decision | server CPU µs / decision | Redis CPU µs / decision | wrk CPU µs / decision | Redis-bound decisions/s (derived) | non-200/429 | store errors | OVER runs |"
  echo "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for keys in "${keys_list[@]}"; do
    for li in "${!loads[@]}"; do
      load="${loads[$li]}"
      for mode in "${modes[@]}"; do
        rcpu="$(med "$keys" "$load" "$mode" redis_cpu_us_per_decision)"
        overs="$(awk -F, -v k="$keys" -v l="$load" -v m="$mode" -v c="$(col over)" 'NR > 1 && $2 == k && $3 == l && $4 == m && $c == "OVER" { n++ } END { print n + 0 }' "$csv")"
        echo "| $keys | $load | ${limits[$keys,$li]} | $mode | $(f0 "$(med "$keys" "$load" "$mode" instance_dps_median)") | $(f0 "$(med "$keys" "$load" "$mode" fleet_dps)") | $(f2 "$(med "$keys" "$load" "$mode" offered_per_limit)") | $(f3 "$(med "$keys" "$load" "$mode" admitted_per_limit_window)") | $(f2 "$(awk -v x="$(med "$keys" "$load" "$mode" p99_us_median)" 'BEGIN { print x / 1000 }')") | $(f3 "$(med "$keys" "$load" "$mode" redis_calls_per_decision)") | $(f1 "$(med "$keys" "$load" "$mode" server_cpu_us_per_decision)") | $(f2 "$rcpu") | $(f1 "$(med "$keys" "$load" "$mode" wrk_cpu_us_per_decision)") | $(awk -v x="$rcpu" 'BEGIN { printf "%.0f", (x > 0 ? 1e6 / x : 0) }') | $(sum_col "$keys" "$load" "$mode" status_other) | $(($(sum_col "$keys" "$load" "$mode" store_errors) + $(sum_col "$keys" "$load" "$mode" store_fallbacks) + $(sum_col "$keys" "$load" "$mode" sync_failures))) | $overs/$rounds |"
      done
    done
  done
  if [[ " ${modes[*]} " == *" exact "* ]]; then
    echo
    echo "Ratios to exact (median of per-round ratios; target: leased fleet decisions/s ≥ 5× exact):"
    echo
    echo "| keys | load × limit | mode | fleet decisions/s ÷ exact (measured) | exact ÷ mode Redis calls per decision | exact ÷ mode Redis CPU per decision = Redis-bound decisions/s ÷ exact (derived) |"
    echo "|---:|---:|---|---:|---:|---:|"
    for keys in "${keys_list[@]}"; do
      for li in "${!loads[@]}"; do
        load="${loads[$li]}"
        for mode in "${modes[@]}"; do
          [[ "$mode" != exact ]] || continue
          echo "| $keys | $load | $mode | $(f2 "$(ratio "$keys" "$load" "$mode" fleet_dps)") | $(f1 "$(ratio "$keys" "$load" "$mode" redis_calls_per_decision invert)") | $(f1 "$(ratio "$keys" "$load" "$mode" redis_cpu_us_per_decision invert)") |"
        done
      done
    done
  fi
  echo
  echo "Measured: decisions/s (wrk, closed loop; the 2 cores are shared by the instances, Redis and wrk), p99 (wrk --latency, median of the instances), Redis calls (INFO commandstats: fcall/evalsha/eval), CPU (schedstat of the processes). Derived: Redis-bound decisions/s = 1 s ÷ Redis CPU per decision. admitted ÷ limit per window = admitted ÷ (limit × keys × wrk's elapsed seconds): an average over the ~${duration} one-second windows, which wrk cannot see one by one. OVER: admitted > limit × keys × windows touched (${duration} + 1). store errors: store errors + fallbacks + sync failures, summed over the rounds (--redis-deadline $redis_deadline)."
  echo "Raw numbers: $csv (one row per run), $out/instances.csv (one row per instance and run)."
} | tee "$out/summary.md"

# The error curve (over- and under-admission against lease_period and sync_interval, on
# a simulated clock against the same kind of Redis), unless CURVE=0.
if [[ "${CURVE:-1}" != 0 ]]; then
  OUT="$out" bash "$root/tools/bench-scale-curve.sh"
fi
