#!/usr/bin/env bash
# Same-run, fleet-level comparison of Tollgate's scale-out modes with limitador-server
# 2.4.0 (../shared/peers) on its cached Redis storage (`redis_cached`: counters counted
# in each instance's memory and flushed to Redis every --flush-period ms, the
# counterpart of Tollgate's `consistency: synced`), on ONE Redis, under a client neither
# project wrote: nghttp2's h2load, open loop, over Envoy's rate limit gRPC API.
#
# Starts its own redis-server on a free port (--save '' --appendonly no). Then ROUNDS
# rounds; in each, the systems take turns (limitador first in odd rounds, Tollgate first
# in even ones):
#   - limitador: INSTANCES × `limitador-server LIMITS redis_cached redis://… --flush-period
#     FLUSH_PERIOD` (its other redis_cached options at their defaults), one limit
#     (namespace `bench`, `seconds: 1`, `max_value: LIMIT`, one counter per value of the
#     descriptor entry `k`);
#   - Tollgate: INSTANCES × `tollgate serve --store redis://… --workers 1` (release build),
#     one domain per mode of MODES, each with one rule `key: k`, `requests_per_unit:
#     LIMIT` per second (the default algorithm, a fixed window), `consistency: synced`
#     with `sync_interval: SYNC_INTERVAL`, `consistency: leased` with `lease_period:
#     LEASE_PERIOD`, and `consistency: exact` (for reference); one run per mode.
# Each run: one hot key (the value `k=vROUND`, new in each round), one h2load per
# instance (-c 1 -m STREAMS --rps LOAD × LIMIT ÷ INSTANCES -D DURATION s + 600 ms), all
# started together 200 ms after a second boundary, so the fleet is offered LOAD × LIMIT
# calls/s (2× by default). LIMIT is small enough (default 2000/s: the fleet offered
# 4000/s) that the 2 cores are not saturated: the comparison is about accuracy and the
# cost in Redis, not about throughput.
#
# Per run it reads, before and after:
# - each server's answers: Tollgate's /metrics tollgate_within_limit_total and
#   tollgate_over_limit_total (of the run's domain), limitador's /metrics authorized_calls
#   and limited_calls (namespace bench). h2load sees only HTTP statuses (every gRPC answer
#   is a 200), so admitted (OK) and limited (OVER_LIMIT) come from these; calls that h2load
#   saw succeed but neither counter counted are reported ("unaccounted");
# - Redis: INFO commandstats, every command (INFO itself, which this script sends, left
#   out). Redis counts the commands a script runs as well as the script call, so two
#   figures: "Redis commands" (all of them) and "Redis requests" (what the clients sent:
#   script calls and plain commands; the commands the system's own Lua scripts run, listed
#   in inner_commands below, left out). Per run the command counts are kept in the CSV;
#   Redis CPU from /proc/PID/task/*/schedstat;
# - the servers' CPU (schedstat, summed over the instances) and h2load's (user + system).
#
# The figures (medians over the rounds):
# - decisions/s: the calls h2load saw answered ÷ its elapsed time, summed over the clients;
# - admitted per window: admitted ÷ the windows touched (DURATION + 1: see below);
# - over-admission, % of L: (admitted − ideal) ÷ ideal, where ideal is what an exact
#   limiter with the same windows admits at the offered rate: Σ over the windows touched
#   of min(LIMIT, rate × the run's time in that window). Tollgate's fixed windows start on
#   second boundaries, so a run from 200 ms after one, DURATION s + 600 ms long, touches
#   DURATION + 1 windows, 800 ms of the first and of the last; limitador's window starts
#   with a counter's first hit (the Redis key's TTL is set by the first flush of it), so
#   its windows are counted from the run's start: DURATION full ones and 600 ms. At 2× the
#   limit every partial window sees more than the limit (1.6 L, 1.2 L), so ideal =
#   (DURATION + 1) × LIMIT for both, and a start a few ms late (processes starting,
#   connecting) changes nothing. Averaged over the windows, not per window: a mode that
#   over-admits in some windows and under-admits in others shows the difference only;
# - OVER: admitted > LIMIT × windows touched (the hard bound of a fixed window);
# - Redis requests / commands / CPU per decision, server and h2load CPU per decision:
#   per decision the servers counted (admitted + limited; h2load leaves out the few calls
#   in flight when its DURATION ends: "unaccounted" is h2load's answers minus the
#   servers' decisions, slightly negative, up to −INSTANCES × STREAMS, as it should be).
#
# Usage: tools/bench-scale-vs-limitador.sh
# Environment (optional): ROUNDS (3), DURATION (10: seconds per run), LIMIT (2000: per
#   second), LOAD (2: offered ÷ limit), INSTANCES (4), STREAMS (32: h2load -m, in flight
#   per client at most), MODES ("synced leased exact": Tollgate's modes to run),
#   FLUSH_PERIOD (100: limitador's --flush-period, ms), SYNC_INTERVAL (100ms),
#   LEASE_PERIOD (100ms), REDIS_DEADLINE (1s: tollgate's --redis-deadline, as in
#   tools/bench-scale.sh), SYSTEMS ("limitador tollgate": either may be left out),
#   LIMITADOR (../shared/peers/limitador-server), OUT
#   (target/bench-scale-vs-limitador: runs.csv, summary.md, the logs), CARGO_TARGET_DIR.
# Needs h2load, redis-server, redis-cli, curl, /usr/bin/time, and the release build of
# tollgate-server (cargo build --release -p tollgate-server).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${ROUNDS:-3}"
duration="${DURATION:-10}"
duration="${duration%s}"
limit="${LIMIT:-2000}"
load="${LOAD:-2}"
instances="${INSTANCES:-4}"
streams="${STREAMS:-32}"
read -r -a modes <<<"${MODES:-synced leased exact}"
read -r -a run_systems <<<"${SYSTEMS:-limitador tollgate}"
flush_period="${FLUSH_PERIOD:-100}"
sync_interval="${SYNC_INTERVAL:-100ms}"
lease_period="${LEASE_PERIOD:-100ms}"
redis_deadline="${REDIS_DEADLINE:-1s}"
limitador="${LIMITADOR:-$root/../shared/peers/limitador-server}"
out="${OUT:-$root/target/bench-scale-vs-limitador}"
bin="${CARGO_TARGET_DIR:-$root/target}/release"
path=/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit

bench_name=bench-scale-vs-limitador
# shellcheck source=tools/lib.sh
source "$root/tools/lib.sh"

for tool in h2load redis-server redis-cli curl /usr/bin/time; do
  command -v "$tool" >/dev/null ||
    die "$tool is required (Debian: apt-get install nghttp2-client redis-server redis-tools curl time)"
done
for s in "${run_systems[@]}"; do
  [[ "$s" =~ ^(limitador|tollgate)$ ]] || die "unknown system '$s' in SYSTEMS (limitador, tollgate)"
done
with() { [[ " ${run_systems[*]} " == *" $1 "* ]]; }
if with limitador; then
  [[ -x "$limitador" ]] || die "limitador-server not found at $limitador (set LIMITADOR)"
fi
if with tollgate; then
  [[ -x "$bin/tollgate" ]] ||
    die "no release build at $bin/tollgate; build it first: cargo build --release -p tollgate-server (with the same CARGO_TARGET_DIR as here)"
  if [[ -n "$(find "$root/crates" -name '*.rs' -newer "$bin/tollgate" -print -quit)" ]]; then
    log "$bench_name: warning: sources are newer than $bin/tollgate (cargo build --release -p tollgate-server)"
  fi
fi
[[ "$duration" =~ ^[0-9]+$ && "$duration" -ge 2 ]] || die "DURATION must be whole seconds, at least 2"
[[ "$rounds" =~ ^[0-9]+$ && "$rounds" -ge 1 ]] || die "ROUNDS must be a positive integer"
[[ "$instances" =~ ^[0-9]+$ && "$instances" -ge 1 ]] || die "INSTANCES must be a positive integer"
[[ "$limit" =~ ^[0-9]+$ && "$limit" -ge 1 ]] || die "LIMIT must be a positive integer"
[[ "$streams" =~ ^[0-9]+$ && "$streams" -ge 1 ]] || die "STREAMS must be a positive integer"
[[ "$flush_period" =~ ^[0-9]+$ && "$flush_period" -ge 1 ]] || die "FLUSH_PERIOD is in milliseconds (an integer)"
[[ "$load" =~ ^[0-9]*\.?[0-9]+$ ]] || die "LOAD must be a positive number"
for m in "${modes[@]}"; do
  [[ "$m" =~ ^(exact|leased|synced)$ ]] || die "unknown mode '$m' in MODES (exact, leased, synced)"
done
# h2load's --rps per client: the fleet is offered LOAD × LIMIT per second.
rps="$(awk -v l="$limit" -v x="$load" -v n="$instances" 'BEGIN { r = int(l * x / n + 0.5); print (r < 1 ? 1 : r) }')"

# The commands each system's own Lua scripts run inside Redis (counted by INFO
# commandstats besides the script call itself): left out of "Redis requests".
# limitador 2.4.0: its scripts' redis.call()s (strings in the binary); Tollgate: those of
# crates/tollgate/src/store/redis/lua (its clients send FCALL/EVALSHA and, rarely, PING,
# FUNCTION and INFO).
declare -A inner_commands=(
  [limitador]="incrby expire sadd srem get pttl pexpiretime"
  [tollgate]="get set setrange del mget pexpire pttl time zadd zcard zremrangebyscore zscore lindex llen lpop lpush lrange lrem lset rpop rpush"
)

mkdir -p "$out"
work="$(mktemp -d)"
redis_pid=""
fleet_pids=()
client_pids=()
stop_fleet() {
  local p
  for p in "${fleet_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${fleet_pids[@]}"; do wait "$p" 2>/dev/null || true; done
  fleet_pids=()
}
cleanup() {
  local p
  # (each h2load runs under /usr/bin/time in a subshell of ours: stop its children, then it)
  for p in "${client_pids[@]}"; do pkill -P "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  stop_fleet
  [[ -z "$redis_pid" ]] || { kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; }
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start_redis "$work" "$out/redis.log"

# Redis's command counts so far, "name calls" a line (INFO left out: this script's own).
command_counts() {
  redis-cli -p "$redis_port" INFO commandstats | tr -d '\r' |
    sed -nE 's/^cmdstat_([^:]+):calls=([0-9]+),.*/\1 \2/p' | grep -v '^info ' || true
}
# Deltas of two command_counts files for SYSTEM: "all requests breakdown" (breakdown:
# name=calls;… of the commands that changed).
command_deltas() { # BEFORE AFTER SYSTEM
  awk -v inner="${inner_commands[$3]}" '
    BEGIN { n = split(inner, a, " "); for (i = 1; i <= n; i++) in_script[a[i]] = 1 }
    FNR == NR { b[$1] = $2; next }
    { d = $2 - b[$1]; if (d <= 0) next
      all += d; if (!($1 in in_script)) req += d
      br = br (br == "" ? "" : ";") $1 "=" d }
    END { printf "%.0f %.0f %s\n", all, req, (br == "" ? "-" : br) }' "$1" "$2"
}

# The gRPC frame of one ShouldRateLimit call (uncompressed, 4-byte length): RateLimitRequest
# {domain: DOMAIN, descriptors: [{entries: [{key: "k", value: VALUE}]}], hits_addend: 1}.
# (Every length fits one byte of varint: DOMAIN and VALUE are short.)
call_bin() { # DOMAIN VALUE FILE
  local d="$1" v="$2" entry desc total
  entry=$((2 + 1 + 2 + ${#v}))
  desc=$((2 + entry))
  total=$((2 + ${#d} + 2 + desc + 2))
  # shellcheck disable=SC2059 # the format is built here on purpose (\x escapes)
  printf "\\x00\\x00\\x00\\x00\\x$(printf %02x "$total")\\x0a\\x$(printf %02x "${#d}")%s\\x12\\x$(printf %02x "$desc")\\x0a\\x$(printf %02x "$entry")\\x0a\\x01k\\x12\\x$(printf %02x "${#v}")%s\\x18\\x01" \
    "$d" "$v" >"$3"
}

# Tollgate's rules: one domain per mode, each with LIMIT per second on the key k.
mkdir -p "$work/rules"
for m in exact leased synced; do
  case "$m" in
    exact) extra="consistency: exact" ;;
    leased) extra="consistency: leased"$'\n'"lease_period: $lease_period" ;;
    synced) extra="consistency: synced"$'\n'"sync_interval: $sync_interval" ;;
  esac
  cat >"$work/rules/$m.yaml" <<EOF
domain: $m
$extra
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: $limit}
EOF
done
# limitador's limit: the same, in its namespace bench.
cat >"$work/limits.yaml" <<EOF
- namespace: bench
  max_value: $limit
  seconds: 1
  conditions: []
  variables: ["descriptors[0].k"]
EOF

grpc_ports=()
http_ports=()
# Starts instance I of SYSTEM (limitador | tollgate); prints "pid grpc_port http_port".
# Tries new ports if the server exits (a port taken between free_port and its bind).
start_one() { # SYSTEM I
  local system="$1" i="$2" grpc http pid code url
  for _ in 1 2 3; do
    grpc="$(free_port)"; http="$(free_port)"
    [[ "$grpc" != "$http" ]] || continue
    if [[ "$system" == limitador ]]; then
      RUST_LOG=warn "$limitador" -b 127.0.0.1 -p "$grpc" -B 127.0.0.1 -P "$http" "$work/limits.yaml" \
        redis_cached "$redis_url" --flush-period "$flush_period" >>"$out/limitador-$i.log" 2>&1 &
      url="http://127.0.0.1:$http/status"
    else
      TOLLGATE_LOG=warn "$bin/tollgate" serve --config "$work/rules" --store "$redis_url" \
        --workers 1 --redis-deadline "$redis_deadline" \
        --grpc-listen "127.0.0.1:$grpc" --http-listen "127.0.0.1:$http" >>"$out/tollgate-$i.log" 2>&1 &
      url="http://127.0.0.1:$http/readyz"
    fi
    pid=$!
    for _ in $(seq 1 300); do
      kill -0 "$pid" 2>/dev/null || break
      code="$(curl -s -o /dev/null -w '%{http_code}' "$url" || true)"
      [[ "$code" == "200" ]] && { echo "$pid $grpc $http"; return 0; }
      sleep 0.1
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  tail -20 "$out/$system-$i.log" >&2
  log "$system instance $i did not become ready"
  return 1
}
start_fleet() { # SYSTEM
  local i started pid grpc http
  stop_fleet
  grpc_ports=(); http_ports=()
  for ((i = 0; i < instances; i++)); do
    # (`die` inside the command substitution would end only its subshell.)
    started="$(start_one "$1" "$i")" || die "cannot start $1 instance $i (see $out/$1-$i.log)"
    read -r pid grpc http <<<"$started"
    fleet_pids+=("$pid"); grpc_ports+=("$grpc"); http_ports+=("$http")
  done
}

# "admitted limited" summed over the fleet, from the servers' /metrics.
answers() { # SYSTEM DOMAIN
  local port
  for port in "${http_ports[@]}"; do
    curl -s "http://127.0.0.1:$port/metrics" || true
  done | awk -v sys="$1" -v dom="$2" '
    /^#/ { next }
    sys == "limitador" && /^authorized_calls\{/ && index($0, "limitador_namespace=\"" dom "\"") { ok += $NF }
    sys == "limitador" && /^limited_calls\{/ && index($0, "limitador_namespace=\"" dom "\"") { lim += $NF }
    sys == "tollgate" && /^tollgate_within_limit_total\{/ && index($0, "domain=\"" dom "\"") { ok += $NF }
    sys == "tollgate" && /^tollgate_over_limit_total\{/ && index($0, "domain=\"" dom "\"") { lim += $NF }
    END { printf "%.0f %.0f\n", ok, lim }'
}

# Tollgate's store troubles, summed over the fleet (errors, fallbacks, sync failures).
tollgate_errors() {
  local port
  for port in "${http_ports[@]}"; do
    curl -s "http://127.0.0.1:$port/metrics" || true
  done | awk '/^tollgate_(store_errors|store_fallbacks|sync_failures)_total/ { s += $NF } END { printf "%.0f\n", s }'
}

fleet_cpu() {
  local p s=0
  for p in "${fleet_pids[@]}"; do s=$((s + $(cpu_ns "$p"))); done
  echo "$s"
}

# Sleeps until 200 ms after the next second boundary (Tollgate's fixed windows start on them).
align_to_second() {
  local ns ms
  ns="$(now_ns)"
  ms=$(((1000000000 - ns % 1000000000 + 200000000) / 1000000))
  sleep "$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))"
}

# One h2load per instance with the call in FILE for DURATION s + 600 ms; outputs in
# $work/h2load-I.out, its CPU in $work/h2load-I.time.
run_clients() { # FILE
  local i
  client_pids=()
  for ((i = 0; i < instances; i++)); do
    /usr/bin/time -f 'client-cpu %U %S' -o "$work/h2load-$i.time" \
      h2load -c 1 -t 1 -m "$streams" --rps "$rps" -D "$((duration * 1000 + 600))ms" -d "$1" \
      -H 'content-type: application/grpc' -H 'te: trailers' \
      "http://127.0.0.1:${grpc_ports[$i]}$path" >"$work/h2load-$i.out" 2>&1 &
    client_pids+=("$!")
  done
  for i in "${client_pids[@]}"; do wait "$i" || true; done
  client_pids=()
}

# "succeeded failed elapsed_s mean_ms cpu_s" of one h2load output.
parse_h2load() { # I
  awk '
    function secs(x) {
      if (x ~ /ms$/) return x / 1000; if (x ~ /us$/) return x / 1e6; return x + 0 }
    function ms(x) {
      if (x ~ /us$/) return x / 1000; if (x ~ /ms$/) return x + 0; if (x ~ /s$/) return x * 1000; return x + 0 }
    /^finished in / { el = $3; sub(/,$/, "", el); el = secs(el) }
    /^requests: / { ok = $8; fail = $10 + $12 + $14 }
    /^time for request:/ { mean = ms($6) }
    /^client-cpu / { cpu = $2 + $3 }
    END { printf "%d %d %.3f %.3f %.3f\n", ok, fail, el, mean, cpu }' "$work/h2load-$1.out" "$work/h2load-$1.time"
}

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{ a[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

csv="$out/runs.csv"
echo "round,system,mode,limit,offered_rps_per_client,succeeded,failed,elapsed_s,decisions_per_s,offered_per_limit,admitted,limited,unaccounted,windows,ideal,admitted_per_limit_s,admitted_per_window,over_admission_pct,over,redis_commands,redis_requests,redis_commands_per_decision,redis_requests_per_decision,redis_cpu_ns,redis_cpu_us_per_decision,server_cpu_ns,server_cpu_us_per_decision,client_cpu_s,client_cpu_us_per_decision,mean_ms_median,store_errors,commands" >"$csv"

# One run of SYSTEM (MODE: Tollgate's, or redis_cached) in round ROUND; appends to the CSV.
measure() { # ROUND SYSTEM MODE
  local round="$1" system="$2" mode="$3" domain call
  if [[ "$system" == limitador ]]; then domain=bench; else domain="$mode"; fi
  call="$work/call-$system-$mode-$round.bin"
  call_bin "$domain" "v$round" "$call"
  local ok0 lim0 ok1 lim1 c0 c1 r0 r1 t0 e0=0 e1=0
  read -r ok0 lim0 <<<"$(answers "$system" "$domain")"
  [[ "$system" != tollgate ]] || e0="$(tollgate_errors)"
  command_counts >"$work/cmd0"
  c0="$(fleet_cpu)"; r0="$(cpu_ns "$redis_pid")"
  align_to_second
  t0="$(now_ns)"
  run_clients "$call"
  r1="$(cpu_ns "$redis_pid")"; c1="$(fleet_cpu)"
  command_counts >"$work/cmd1"
  # (limitador's last counts may still be waiting for their flush: the answers are
  # counted when given, so they are read at once; the Redis figures include one more
  # flush at most.)
  read -r ok1 lim1 <<<"$(answers "$system" "$domain")"
  [[ "$system" != tollgate ]] || e1="$(tollgate_errors)"
  local i s f el mean cpu succ=0 failed=0 elmax=0 dps=0 ccpu=0 means=""
  for ((i = 0; i < instances; i++)); do
    read -r s f el mean cpu <<<"$(parse_h2load "$i")"
    ((s > 0)) || { log "$system $mode: h2load $i answered nothing:"; cat "$work/h2load-$i.out" >&2; }
    succ=$((succ + s)); failed=$((failed + f))
    read -r elmax dps ccpu <<<"$(awk -v a="$elmax" -v e="$el" -v d="$dps" -v s="$s" -v c="$ccpu" -v x="$cpu" \
      'BEGIN { printf "%.3f %.1f %.3f\n", (e > a ? e : a), d + (e > 0 ? s / e : 0), c + x }')"
    means+=" $mean"
  done
  ((failed == 0)) || log "WARNING: $system $mode: h2load counted $failed failed/errored/timed-out calls"
  local admitted=$((ok1 - ok0)) limited=$((lim1 - lim0)) unaccounted
  unaccounted=$((succ - admitted - limited))
  # (h2load leaves out the calls still in flight when its DURATION ends, which the
  # servers have counted: up to INSTANCES × STREAMS fewer than the servers'.)
  if ((unaccounted > 0 || unaccounted < -instances * streams)); then
    log "WARNING: $system $mode: h2load saw $succ answers, the servers counted $((admitted + limited)) decisions"
  fi
  local errs=$((e1 - e0))
  ((errs == 0)) || log "WARNING: $system $mode: $errs store errors/fallbacks/sync failures"
  local all req breakdown
  read -r all req breakdown <<<"$(command_deltas "$work/cmd0" "$work/cmd1" "$system")"
  # Windows touched and the ideal admission: Tollgate's windows start on second
  # boundaries; limitador's at the run's start (a counter's first hit).
  local line
  line="$(awk -v t0="$t0" -v el="$elmax" -v rate="$dps" -v L="$limit" -v sys="$system" \
    -v admitted="$admitted" -v decided=$((admitted + limited)) -v all="$all" -v req="$req" \
    -v rcpu=$((r1 - r0)) -v scpu=$((c1 - c0)) -v ccpu="$ccpu" '
    BEGIN {
      s = t0 / 1e9; e = s + el
      if (sys == "limitador") base = s; else base = int(s)
      w = 0; ideal = 0
      for (a = base; a < e; a += 1) {
        lo = (a > s ? a : s); hi = (a + 1 < e ? a + 1 : e)
        ov = hi - lo; if (ov <= 0) continue
        w++; x = rate * ov; ideal += (x < L ? x : L)
      }
      n = (decided > 0 ? decided : 1)
      printf "%d %.0f %.4f %.1f %.2f %s %.3f %.3f %.2f %.2f %.2f %.3f",
        w, ideal, admitted / (L * (el > 0 ? el : 1)), admitted / (w > 0 ? w : 1), 100 * (admitted - ideal) / (ideal > 0 ? ideal : 1),
        (admitted > L * w ? "OVER" : "ok"), all / n, req / n, rcpu / 1000 / n, scpu / 1000 / n,
        ccpu * 1e6 / n, rate / L
    }')"
  local windows ideal apl apw overpct over cpd rpd rcpd scpd ccpd opl flag=""
  read -r windows ideal apl apw overpct over cpd rpd rcpd scpd ccpd opl <<<"$line"
  [[ "$over" != OVER ]] || flag=" OVER"
  echo "$round,$system,$mode,$limit,$rps,$succ,$failed,$elmax,$dps,$opl,$admitted,$limited,$unaccounted,$windows,$ideal,$apl,$apw,$overpct,$over,$all,$req,$cpd,$rpd,$((r1 - r0)),$rcpd,$((c1 - c0)),$scpd,$ccpu,$ccpd,$(median <<<"$means"),$errs,$breakdown" >>"$csv"
  log "$(printf '  round %s %-9s %-12s %7.0f dec/s (offered %s L), admitted %6d (ideal %6d over %s windows: %+6.2f %%)%s, limited %6d, Redis req/cmd per dec %s/%s, CPU us/dec Redis %s server %s h2load %s' \
    "$round" "$system" "$mode" "$dps" "$opl" "$admitted" "$ideal" "$windows" "$overpct" \
    "$flag" "$limited" "$rpd" "$cpd" "$rcpd" "$scpd" "$ccpd")"
  log "    Redis commands: $breakdown"
}

run_limitador() { # ROUND
  with limitador || return 0
  start_fleet limitador
  measure "$1" limitador redis_cached
  stop_fleet
}
run_tollgate() { # ROUND
  local m
  with tollgate || return 0
  start_fleet tollgate
  for m in "${modes[@]}"; do measure "$1" tollgate "$m"; done
  stop_fleet
}

started_at="$(now_ns)"
read -r load_before _ </proc/loadavg
log "$bench_name: redis-server :$redis_port; $instances instances per system; limit $limit/s (one hot key, 1 s fixed window); h2load -c 1 -m $streams --rps $rps per instance (fleet offered $load × limit); ${duration}s runs; $rounds rounds"
for ((round = 1; round <= rounds; round++)); do
  if ((round % 2)); then
    run_limitador "$round"; run_tollgate "$round"
  else
    run_tollgate "$round"; run_limitador "$round"
  fi
done
wall=$((($(now_ns) - started_at) / 1000000000))
read -r load_after _ </proc/loadavg

# The summary: medians over the rounds, from the CSV.
col() { head -1 "$csv" | tr ',' '\n' | grep -nx "$1" | cut -d: -f1; }
med() { # SYSTEM MODE COLUMN
  awk -F, -v s="$1" -v m="$2" -v c="$(col "$3")" 'NR > 1 && $2 == s && $3 == m { printf "%s ", $c }' "$csv" | median
}
sum_col() { # SYSTEM MODE COLUMN
  awk -F, -v s="$1" -v m="$2" -v c="$(col "$3")" 'NR > 1 && $2 == s && $3 == m { t += $c } END { printf "%.0f", t }' "$csv"
}
range() { # SYSTEM MODE COLUMN: "min..max"
  awk -F, -v s="$1" -v m="$2" -v c="$(col "$3")" 'NR > 1 && $2 == s && $3 == m {
    if (n++ == 0 || $c < lo) lo = $c; if (n == 1 || $c > hi) hi = $c }
    END { printf "%+.2f..%+.2f", lo, hi }' "$csv"
}
fmt() { awk -v f="$1" -v x="$2" 'BEGIN { printf f, x }'; }

systems=()
! with limitador || systems+=("limitador redis_cached")
if with tollgate; then
  for m in "${modes[@]}"; do systems+=("tollgate $m"); done
fi
{
  echo
  echo "## $instances-instance fleets on one Redis, one hot key, limit $limit/s, offered $load× (h2load open loop), median of $rounds rounds (wall ${wall}s; 1-minute load average $load_before before, $load_after after, on $(nproc) cores)"
  echo
  echo "| system | mode | decisions/s | offered ÷ L | admitted per window (L = $limit) | over-admission % of L (median; min..max) | OVER runs | unaccounted answers | Redis requests / decision | Redis commands / decision | Redis CPU µs / decision | server CPU µs / decision | h2load CPU µs / decision | mean latency ms | store errors |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  for sm in "${systems[@]}"; do
    read -r s m <<<"$sm"
    overs="$(awk -F, -v s="$s" -v m="$m" -v c="$(col over)" 'NR > 1 && $2 == s && $3 == m && $c == "OVER" { n++ } END { print n + 0 }' "$csv")"
    echo "| $s | $m | $(fmt %.0f "$(med "$s" "$m" decisions_per_s)") | $(fmt %.2f "$(med "$s" "$m" offered_per_limit)") | $(fmt %.0f "$(med "$s" "$m" admitted_per_window)") | $(fmt %+.2f "$(med "$s" "$m" over_admission_pct)") ($(range "$s" "$m" over_admission_pct)) | $overs/$rounds | $(sum_col "$s" "$m" unaccounted) | $(fmt %.4f "$(med "$s" "$m" redis_requests_per_decision)") | $(fmt %.4f "$(med "$s" "$m" redis_commands_per_decision)") | $(fmt %.2f "$(med "$s" "$m" redis_cpu_us_per_decision)") | $(fmt %.1f "$(med "$s" "$m" server_cpu_us_per_decision)") | $(fmt %.1f "$(med "$s" "$m" client_cpu_us_per_decision)") | $(fmt %.2f "$(med "$s" "$m" mean_ms_median)") | $(sum_col "$s" "$m" store_errors) |"
  done
  echo
  echo "Measured: decisions/s (h2load's answered calls ÷ its elapsed time, summed over the $instances clients; open loop at --rps $rps each), admitted and limited (the servers' /metrics), Redis commands (INFO commandstats, all; requests: without the commands run inside the systems' Lua scripts) and CPU (schedstat of redis-server, of the $instances servers, and h2load's user + system time). over-admission: (admitted − ideal) ÷ ideal, ideal = Σ over the windows touched of min(L, offered rate × the run's time in it); Tollgate's windows start on second boundaries (runs of ${duration}.6 s start 200 ms after one: $((duration + 1)) windows, 0.8 s of the first and of the last), limitador's at the run's start (${duration} full windows and 0.6 s); at ${load}× every partial window of 0.6 s or more is offered at least 1.2 L, so ideal = $((duration + 1)) × L for both. OVER: admitted > L × windows touched. unaccounted: h2load's answered calls − the servers' decisions (summed over the rounds; slightly negative: h2load leaves out the calls in flight at its end). store errors: Tollgate's store errors + fallbacks + sync failures (--redis-deadline $redis_deadline)."
  echo
  echo "Commands (ports chosen at run time):"
  echo
  echo '```sh'
  echo "redis-server --port REDIS --bind 127.0.0.1 --save '' --appendonly no"
  echo "$limitador -b 127.0.0.1 -p GRPC -B 127.0.0.1 -P HTTP limits.yaml redis_cached redis://127.0.0.1:REDIS --flush-period $flush_period   # × $instances"
  echo "$bin/tollgate serve --config rules/ --store redis://127.0.0.1:REDIS --workers 1 --redis-deadline $redis_deadline --grpc-listen 127.0.0.1:GRPC --http-listen 127.0.0.1:HTTP   # × $instances"
  echo "h2load -c 1 -t 1 -m $streams --rps $rps -D $((duration * 1000 + 600))ms -d call.bin -H 'content-type: application/grpc' -H 'te: trailers' http://127.0.0.1:GRPC$path   # one per instance, together"
  echo '```'
  echo
  echo "limits.yaml (limitador):"
  echo
  echo '```yaml'
  cat "$work/limits.yaml"
  echo '```'
  echo
  echo "Tollgate's rules (one file per mode):"
  echo
  echo '```yaml'
  for m in "${modes[@]}"; do cat "$work/rules/$m.yaml"; echo "---"; done
  echo '```'
  echo
  echo "Raw numbers: $csv (one row per run, with each run's Redis commands by name)."
} | tee "$out/summary.md"
