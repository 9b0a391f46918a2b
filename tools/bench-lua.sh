#!/usr/bin/env bash
# What Tollgate's Redis script costs Redis, per decision, in instructions: stable on a
# shared, noisy machine where CPU times are not (a benchmark, not a test).
#
# Runs redis-server under valgrind's callgrind on a free port, loads the script that
# `tollgate redis-script [--library] <algorithm>` prints, and sends it CALLS script calls of BATCH
# lone requests each (one check, Redis TIME, keys cycling over 10,000), as the batcher
# of a busy `tollgate serve` does. Instructions are counted over those calls only
# (warm-up excluded) and divided by the decisions. Cases:
#   fixed_window 1s   every decision starts a new window (keys come back after > 1 s)
#   fixed_window 1h   every decision lands in its key's current window
#   sliding_window 1s every decision starts a new sub-window (a state rewritten whole)
#   sliding_window 1h every decision lands in its key's current sub-window (16 bytes
#                     rewritten in place)
#   token_bucket, gcra, leaky_bucket (queue): 1e9 per second
#   floor             a script that only unpacks the request, GETs the key and SETs
#                     it with PX, called and answering as tollgate's scripts are (the
#                     index and one shared argument; two packed doubles, the short
#                     answer of an admitted check): what any
#                     GET-then-SET script costs
# Needs valgrind (callgrind_control), redis-server, redis-cli, python3.
#
# FORM picks how the scripts are called: `function` (default: the library loaded with
# FUNCTION LOAD and called with FCALL, as the store does on Redis 7 and later) or `eval`
# (SCRIPT LOAD and EVALSHA, as on Redis 6, and as every build before functions; an
# older TOLLGATE binary has no --library, so measure it with FORM=eval). The floor
# script is called the same way.
#
# Usage: tools/bench-lua.sh      Environment: BATCH (32), CALLS (500), FORM (function),
# TOLLGATE (a tollgate binary whose scripts to measure, e.g. an older build; default:
# build this tree)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
batch="${BATCH:-32}"
calls="${CALLS:-500}"
form="${FORM:-function}"
[[ "$form" == function || "$form" == eval ]] || { echo "FORM must be function or eval" >&2; exit 1; }
bin="${CARGO_TARGET_DIR:-$root/target}/release"

bench_name=bench-lua
# shellcheck source=tools/lib.sh
source "$root/tools/lib.sh"
for tool in valgrind callgrind_control redis-server redis-cli python3; do
  command -v "$tool" >/dev/null || die "$tool is required (apt-get install valgrind redis-server redis-tools python3)"
done
if [[ -z "${TOLLGATE:-}" ]]; then
  (cd "$root" && cargo build --release -q -p tollgate-server)
fi
tollgate="${TOLLGATE:-$bin/tollgate}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cat >"$work/floor.body" <<'LUA'
local requests = tonumber(ARGV[2])
local out, unpack = {}, struct.unpack
redis.call('TIME')
for q = 1, requests do
  local lo, hi = string.byte(ARGV[3], 2 * q - 1, 2 * q)
  local blob = ARGV[4 + lo + 256 * hi]
  local _, _, _, _, pos = unpack('<dddd', blob)
  unpack('<ddddddddddd', blob, pos)
  local raw, n = redis.call('GET', KEYS[q]), 0
  if raw then n = select(3, unpack('ddd', raw)) end
  redis.call('SET', KEYS[q], struct.pack('dddd', 1, 2, n + 1, 0), 'PX', '1000')
  out[q] = struct.pack('<dd', n + 1, 0)
end
return table.concat(out)
LUA
if [[ "$form" == function ]]; then
  { echo '#!lua name=floor'; echo 'local function call(KEYS, ARGV)'; cat "$work/floor.body"
    echo 'end'; echo "redis.register_function('floor', call)"; } >"$work/floor.lua"
else
  cp "$work/floor.body" "$work/floor.lua"
fi

# Writes CALLS (or $3) calls of BATCH lone requests in RESP: the command and what it
# calls (EVALSHA and a SHA-1, or FCALL and a function name), check fields, calls.
gen() {
  python3 - "$1" "$2" "$3" "$batch" <<'PY'
import struct, sys
what, fields, calls, batch = sys.argv[1], [float(x) for x in sys.argv[2].split()], int(sys.argv[3]), int(sys.argv[4])
verb, sha = what.split(' ', 1)
blob = struct.pack('<dddd', 0, 0, 0, 1) + struct.pack('<' + 'd' * 11, *fields)
out, k = bytearray(), 0
def bulk(b):
    b = b if isinstance(b, bytes) else b.encode()
    return b"$%d\r\n%s\r\n" % (len(b), b)
for _ in range(calls):
    keys = []
    for _ in range(batch):
        keys.append("bench:{u%d}:0" % (k % 10000))
        k += 1
    # Lone requests of one limit under Redis TIME are the same bytes: tollgate sends
    # the packed request once and an index naming it (0) for each request.
    args = [verb, sha, str(batch)] + keys + ["1", str(batch), bytes(2 * batch), blob]
    out += b"*%d\r\n" % len(args) + b"".join(bulk(a) for a in args)
sys.stdout.buffer.write(out)
PY
}


# Instructions per decision for one case: script file, the check's 11 fields.
measure() {
  local script="$1" fields="$2" port pid what total
  port="$(free_port)"
  rm -f "$work"/cg.out*
  valgrind --tool=callgrind --callgrind-out-file="$work/cg.out" redis-server --port "$port" \
    --bind 127.0.0.1 --save "" --appendonly no --loglevel warning >"$work/vg.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 150); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.2; done
  if [[ "$form" == function ]]; then
    what="FCALL $(redis-cli -p "$port" -x FUNCTION LOAD REPLACE <"$script")"
  else
    what="EVALSHA $(redis-cli -p "$port" SCRIPT LOAD "$(cat "$script")")"
  fi
  gen "$what" "$fields" 320 | redis-cli -p "$port" --pipe >/dev/null
  gen "$what" "$fields" "$calls" >"$work/calls.resp"
  callgrind_control -z "$pid" >/dev/null 2>&1
  redis-cli -p "$port" --pipe <"$work/calls.resp" >"$work/pipe.out"
  callgrind_control -d "$pid" >/dev/null 2>&1
  redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  wait "$pid" 2>/dev/null || true
  grep -q "errors: 0" "$work/pipe.out" || die "the script failed: $(cat "$work/pipe.out")"
  total="$(cat "$work"/cg.out.* | sed -n 's/^summary: //p' | sort -n | tail -1)"
  awk -v t="$total" -v n="$((batch * calls))" 'BEGIN { printf "%.0f", t / n }'
}

script() {
  local library=()
  [[ "$form" == function ]] && library=(--library)
  "$tollgate" redis-script "${library[@]}" "$1" >"$work/$1.lua"
  echo "$work/$1.lua"
}

# Fields: algorithm, tick, limit, window, burst, r, window/gcd, cost, shadow, lockout, queue.
printf '%-28s %s\n' "case (batch $batch, $form)" "instructions per decision"
printf '%-28s %s\n' "fixed_window 1s" "$(measure "$(script fixed_window)" "1 1 1e9 1e9 0 1 1 1 0 0 0")"
printf '%-28s %s\n' "fixed_window 1h" "$(measure "$work/fixed_window.lua" "1 1 1e9 3.6e12 0 1 3600 1 0 0 0")"
printf '%-28s %s\n' "sliding_window 1s" "$(measure "$(script sliding_window)" "2 1 1e9 1e9 0 1 1 1 0 0 0")"
printf '%-28s %s\n' "sliding_window 1h" "$(measure "$work/sliding_window.lua" "2 1 1e9 3.6e12 0 1 3600 1 0 0 0")"
printf '%-28s %s\n' "token_bucket" "$(measure "$(script token_bucket)" "4 1 1e9 1e9 1e9 1 1 1 0 0 0")"
printf '%-28s %s\n' "gcra" "$(measure "$(script gcra)" "5 1 1e9 1e9 1e9 1 1 1 0 0 0")"
printf '%-28s %s\n' "leaky_bucket (queue)" "$(measure "$(script leaky_bucket)" "6 1 1e9 1e9 1e9 1 1 1 0 0 1")"
printf '%-28s %s\n' "floor: GET + SET PX only" "$(measure "$work/floor.lua" "1 1 1e9 1e9 0 1 1 1 0 0 0")"
