#!/usr/bin/env bash
# Benchmarks the Tollgate HTTP gateway (`tollgate proxy`) against nginx's `limit_req`
# module in the same session, on the same machine, in front of the same upstream.
#
# This is a benchmark, not a test: it prints numbers, it asserts nothing.
#
# What it starts (all on 127.0.0.1, free ports unless set, all stopped on exit):
#   upstream  nginx, 1 worker, `return 200 "ok\n"` on every path, keep-alive on; the
#             backend of both proxies, and measured directly as the baseline;
#   nginx     nginx as the peer: `limit_req` per client address (RATE r/s, BURST,
#             nodelay, 429), `proxy_pass` to the upstream over a keep-alive pool;
#   tollgate  `tollgate proxy` with a rule file giving the same limit per
#             remote_address (GCRA, RATE per second, BURST), same upstream.
# Two load shapes ("scenarios"), each restarting both proxies with its own rate:
#   admitted  RATE so high that nothing is limited: the pure proxying cost;
#   limited   RATE=1000, BURST=100 from one client address: most requests get 429,
#             which wrk counts as "Non-2xx or 3xx responses": the cost of rejecting.
# Each scenario runs RUNS rounds of: direct upstream, nginx, tollgate (so the two
# proxies alternate nginx, tollgate, nginx, tollgate and share the session's noise),
# each a `wrk -t2 -c$CONNS -d$DURATION --latency` run. The server's CPU time (utime +
# stime from /proc/PID/stat, in clock ticks) is read before and after every run.
#
# Output (stdout, markdown): the exact commands and configs, one row per run, then the
# medians over runs and the ratios tollgate/nginx and proxy/direct. Progress goes to
# stderr.
#
# Caveats: wrk, the proxy and the upstream share the machine's cores, so every number
# is that of the whole set; a proxy that burns less CPU leaves more to wrk and to the
# upstream. Other load on the machine distorts everything; compare within one output.
#
# Usage: tools/bench-proxy.sh
# Environment (all optional):
#   DURATION (10s)  CONNS (64)  THREADS (2)  RUNS (2)  SCENARIOS ("admitted limited")
#   ADMITTED_RATE (10000000)  ADMITTED_BURST (1000)  LIMITED_RATE (1000)
#   LIMITED_BURST (100)  NGINX_WORKERS (2)  UP_WORKERS (1)  PAUSE (1, seconds between runs)
#   UP_PORT, NGINX_PORT, TG_PORT (default: free loopback ports)
#   SKIP_TOLLGATE=1 (nginx and the upstream only; no build, no tollgate rows)
#   TOLLGATE_BIN (default: $CARGO_TARGET_DIR or <repo>/target, then release/tollgate)
#   NGINX (nginx binary; default: from PATH or /usr/sbin/nginx)  KEEP_TMP=1
#   TLS=1 (both proxies serve HTTPS with one self-signed P-256 certificate that openssl
#   makes: nginx `listen ... ssl`, tollgate `--tls-cert/--tls-key`; wrk connects over TLS
#   and keeps its connections, so this measures encrypted proxying, not handshakes; the
#   upstream stays cleartext)
# Needs: nginx, wrk, curl, pgrep, getconf (and openssl with TLS=1); cargo only if the
# tollgate binary is missing.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# ---------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------
duration="${DURATION:-10s}"
conns="${CONNS:-64}"
threads="${THREADS:-2}"
runs="${RUNS:-2}"
scenarios="${SCENARIOS:-admitted limited}"
admitted_rate="${ADMITTED_RATE:-10000000}"
admitted_burst="${ADMITTED_BURST:-1000}"
limited_rate="${LIMITED_RATE:-1000}"
limited_burst="${LIMITED_BURST:-100}"
# The peer nginx gets 2 workers: tollgate runs one worker thread per core (--workers), using both
# cores of this machine, so a 1-worker nginx (one core at most) would be handicapped.
nginx_workers="${NGINX_WORKERS:-2}"
# The upstream is the same for every target; 1 worker as specified for this benchmark.
up_workers="${UP_WORKERS:-1}"
pause="${PAUSE:-1}"
skip_tollgate=""
[[ -n "${SKIP_TOLLGATE:-}" && "${SKIP_TOLLGATE}" != "0" ]] && skip_tollgate=1
tg_bin="${TOLLGATE_BIN:-${CARGO_TARGET_DIR:-$root/target}/release/tollgate}"
nginx_bin="${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}"
# shellcheck disable=SC2034 # read by lib.sh's stop_all_and_clean
keep_tmp="${KEEP_TMP:-}"

bench_name=bench-proxy
# shellcheck source=tools/lib.sh
source "$root/tools/lib.sh"

for tool in wrk curl pgrep getconf; do
  command -v "$tool" >/dev/null || die "$tool is required (apt-get install -y wrk curl procps)"
done
[[ -x "$nginx_bin" ]] || die "nginx not found (apt-get install -y nginx, or set NGINX)"
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || die "RUNS must be a positive integer"
for s in $scenarios; do
  [[ "$s" == admitted || "$s" == limited ]] || die "unknown scenario '$s' (admitted, limited)"
done
clk_tck="$(getconf CLK_TCK)"

# ---------------------------------------------------------------------------------
# Tollgate binary: build only if it is missing (or predates the `proxy` subcommand).
# ---------------------------------------------------------------------------------
if [[ -z "$skip_tollgate" ]]; then
  if [[ ! -x "$tg_bin" ]] || ! "$tg_bin" proxy --help >/dev/null 2>&1; then
    log "tollgate binary missing or without 'proxy'; building: cargo build --release -p tollgate-server"
    (cd "$root" && cargo build --release -p tollgate-server)
  fi
  [[ -x "$tg_bin" ]] || die "$tg_bin not found (set CARGO_TARGET_DIR or TOLLGATE_BIN)"
  "$tg_bin" proxy --help >/dev/null 2>&1 || die "$tg_bin has no 'proxy' subcommand"
fi

# ---------------------------------------------------------------------------------
# Process bookkeeping and cleanup. Only processes this script started are ever
# signalled: their pids are recorded when they start (nginx masters; their workers are
# found as children of those masters), never looked up by name.
# ---------------------------------------------------------------------------------
wrk_pid="" # the wrk run in progress, if any
cleanup() {
  if [[ -n "$wrk_pid" ]]; then
    kill -TERM "$wrk_pid" 2>/dev/null || true
    wait "$wrk_pid" 2>/dev/null || true
  fi
  # Newest first: the proxies, then the upstream.
  stop_all_and_clean 5
}
# The temp dir, `started` (pids of long-running servers this script started and has not
# stopped yet) and the traps.
work="$(mktemp -d -t bench-proxy.XXXXXX)"
begin_run cleanup

tls="${TLS:-}"
[[ "$tls" == 0 ]] && tls=""
if [[ -n "$tls" ]]; then
  command -v openssl >/dev/null || die "openssl is required for TLS=1"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
    -keyout "$work/tls.key" -out "$work/tls.pem" -subj /CN=localhost \
    -addext subjectAltName=IP:127.0.0.1 2>/dev/null || die "openssl could not make a certificate"
fi
scheme="http"
[[ -z "$tls" ]] || scheme="https"

up_port="${UP_PORT:-$(free_port)}"
nginx_port="${NGINX_PORT:-$(free_port)}"
while [[ "$nginx_port" == "$up_port" ]]; do nginx_port="$(free_port)"; done
tg_port="${TG_PORT:-$(free_port)}"
while [[ "$tg_port" == "$up_port" || "$tg_port" == "$nginx_port" ]]; do tg_port="$(free_port)"; done

# ---------------------------------------------------------------------------------
# Configs: everything is written before anything runs, so it can be printed first.
# ---------------------------------------------------------------------------------
scenario_rate() { if [[ "$1" == admitted ]]; then echo "$admitted_rate"; else echo "$limited_rate"; fi; }
scenario_burst() { if [[ "$1" == admitted ]]; then echo "$admitted_burst"; else echo "$limited_burst"; fi; }

# Settings common to both nginx instances. Paths are absolute under the instance's own
# prefix, so nothing touches /var/log/nginx, /var/lib/nginx or /run/nginx.pid.
# keepalive_requests is raised on every hop: the default (1000) would close each
# keep-alive connection every 1000 requests, adding reconnects to every target.
nginx_common() { # PREFIX WORKERS
  cat <<EOF
daemon off;
master_process on;
worker_processes $2;
pid $1/nginx.pid;
error_log $1/error.log warn;
events { worker_connections 1024; }
EOF
}
nginx_http_common() { # PREFIX
  cat <<EOF
    access_log off;
    default_type text/plain;
    keepalive_timeout 75s;
    keepalive_requests 1000000;
    client_body_temp_path $1/client_body;
    proxy_temp_path $1/proxy;
    fastcgi_temp_path $1/fastcgi;
    uwsgi_temp_path $1/uwsgi;
    scgi_temp_path $1/scgi;
EOF
}

# Upstream: answers 200 "ok\n" on every path.
up_prefix="$work/upstream"
mkdir -p "$up_prefix"
{
  nginx_common "$up_prefix" "$up_workers"
  echo "http {"
  nginx_http_common "$up_prefix"
  cat <<EOF
    server {
        listen 127.0.0.1:$up_port;
        location / { return 200 "ok\n"; }
    }
}
EOF
} >"$up_prefix/nginx.conf"

for s in $scenarios; do
  rate="$(scenario_rate "$s")"
  burst="$(scenario_burst "$s")"
  prefix="$work/$s/nginx"
  mkdir -p "$prefix"
  # Peer: limit_req per client address, then proxy_pass over a keep-alive pool.
  # Rejections are logged at `notice`, below the error_log level (warn): nginx would
  # otherwise write one log line per rejected request, a cost tollgate does not pay.
  {
    nginx_common "$prefix" "$nginx_workers"
    echo "http {"
    nginx_http_common "$prefix"
    cat <<EOF
    upstream backend {
        server 127.0.0.1:$up_port;
        keepalive 64;
        keepalive_requests 1000000;
    }
    limit_req_zone \$binary_remote_addr zone=perip:10m rate=${rate}r/s;
    server {
        listen 127.0.0.1:$nginx_port${tls:+ ssl};
$(if [[ -n "$tls" ]]; then
  echo "        ssl_certificate $work/tls.pem;"
  echo "        ssl_certificate_key $work/tls.key;"
  echo "        ssl_protocols TLSv1.2 TLSv1.3;"
fi)
        location / {
            limit_req zone=perip burst=$burst nodelay;
            limit_req_status 429;
            limit_req_log_level notice;
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }
    }
}
EOF
  } >"$prefix/nginx.conf"

  # Tollgate: the same limit per remote address, on every path.
  cat >"$work/$s/rules.yaml" <<EOF
domain: edge
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: $rate, algorithm: gcra, burst: $burst}
http:
  routes:
    - match: {path_prefix: /}
      rate_limits:
        - actions: [{remote_address: {}}]
EOF
done

# Commands (arrays, so what is printed is exactly what runs).
up_cmd=("$nginx_bin" -p "$up_prefix" -c "$up_prefix/nginx.conf" -e "$up_prefix/error.log")
nginx_cmd() { # SCENARIO
  local p="$work/$1/nginx"
  nginx_cmd_out=("$nginx_bin" -p "$p" -c "$p/nginx.conf" -e "$p/error.log")
}
tg_cmd() { # SCENARIO
  tg_cmd_out=("$tg_bin" proxy --listen "127.0.0.1:$tg_port"
    --upstream "http://127.0.0.1:$up_port" --config "$work/$1/rules.yaml")
  [[ -z "$tls" ]] || tg_cmd_out+=(--tls-cert "$work/tls.pem" --tls-key "$work/tls.key")
}
wrk_cmd=(wrk "-t$threads" "-c$conns" "-d$duration" --latency)
up_url="http://127.0.0.1:$up_port/"
nginx_url="$scheme://127.0.0.1:$nginx_port/"
tg_url="$scheme://127.0.0.1:$tg_port/"

quote() { local a out=""; for a in "$@"; do out+="$(printf '%q' "$a") "; done; echo "${out% }"; }

# ---------------------------------------------------------------------------------
# Header: environment, exact commands, configs.
# ---------------------------------------------------------------------------------
{
  echo "# tollgate proxy vs nginx limit_req${tls:+, both over TLS}"
  echo
  line="$(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(uname -sr), $(nproc) cores; $("$nginx_bin" -v 2>&1)"
  line+="; $( (wrk -v 2>&1 || true) | head -n 1 | cut -d' ' -f1-2)"
  if [[ -z "$skip_tollgate" ]]; then
    line+="; $("$tg_bin" --version 2>&1 | head -n 1)"
  fi
  echo "$line"
  echo
  line="runs: $runs, duration: $duration, connections: $conns, wrk threads: $threads"
  [[ -z "$skip_tollgate" ]] || line+=" (SKIP_TOLLGATE: tollgate not run)"
  echo "$line"
  echo
  echo "## Commands"
  echo
  echo '```sh'
  echo "# upstream (whole session)"
  quote "${up_cmd[@]}"
  for s in $scenarios; do
    echo "# scenario $s: rate $(scenario_rate "$s")/s, burst $(scenario_burst "$s")"
    nginx_cmd "$s"
    quote "${nginx_cmd_out[@]}"
    if [[ -z "$skip_tollgate" ]]; then
      tg_cmd "$s"
      echo "TOLLGATE_LOG=warn $(quote "${tg_cmd_out[@]}")"
    fi
  done
  echo "# load, for each run of each scenario, in this order"
  quote "${wrk_cmd[@]}" "$up_url"
  quote "${wrk_cmd[@]}" "$nginx_url"
  [[ -n "$skip_tollgate" ]] || quote "${wrk_cmd[@]}" "$tg_url"
  echo '```'
  echo
  echo "<details><summary>configs</summary>"
  echo
  for f in "$up_prefix/nginx.conf" $(for s in $scenarios; do
    echo "$work/$s/nginx/nginx.conf"
    [[ -n "$skip_tollgate" ]] || echo "$work/$s/rules.yaml"
  done); do
    echo "$f:"
    echo
    echo '```'
    cat "$f"
    echo '```'
    echo
  done
  echo "</details>"
  echo
}

# ---------------------------------------------------------------------------------
# Starting servers
# ---------------------------------------------------------------------------------
# Starts an nginx from its command array; sets started_pid. Its stderr goes to LOG.
start_nginx() { # NAME URL LOG CMD...
  local name="$1" url="$2" logf="$3"
  shift 3
  log "starting $name: $*"
  "$@" >"$logf" 2>&1 &
  started_pid=$!
  started+=("$started_pid")
  wait_ready "$name" "$started_pid" "$url" "$logf"
}

start_tollgate() { # SCENARIO
  tg_cmd "$1"
  log "starting tollgate: ${tg_cmd_out[*]}"
  TOLLGATE_LOG=warn "${tg_cmd_out[@]}" >"$work/$1/tollgate.log" 2>&1 &
  started_pid=$!
  started+=("$started_pid")
  wait_ready tollgate "$started_pid" "$tg_url" "$work/$1/tollgate.log"
}

# ---------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------
# utime + stime, in clock ticks, summed over the given pids (for a multi-threaded
# process the /proc/PID/stat figures already cover all its threads).
cpu_ticks() {
  local total=0 pid stat f
  for pid in "$@"; do
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || continue
    stat="${stat##*) }" # drop "pid (comm) ": f[0] is field 3 (state)
    read -r -a f <<<"$stat"
    total=$((total + f[11] + f[12])) # fields 14 (utime) and 15 (stime)
  done
  echo "$total"
}

# wrk's report -> "req/s p99_us requests non2xx socket_errors seconds".
parse_wrk() {
  awk '
    function us(v,   n) {
      n = v + 0
      if (v ~ /us$/) return n
      if (v ~ /ms$/) return n * 1e3
      if (v ~ /s$/)  return n * 1e6
      if (v ~ /m$/)  return n * 6e7
      if (v ~ /h$/)  return n * 3.6e9
      return n
    }
    $1 == "99%"                  { p99 = us($2) }
    / requests in /              { req = $1; d = $4; sub(/,$/, "", d); secs = us(d) / 1e6 }
    /^Requests\/sec:/            { rps = $2 }
    /Non-2xx or 3xx responses:/  { non = $NF }
    /Socket errors:/             { err = $4 + $6 + $8 + $10 }
    END {
      if (rps == "" || req == "") exit 1
      printf "%s %.0f %d %d %d %.3f\n", rps, p99, req, non, err, secs
    }' "$1"
}

median() {
  printf '%s\n' "$@" | sort -g | awk '
    { a[NR] = $1 }
    END {
      if (NR == 0) { print "nan"; exit }
      if (NR % 2) print a[(NR + 1) / 2]; else print (a[NR / 2] + a[NR / 2 + 1]) / 2
    }'
}

declare -A m_rps m_p99 m_cpu # "scenario/target" -> space-separated values over runs
rows=()

# One wrk run against URL; PIDS are the server processes whose CPU time is charged.
measure() { # SCENARIO TARGET RUN URL PIDS...
  local s="$1" t="$2" r="$3" url="$4" out before after res rps p99 req non err secs cpu_us ok_s
  shift 4
  out="$work/$s/wrk-$t-$r.txt"
  log "[$s run $r/$runs] $t: $(quote "${wrk_cmd[@]}" "$url")"
  before="$(cpu_ticks "$@")"
  "${wrk_cmd[@]}" "$url" >"$out" 2>&1 &
  wrk_pid=$!
  if ! wait "$wrk_pid"; then
    wrk_pid=""
    cat "$out" >&2
    die "wrk failed against $t ($url)"
  fi
  wrk_pid=""
  after="$(cpu_ticks "$@")"
  res="$(parse_wrk "$out")" || { cat "$out" >&2; die "could not parse wrk output ($t)"; }
  read -r rps p99 req non err secs <<<"$res"
  # CPU µs per request = (ticks / CLK_TCK) s * 1e6 / requests.
  cpu_us="$(awk -v d=$((after - before)) -v hz="$clk_tck" -v n="$req" \
    'BEGIN { printf "%.2f", (n > 0 ? d / hz * 1e6 / n : 0) }')"
  # 2xx/s: wrk's req/s (precise run time) times the share of 2xx responses.
  ok_s="$(awk -v n="$req" -v bad="$non" -v r="$rps" 'BEGIN { printf "%.0f", (n > 0 ? r * (n - bad) / n : 0) }')"
  log "  $rps req/s, p99 ${p99} us, $req requests, $non non-2xx, $err socket errors, $cpu_us CPU us/req"
  ((err == 0)) || log "  warning: $err socket errors ($t)"
  m_rps["$s/$t"]+=" $rps"
  m_p99["$s/$t"]+=" $p99"
  m_cpu["$s/$t"]+=" $cpu_us"
  rows+=("$(printf '| %s | %s | %d | %.0f | %.2f ms | %d | %s | %d | %s |' \
    "$s" "$t" "$r" "$rps" "$(awk -v u="$p99" 'BEGIN { print u / 1000 }')" "$non" "$ok_s" "$err" "$cpu_us")")
}

# ---------------------------------------------------------------------------------
# The session
# ---------------------------------------------------------------------------------
start_nginx upstream "$up_url" "$up_prefix/stderr.log" "${up_cmd[@]}"
up_pid="$started_pid"
up_pids=("$up_pid" $(pgrep -P "$up_pid" || true))

for s in $scenarios; do
  nginx_cmd "$s"
  start_nginx "nginx ($s)" "$nginx_url" "$work/$s/nginx/stderr.log" "${nginx_cmd_out[@]}"
  ng_pid="$started_pid"
  ng_pids=("$ng_pid" $(pgrep -P "$ng_pid" || true)) # master + workers
  tg_pid=""
  if [[ -z "$skip_tollgate" ]]; then
    start_tollgate "$s"
    tg_pid="$started_pid"
  fi

  for ((r = 1; r <= runs; r++)); do
    measure "$s" direct "$r" "$up_url" "${up_pids[@]}"
    sleep "$pause"
    measure "$s" nginx "$r" "$nginx_url" "${ng_pids[@]}"
    sleep "$pause"
    if [[ -n "$tg_pid" ]]; then
      measure "$s" tollgate "$r" "$tg_url" "$tg_pid"
      sleep "$pause"
    fi
  done

  # Each scenario has its own rate: stop both proxies before the next one.
  [[ -z "$tg_pid" ]] || stop_pid "$tg_pid"
  stop_pid "$ng_pid"
done

# ---------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------
med() { # MAP-NAME KEY
  local -n map="$1"
  if [[ -n "${map[$2]:-}" ]]; then
    # shellcheck disable=SC2086 # word splitting of the value list is intended
    median ${map[$2]}
  else
    echo nan
  fi
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "nan" || b == "nan" || b == 0) print "n/a"; else printf "%.2f", a / b }'; }
# fmt VALUE PRINTF-FORMAT [DIVISOR]: "n/a" for a missing value.
fmt() { awk -v v="$1" -v f="$2" -v d="${3:-1}" 'BEGIN { if (v == "nan") print "n/a"; else printf f, v / d }'; }

echo "## Runs"
echo
echo "CPU = the target server's utime+stime over the run (/proc/PID/stat; nginx: master +"
echo "workers; direct: the upstream) per request wrk completed. non-2xx = wrk's \"Non-2xx or"
echo "3xx responses\"; 2xx/s = req/s × (requests - non-2xx) / requests."
echo
echo "| scenario | target | run | req/s | p99 | non-2xx | 2xx/s | socket errors | CPU µs/req |"
echo "|---|---|---:|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
echo
echo "## Medians over $runs run(s)"
echo
echo "| scenario | target | req/s | p99 | CPU µs/req |"
echo "|---|---|---:|---:|---:|"
targets=(direct nginx)
[[ -n "$skip_tollgate" ]] || targets+=(tollgate)
for s in $scenarios; do
  for t in "${targets[@]}"; do
    printf '| %s | %s | %s | %s | %s |\n' "$s" "$t" \
      "$(fmt "$(med m_rps "$s/$t")" '%.0f')" \
      "$(fmt "$(med m_p99 "$s/$t")" '%.2f ms' 1000)" \
      "$(fmt "$(med m_cpu "$s/$t")" '%.2f')"
  done
done
echo
echo "## Ratios (of medians)"
echo
echo "| scenario | tollgate/nginx req/s | tollgate/nginx p99 | tollgate/nginx CPU per req | nginx/direct req/s | tollgate/direct req/s |"
echo "|---|---:|---:|---:|---:|---:|"
for s in $scenarios; do
  d_rps="$(med m_rps "$s/direct")"
  n_rps="$(med m_rps "$s/nginx")"
  t_rps="$(med m_rps "$s/tollgate")"
  printf '| %s | %s | %s | %s | %s | %s |\n' "$s" \
    "$(ratio "$t_rps" "$n_rps")" \
    "$(ratio "$(med m_p99 "$s/tollgate")" "$(med m_p99 "$s/nginx")")" \
    "$(ratio "$(med m_cpu "$s/tollgate")" "$(med m_cpu "$s/nginx")")" \
    "$(ratio "$n_rps" "$d_rps")" \
    "$(ratio "$t_rps" "$d_rps")"
done
echo
echo "Throughput ratios above 1 and p99/CPU ratios below 1 favour tollgate; proxy/direct is"
echo "the share of the bare upstream's throughput each proxy keeps."
