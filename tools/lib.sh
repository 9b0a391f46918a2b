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
