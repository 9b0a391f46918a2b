#!/usr/bin/env bash
# CPU per input byte for every hostile input of every parser that reads untrusted bytes
# (crates/tollgate-server/tests/hostile/): each case runs once at its base size and at
# eight times it under callgrind, counting only the parse (`parse_once`). Prints the
# instructions per input byte at both sizes and their ratio; a parser whose work grows
# faster than its input shows a ratio well above 1.
#
# The allocation side of the same property is a test (tests/amplification.rs); this is
# a measurement (instruction counts are stable, but what is acceptable per byte is a
# judgement, so nothing here fails on a threshold).
#
# Usage: tools/check-amplification.sh [CASE-FILTER]     (needs valgrind)
set -euo pipefail
cd "$(dirname "$0")/.."
filter=${1:-}
cargo build -q --release -p tollgate-server --example hostile_input
bin=target/release/examples/hostile_input
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

instructions() { # case factor -> "bytes instructions"
  local out="$tmp/cg.out"
  local bytes
  bytes=$(valgrind --tool=callgrind --callgrind-out-file="$out" \
    --toggle-collect='hostile_input::parse_once*' "$bin" "$1" "$2" 2>/dev/null)
  echo "$bytes $(callgrind_annotate "$out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}')"
}

printf '%-40s %12s %10s %12s %10s %7s\n' case bytes "Ir/byte" "8× bytes" "Ir/byte" ratio
"$bin" --list | while IFS= read -r case; do
  [[ -n "$filter" && "$case" != *"$filter"* ]] && continue
  read -r b1 i1 < <(instructions "$case" 1)
  read -r b8 i8 < <(instructions "$case" 8)
  awk -v c="$case" -v b1="$b1" -v i1="$i1" -v b8="$b8" -v i8="$i8" 'BEGIN {
    p1 = i1 / b1; p8 = i8 / b8;
    printf "%-40s %12d %10.1f %12d %10.1f %7.2f\n", c, b1, p1, b8, p8, (p1 > 0 ? p8 / p1 : 0) }'
done
