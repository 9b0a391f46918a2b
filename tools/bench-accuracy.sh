#!/usr/bin/env bash
# How close each algorithm stays to the exact rule (at most LIMIT in any rolling 60 s),
# on simulated steady, Poisson and bursty traffic at 0.5 to 5 times the limit: the most
# admitted in any rolling window and the share of decisions that differ from the exact
# rule's on the same history. Deterministic (a fixed seed); see
# crates/tollgate/benches/accuracy.rs for what each column means.
#
#   bash tools/bench-accuracy.sh                 # 200 keys, 30 simulated minutes, 100/60 s
#   KEYS=50 MINUTES=10 LIMIT=1000 ALGORITHMS=sliding_window,sliding_log bash tools/bench-accuracy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bench_name=bench-accuracy
source tools/lib.sh

log "building and running (release)..."
KEYS="${KEYS:-200}" MINUTES="${MINUTES:-30}" LIMIT="${LIMIT:-100}" ALGORITHMS="${ALGORITHMS:-}" \
  cargo bench -q -p tollgate --bench accuracy
