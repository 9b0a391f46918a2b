#!/usr/bin/env bash
# Benchmarks the gateway's adaptive concurrency (`adaptive_concurrency` on a route of
# `tollgate proxy`): does it keep the latency of admitted requests near the upstream's
# unloaded latency while keeping the upstream busy, and how fast does its limit follow a
# change of the upstream's capacity?
#
# This is a benchmark, not a test: it prints numbers and whether they meet the targets
# below; it fails only if something cannot start or a load run fails.
#
# What it starts (all on 127.0.0.1, free ports, all stopped on exit):
#   upstream  `slow-upstream` (tools/tollgate-load/src/bin/slow-upstream.rs): WORKERS
#             workers (C), each request holding one for SERVICE_MS (S), the rest queued:
#             its capacity is C/S requests per second, whatever the load;
#   tollgate  `tollgate proxy --workers PROXY_WORKERS` (release build; 1 worker thread
#             by default, to leave CPU to the upstream, the clients and whoever else
#             shares this machine) with its admin listener, for `/v1/stats`.
# The load is `adaptive-load` (tools/tollgate-load/src/bin/adaptive-load.rs): CLIENTS
# closed-loop clients, each on its own keep-alive connection, for DURATION seconds; after
# a refusal (503) a client waits SHED_PAUSE_MS before its next request (with 0 they
# retry at once, and on two shared cores the CPU spent refusing them, in the gateway and
# in the clients, is taken from the admitted requests).
#
# Runs, in this order:
#   unloaded  1 client, UNLOADED_DURATION seconds, straight to the upstream: its latency
#             unloaded (p50 is the reference of the latency target);
#   direct    CLIENTS straight to the upstream: the upstream's own queueing, for reference;
#   without   CLIENTS through the gateway, a route without adaptive_concurrency;
#   with      CLIENTS through the gateway, the route with adaptive_concurrency (below);
#             a fresh upstream whose schedule doubles C at DURATION/3 and halves it back
#             at 2*DURATION/3 (10 s and 20 s of 30). Skipped, with a note, by a tollgate
#             that refuses adaptive_concurrency;
#   wrk       the cross-check with a client we did not write: wrk (CLIENTS connections,
#             WRK_THREADS threads, tools/wrk-shed.lua: after a 503 a thread waits
#             SHED_PAUSE_MS) through the gateway with adaptive_concurrency, C fixed; the
#             upstream's throughput is its own count (`GET /served`), the latency wrk's
#             over every answer (503s included: wrk cannot tell them apart).
# Each run's timeline (every 100 ms: 2xx, 503, the gateway's limit from /v1/stats, the
# upstream's C from /capacity) is analysed by tools/adaptive-settle.py: the settling
# times after each change of C (until the limit stays within +-20 % of its median over
# the phase's last 3 s) and an SVG chart of the run.
#
# Targets: p99 of admitted (2xx) requests <= 3 x the unloaded p50; 2xx per second >= 90 %
# of the upstream's capacity C/S (C time-weighted over the run's schedule, as the upstream
# reported it).
#
# Output (stdout, markdown): settings, the rule file, one row per run, the targets, the
# settling times; the temp dir (with every CSV, SVG and log) is printed at the end and
# removed unless KEEP_TMP=1. OUT=path copies the `with` run's SVG there (the `without`
# run's if `with` was skipped). Progress goes to stderr.
#
# Caveats: everything shares the machine's 2 cores with whatever else runs (nothing is
# pinned); the steal and load average are printed with each run. The `with` run's
# schedule starts when its upstream does, a fraction of a second before the load: the
# changes are located from the upstream's reported C, to within a slice and a poll.
#
# Usage: tools/bench-adaptive.sh
# Environment (all optional):
#   DURATION (30, seconds)  CLIENTS (200)  WORKERS (20, C)  SERVICE_MS (5, S)
#   UNLOADED_DURATION (3)  SHED_PAUSE_MS (10)  MODES ("direct without with wrk")
#   WRK_THREADS (2)
#   PROXY_WORKERS (1)  LOAD_THREADS (1)  UPSTREAM_THREADS (1)  PAUSE (2, seconds between runs)
#   SCHEDULE (default "<DURATION/3>s=<2*WORKERS>,<2*DURATION/3>s=<WORKERS>")
#   MIN_LIMIT (3)  MAX_LIMIT (1000)  INTERVAL (100ms)  MIN_RTT_INTERVAL (30s)
#   MIN_RTT_SAMPLES (50)  BUFFER (25, %)  PERCENTILE (50, %)
#   TOLLGATE_BIN, SLOW_UPSTREAM_BIN, ADAPTIVE_LOAD_BIN (default: $CARGO_TARGET_DIR or
#   <repo>/target, then release/...; built with cargo if missing)  KEEP_TMP=1  OUT=path
# Needs: curl, python3, wrk (for the wrk run), cargo (if a binary is missing).
set -euo pipefail

# shellcheck disable=SC2034 # read by lib.sh's die()
bench_name=bench-adaptive
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=tools/lib.sh disable=SC1091 # followed with shellcheck -x
source "$root/tools/lib.sh"

# The load: clients, run lengths and the clients' back-off after a refusal.
duration="${DURATION:-30}"
clients="${CLIENTS:-200}"
unloaded_duration="${UNLOADED_DURATION:-3}"
shed_pause_ms="${SHED_PAUSE_MS:-10}"
load_threads="${LOAD_THREADS:-1}"
# The upstream: C, S, its threads and the `with` run's schedule.
workers="${WORKERS:-20}"
service_ms="${SERVICE_MS:-5}"
upstream_threads="${UPSTREAM_THREADS:-1}"
third=$((duration / 3))
schedule="${SCHEDULE:-${third}s=$((2 * workers)),$((2 * third))s=$workers}"
# The gateway: its worker threads and the route's adaptive_concurrency settings.
proxy_workers="${PROXY_WORKERS:-1}"
min_limit="${MIN_LIMIT:-3}"
max_limit="${MAX_LIMIT:-1000}"
interval="${INTERVAL:-100ms}"
min_rtt_interval="${MIN_RTT_INTERVAL:-30s}"
min_rtt_samples="${MIN_RTT_SAMPLES:-50}"
buffer="${BUFFER:-25}"
percentile="${PERCENTILE:-50}"
# The session: which runs, the pause between them, where things are and go.
modes="${MODES:-direct without with wrk}"
wrk_threads="${WRK_THREADS:-2}"
pause="${PAUSE:-2}"
keep_tmp="${KEEP_TMP:-}"
out_svg="${OUT:-}"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
tg_bin="${TOLLGATE_BIN:-$target_dir/release/tollgate}"
up_bin="${SLOW_UPSTREAM_BIN:-$target_dir/release/slow-upstream}"
load_bin="${ADAPTIVE_LOAD_BIN:-$target_dir/release/adaptive-load}"
settle_py="$root/tools/adaptive-settle.py"

for tool in curl python3 pgrep; do
  command -v "$tool" >/dev/null || die "$tool is required"
done
for m in $modes; do
  [[ "$m" == direct || "$m" == without || "$m" == with || "$m" == wrk ]] || die "unknown mode '$m' (direct, without, with, wrk)"
  [[ "$m" != wrk ]] || command -v wrk >/dev/null || die "wrk not found (apt-get install -y wrk)"
done
[[ "$duration" =~ ^[1-9][0-9]*$ ]] || die "DURATION must be a whole number of seconds"

# ---------------------------------------------------------------------------------
# Binaries: built only if missing.
# ---------------------------------------------------------------------------------
if [[ ! -x "$tg_bin" ]] || ! "$tg_bin" proxy --help >/dev/null 2>&1; then
  log "building: cargo build --release -p tollgate-server"
  (cd "$root" && cargo build --release -p tollgate-server)
fi
if [[ ! -x "$up_bin" || ! -x "$load_bin" ]]; then
  log "building: cargo build --release -p tollgate-load --bin slow-upstream --bin adaptive-load"
  (cd "$root" && cargo build --release -p tollgate-load --bin slow-upstream --bin adaptive-load)
fi
for b in "$tg_bin" "$up_bin" "$load_bin"; do
  [[ -x "$b" ]] || die "$b not found (set CARGO_TARGET_DIR or the *_BIN variables)"
done

# ---------------------------------------------------------------------------------
# Process bookkeeping (lib.sh): only processes this script started are signalled.
# ---------------------------------------------------------------------------------
work="$(mktemp -d -t bench-adaptive.XXXXXX)"
begin_run 'stop_all_and_clean 5'

# Starts slow-upstream on a free port (it prints the address it bound); sets up_pid and
# up_addr. SCHEDULE may be empty.
start_upstream() { # NAME SCHEDULE
  local name="$1" sched="$2" logf="$work/upstream-$1.log" i
  local cmd=("$up_bin" --listen 127.0.0.1:0 --workers "$workers" --service-ms "$service_ms"
    --threads "$upstream_threads")
  [[ -z "$sched" ]] || cmd+=(--schedule "$sched")
  log "starting upstream ($name): ${cmd[*]}"
  "${cmd[@]}" >"$work/upstream-$name.addr" 2>"$logf" &
  up_pid=$!
  started+=("$up_pid")
  up_addr=""
  for ((i = 0; i < 100; i++)); do
    up_addr="$(head -n 1 "$work/upstream-$name.addr" 2>/dev/null || true)"
    [[ -z "$up_addr" ]] || break
    alive "$up_pid" || break
    sleep 0.05
  done
  [[ -n "$up_addr" ]] || { cat "$logf" >&2; die "slow-upstream ($name) printed no address"; }
  wait_ready "slow-upstream ($name)" "$up_pid" "http://$up_addr/capacity" "$logf"
}

# Starts the gateway with RULES in front of the upstream at up_addr; sets tg_pid,
# tg_url and stats_url.
start_proxy() { # NAME RULES
  local name="$1" rules="$2" port admin logf="$work/tollgate-$1.log"
  port="$(free_port)"
  admin="$(free_port)"
  while [[ "$admin" == "$port" ]]; do admin="$(free_port)"; done
  local cmd=("$tg_bin" proxy --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin"
    --upstream "http://$up_addr" --config "$rules" --workers "$proxy_workers")
  log "starting tollgate ($name): ${cmd[*]}"
  TOLLGATE_LOG=warn "${cmd[@]}" >"$logf" 2>&1 &
  tg_pid=$!
  started+=("$tg_pid")
  tg_url="http://127.0.0.1:$port/"
  stats_url="http://127.0.0.1:$admin/v1/stats"
  wait_ready "tollgate ($name)" "$tg_pid" "$tg_url" "$logf"
}

# One adaptive-load run; sets load_out to its JSON line. EXTRA are more adaptive-load
# flags. (Not in a subshell: it records the run's steal and load average.)
load() { # NAME URL CLIENTS SECONDS EXTRA...
  local name="$1" url="$2" n="$3" secs="$4" out s0 t0 s1 t1
  shift 4
  local cmd=("$load_bin" --url "$url" --clients "$n" --duration "$secs" --threads "$load_threads"
    --shed-pause-ms "$shed_pause_ms" "$@")
  log "run $name: ${cmd[*]}"
  read -r s0 t0 < <(steal_jiffies)
  out="$("${cmd[@]}")" || die "adaptive-load ($name) failed"
  read -r s1 t1 < <(steal_jiffies)
  log "  $out"
  stolen_by["$name"]="$(stolen "$s0" "$t0" "$s1" "$t1")"
  load_by["$name"]="$(cut -d' ' -f1-3 /proc/loadavg)"
  load_out="$out"
}

# ---------------------------------------------------------------------------------
# Rule files
# ---------------------------------------------------------------------------------
cat >"$work/without.yaml" <<YAML
domain: bench
descriptors: []
http:
  routes:
    - match: {path_prefix: /}
YAML
cat >"$work/with.yaml" <<YAML
domain: bench
descriptors: []
http:
  routes:
    - match: {path_prefix: /}
      adaptive_concurrency:
        min_limit: $min_limit
        max_limit: $max_limit
        interval: $interval
        min_rtt_interval: $min_rtt_interval
        min_rtt_samples: $min_rtt_samples
        buffer: $buffer%
        percentile: $percentile%
YAML
with_refused=""
if [[ " $modes " == *" with "* ]] && ! "$tg_bin" validate "$work/with.yaml" >"$work/validate-with.log" 2>&1; then
  # The first error, without the file's path (a temp file) and with no backticks (the
  # report quotes it inside backticks).
  with_refused="$( (grep -m 1 adaptive_concurrency "$work/validate-with.log" || head -n 1 "$work/validate-with.log") |
    sed -E 's|^[^ ]*with\.yaml:||' | tr '`' "'")"
  log "this tollgate refuses adaptive_concurrency; the 'with' run is skipped: $with_refused"
fi

echo "## Adaptive concurrency: tollgate proxy in front of a slow upstream"
echo
echo "- $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores (shared, nothing pinned), load average before: $(cut -d' ' -f1-3 /proc/loadavg); $("$tg_bin" --version 2>&1 | head -n 1)"
echo "- upstream: \`slow-upstream --workers $workers --service-ms $service_ms\`: capacity C/S = $(awk -v c="$workers" -v s="$service_ms" 'BEGIN { printf "%.0f", c * 1000 / s }') per second; \`with\` run: \`--schedule \"$schedule\"\`"
echo "- gateway: \`tollgate proxy --workers $proxy_workers --admin-listen ...\` (release build)"
echo "- load: \`adaptive-load --clients $clients --duration $duration --threads $load_threads --shed-pause-ms $shed_pause_ms\` (closed loop, one keep-alive connection per client; after a non-2xx answer a client waits ${shed_pause_ms} ms)"
echo
echo "<details><summary>rule file of the \`with\` run (\`without\`: the same route, no adaptive_concurrency)</summary>"
echo
echo '```yaml'
cat "$work/with.yaml"
echo '```'
echo "</details>"
echo

# ---------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------
declare -A result_by stolen_by load_by settle_by
ran=()
start_upstream steady ""
steady_addr="$up_addr"

load unloaded "http://$steady_addr/" 1 "$unloaded_duration"
unloaded="$load_out"
unloaded_p50="$(field "$unloaded" p50_ms)"
unloaded_p99="$(field "$unloaded" p99_ms)"

for mode in $modes; do
  sleep "$pause"
  case "$mode" in
    direct)
      load direct "http://$steady_addr/" "$clients" "$duration" \
        --capacity-url "http://$steady_addr/capacity" --csv "$work/direct.csv"
      ;;
    without)
      up_addr="$steady_addr"
      start_proxy without "$work/without.yaml"
      load without "$tg_url" "$clients" "$duration" --stats "$stats_url" \
        --stats-domain bench --capacity-url "http://$steady_addr/capacity" --csv "$work/without.csv"
      stop_pid "$tg_pid" 5
      ;;
    with)
      [[ -z "$with_refused" ]] || continue
      # A fresh upstream: its schedule counts from its start. (The steady one stays up,
      # idle, for the runs after this one.)
      start_upstream scheduled "$schedule"
      start_proxy with "$work/with.yaml"
      load with "$tg_url" "$clients" "$duration" --stats "$stats_url" \
        --stats-domain bench --capacity-url "http://$up_addr/capacity" --csv "$work/with.csv"
      stop_pid "$tg_pid" 5
      stop_pid "$up_pid" 5
      ;;
    wrk)
      [[ -z "$with_refused" ]] || continue
      up_addr="$steady_addr"
      start_proxy wrk "$work/with.yaml"
      served0="$(curl -fsS "http://$steady_addr/served")"
      log "run wrk: wrk -t $wrk_threads -c $clients -d ${duration}s -s tools/wrk-shed.lua $tg_url -- $shed_pause_ms"
      read -r s0 t0 < <(steal_jiffies)
      wrk_out="$(wrk -t "$wrk_threads" -c "$clients" -d "${duration}s" -s "$root/tools/wrk-shed.lua" \
        "$tg_url" -- "$shed_pause_ms")" || die "wrk failed"
      read -r s1 t1 < <(steal_jiffies)
      served1="$(curl -fsS "http://$steady_addr/served")"
      stop_pid "$tg_pid" 5
      wrk_status="$(grep -m 1 '^STATUS' <<<"$wrk_out")" || die "wrk printed no STATUS line"
      wrk_steal="$(stolen "$s0" "$t0" "$s1" "$t1")"
      wrk_load="$(cut -d' ' -f1-3 /proc/loadavg)"
      continue
      ;;
  esac
  result_by["$mode"]="$load_out"
  ran+=("$mode")
  settle_by["$mode"]="$(python3 "$settle_py" "$work/$mode.csv" --service-ms "$service_ms" \
    --buffer "$(awk -v b="$buffer" 'BEGIN { print b / 100 }')" --svg "$work/$mode.svg" \
    --title "$mode: $clients clients, C=$workers (schedule: $([[ "$mode" == with ]] && echo "$schedule" || echo none)), S=$service_ms ms" \
    --markdown)" || die "adaptive-settle.py failed on $mode.csv"
done

# ---------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------
echo "### Unloaded latency"
echo
echo "1 client, ${unloaded_duration} s, straight to the upstream: p50 ${unloaded_p50} ms, p99 ${unloaded_p99} ms ($(field "$unloaded" ok) requests). The latency target uses the p50: 3 x ${unloaded_p50} = $(awk -v p="$unloaded_p50" 'BEGIN { printf "%.2f", 3 * p }') ms."
echo
echo "### Runs"
echo
echo "capacity = C/S with C time-weighted over the run as the upstream reported it; shed share = 503s / requests sent; other = other statuses + transport errors."
echo
echo "| mode | 2xx/s | capacity/s | 2xx / capacity | p50 admitted | p99 admitted | shed share | other | p99 <= 3 x unloaded p50 | 2xx/s >= 90 % capacity | steal | load avg after |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---|"
for mode in "${ran[@]}"; do
  r="${result_by[$mode]}"
  json="$(head -n 1 <<<"${settle_by[$mode]}")"
  awk -v mode="$mode" -v ok="$(field "$r" ok_per_s)" -v cap="$(field "$json" capacity_per_s)" \
    -v p50="$(field "$r" p50_ms)" -v p99="$(field "$r" p99_ms)" -v shed="$(field "$r" shed_share)" \
    -v other="$(($(field "$r" other) + $(field "$r" errors)))" -v ref="$unloaded_p50" \
    -v steal="${stolen_by[$mode]}" -v la="${load_by[$mode]}" 'BEGIN {
      share = cap > 0 ? 100 * ok / cap : 0
      printf "| %s | %.0f | %.0f | %.1f %% | %.2f ms | %.2f ms | %.1f %% | %d | %s | %s | %s | %s |\n",
        mode, ok, cap, share, p50, p99, 100 * shed, other,
        (p99 <= 3 * ref ? "met" : "missed"), (share >= 90 ? "met" : "missed"), steal, la
    }'
done
echo
if [[ -n "${wrk_status:-}" ]]; then
  kv() { sed -nE "s/.*\\b$1=([0-9]+).*/\\1/p" <<<"$wrk_status"; }
  echo "### Cross-check: wrk through the gateway with adaptive_concurrency (C fixed at $workers)"
  echo
  echo "\`wrk -t $wrk_threads -c $clients -d ${duration}s -s tools/wrk-shed.lua URL -- $shed_pause_ms\`; upstream 2xx/s is the upstream's own count (\`/served\`); wrk's latency is over every answer, 503s included."
  echo
  echo "| client | 2xx/s (wrk) | upstream served/s | served / capacity | shed share | p50 all answers | p99 all answers | steal | load avg after |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---|"
  awk -v ok="$(kv ok)" -v shed="$(kv shed)" -v other="$(kv other)" -v p50="$(kv p50_us)" -v p99="$(kv p99_us)" \
    -v served=$((served1 - served0)) -v secs="$duration" -v cap="$(awk -v c="$workers" -v s="$service_ms" 'BEGIN { print c * 1000 / s }')" \
    -v steal="$wrk_steal" -v la="$wrk_load" 'BEGIN {
      total = ok + shed + other
      printf "| wrk | %.0f | %.0f | %.1f %% | %.1f %% | %.2f ms | %.2f ms | %s | %s |\n",
        ok / secs, served / secs, 100 * served / secs / cap, (total > 0 ? 100 * shed / total : 0),
        p50 / 1000, p99 / 1000, steal, la
    }'
  echo
fi
if [[ -n "$with_refused" ]]; then
  echo "The \`with\` run was skipped: this tollgate refuses the rule file (\`$with_refused\`)."
  echo "Run it with a tollgate that has adaptive_concurrency: rebuild (\`cargo build --release -p tollgate-server\`)"
  echo "or point TOLLGATE_BIN at one, then \`MODES=with tools/bench-adaptive.sh\` (or all modes)."
  echo
fi
for mode in "${ran[@]}"; do
  [[ "$mode" == with ]] || continue
  echo "### Settling of the limit (\`with\`)"
  echo
  echo "After each change of C: how long until the limit stays within +-20 % of its median over the last 3 s of that phase (from the CSV's 100 ms samples; a change is located to within a slice and a poll)."
  echo
  tail -n +2 <<<"${settle_by[$mode]}"
  echo
done

svg_from=""
if [[ -f "$work/with.svg" ]]; then svg_from="$work/with.svg"; elif [[ -f "$work/without.svg" ]]; then svg_from="$work/without.svg"; fi
if [[ -n "$out_svg" && -n "$svg_from" ]]; then
  cp "$svg_from" "$out_svg"
  echo "- chart: $out_svg (copied from $(basename "$svg_from"))"
fi
echo "- load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
if [[ -n "$keep_tmp" ]]; then
  echo "- output dir (CSV timelines, SVG charts, logs): $work"
else
  echo "- output dir: $work (removed at exit; KEEP_TMP=1 keeps it)"
fi
