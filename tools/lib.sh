# Helpers shared by the benchmark scripts in tools/ (sourced, not run). The script
# sets `bench_name` (for messages) before sourcing.

log() { printf '%s\n' "$*" >&2; }
die() { log "${bench_name:-bench}: $*"; exit 1; }

# A loopback port nobody listens on, below the kernel's range of ephemeral ports (a port
# in that range can be taken meanwhile as the local end of some outgoing connection,
# which makes a server's bind fail). There is still a small race until a server binds
# it; the scripts' readiness checks catch a server that could not start.
free_port() {
  local port low=32768
  if [[ -r /proc/sys/net/ipv4/ip_local_port_range ]]; then
    read -r low _ </proc/sys/net/ipv4/ip_local_port_range
  fi
  ((low > 12000)) || low=32768
  for _ in $(seq 1 100); do
    port=$((10000 + RANDOM % (low - 10000)))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return 0
    fi
  done
  die "no free port found"
}

# Starts a throwaway redis-server (no persistence) on a free loopback port, its files in
# DIR and its log in LOG, and waits until it answers (5 s at most, else dies). Sets
# redis_pid, redis_port and redis_url; the caller stops it.
# shellcheck disable=SC2034 # redis_pid and redis_url are the caller's
start_redis() {
  local dir=$1 logfile=$2
  redis_port="$(free_port)"
  redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
    --loglevel warning --dir "$dir" >"$logfile" 2>&1 &
  redis_pid=$!
  for _ in $(seq 1 100); do redis-cli -p "$redis_port" PING >/dev/null 2>&1 && break; sleep 0.05; done
  redis-cli -p "$redis_port" PING >/dev/null 2>&1 || die "redis-server did not start (see $logfile)"
  redis_url="redis://127.0.0.1:$redis_port"
}

# Field of tollgate-load's one-line JSON report (keys are unique in it).
field() { sed -E 's/.*"'"$2"'":("[^"]*"|[^,}]*).*/\1/' <<<"$1"; }

# Nanoseconds PID's threads have run (/proc/PID/task/*/schedstat field 1), in full
# (mawk's `print` keeps 6 digits and its %d stops at 2^31).
cpu_ns() { cat /proc/"$1"/task/*/schedstat | awk '{ s += $1 } END { printf "%.0f", s }'; }

# Nanoseconds PID's threads have run and have waited in the run queue for a CPU.
sched_ns() { cat /proc/"$1"/task/*/schedstat | awk '{ r += $1; w += $2 } END { printf "%.0f %.0f", r, w }'; }

# The wall clock in nanoseconds.
now_ns() { date +%s%N; }

# "ran / waited" in ms per second of wall clock between two sched_ns and now_ns
# snapshots: per_second RUN0 WAIT0 T0 RUN1 WAIT1 T1.
per_second() {
  awk -v r0="$1" -v w0="$2" -v t0="$3" -v r1="$4" -v w1="$5" -v t1="$6" \
    'BEGIN { s = (t1 - t0) / 1e9; printf "%.0f / %.0f", (r1 - r0) / 1e6 / s, (w1 - w0) / 1e6 / s }'
}

# The machine's steal and total jiffies so far (/proc/stat's first line: time the
# hypervisor gave this VM's CPUs to someone else, and all time), as "STEAL TOTAL".
steal_jiffies() { awk '/^cpu / { t = 0; for (i = 2; i <= NF; i++) t += $i; print $9, t; exit }' /proc/stat; }

# Percent of CPU time stolen between two steal_jiffies snapshots: stolen S0 T0 S1 T1.
stolen() { awk -v s0="$1" -v t0="$2" -v s1="$3" -v t1="$4" 'BEGIN { printf "%.1f %%", (t1 > t0 ? 100 * (s1 - s0) / (t1 - t0) : 0) }'; }

# Process bookkeeping for scripts that start servers: the script keeps the pids of the
# servers it started and has not stopped yet in an array `started` (oldest first), its
# temp dir in `work` and KEEP_TMP in `keep_tmp`. Only those pids are ever signalled,
# never a process looked up by name.

# True if PID exists and is not a zombie (kill -0 succeeds on zombies, which our own
# children are until they are waited for).
alive() {
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  stat="${stat##*) }"
  [[ "${stat%% *}" != Z ]]
}

# Stops PID (a server we started) with SIGTERM; after TIMEOUT seconds (10), SIGKILL. Its
# children (nginx workers) are collected first and killed too if they outlive it; then
# it is dropped from `started`.
# shellcheck disable=SC2154 # started is the caller's
stop_pid() { # PID [TIMEOUT]
  local pid="$1" timeout="${2:-10}" kids i c
  kids="$(pgrep -P "$pid" 2>/dev/null || true)"
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < timeout * 10; i++)); do
      alive "$pid" || break
      sleep 0.1
    done
    if alive "$pid"; then
      log "pid $pid did not stop within ${timeout}s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  wait "$pid" 2>/dev/null || true
  for c in $kids; do
    for ((i = 0; i < 20; i++)); do
      alive "$c" || break
      sleep 0.1
    done
    if alive "$c" && [[ "$(cat "/proc/$c/comm" 2>/dev/null)" == nginx ]]; then
      kill -KILL "$c" 2>/dev/null || true
    fi
  done
  local rest=() p
  for p in "${started[@]}"; do [[ "$p" == "$pid" ]] || rest+=("$p"); done
  started=("${rest[@]}")
}

# Starts a run's bookkeeping, once the caller has made its temp dir `work`: makes it
# readable by all (nginx workers running as another user, www-data when started as root,
# must reach the dirs nginx creates under it), empties `started`, and sets the traps: on
# exit the command CLEANUP (usually 'stop_all_and_clean 5'), on INT and TERM exit 130
# and 143.
# shellcheck disable=SC2034,SC2154 # work is the caller's; started is read by it and below
begin_run() { # CLEANUP
  chmod 755 "$work"
  started=()
  # shellcheck disable=SC2064 # the command is fixed now, on purpose
  trap "$1" EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

# The end of a run (from an EXIT trap): stops every server in `started`, newest first
# (each as stop_pid, TIMEOUT seconds), then removes `work` unless `keep_tmp` is set.
# shellcheck disable=SC2154 # started, work and keep_tmp are the caller's
stop_all_and_clean() { # [TIMEOUT]
  local i
  for ((i = ${#started[@]} - 1; i >= 0; i--)); do
    stop_pid "${started[i]}" "${1:-10}" || true
  done
  if [[ -n "${keep_tmp:-}" ]]; then
    log "kept $work"
  else
    rm -rf "$work"
  fi
}

# Polls URL until it answers 200 (up to 10 s); dies if PID exits first or on timeout,
# showing LOG.
wait_ready() { # NAME PID URL LOG
  local name="$1" pid="$2" url="$3" logf="$4" code="" deadline
  deadline=$(($(date +%s%N) + 10000000000))
  while (($(date +%s%N) < deadline)); do
    if ! alive "$pid"; then
      cat "$logf" >&2 2>/dev/null || true
      die "$name exited before answering on $url"
    fi
    code="$(curl -s -k -o /dev/null -w '%{http_code}' --max-time 1 "$url" || true)"
    [[ "$code" == 200 ]] && return 0
    sleep 0.1
  done
  cat "$logf" >&2 2>/dev/null || true
  die "$name did not answer 200 on $url within 10 s (last status: ${code:-none})"
}
