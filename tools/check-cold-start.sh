#!/usr/bin/env bash
# Fresh instances decide from Redis from their first request, at the default deadline.
#
# Runs the test `fresh_instances_decide_in_redis_from_their_first_request`
# (crates/tollgate-server/tests/redis.rs) on release builds with `--redis-deadline 20ms`,
# the default, instead of the test suite's 5 s: for each algorithm, four fresh
# `tollgate serve` on a Redis holding no script, 700 calls with 100 in flight on one key
# limited to 300 a day; it passes when exactly 300 are admitted, no call is answered by a
# failure mode, and Redis sees no connection and no script load once the instances are
# ready. Timing-sensitive: run it on a machine doing nothing else (a busy 2-core machine
# can miss a 20 ms deadline for reasons that have nothing to do with the start-up).
#
#   bash tools/check-cold-start.sh            COLD_START_DEADLINE=50ms to try another
set -euo pipefail
cd "$(dirname "$0")/.."
COLD_START_DEADLINE="${COLD_START_DEADLINE:-20ms}" \
  cargo test --release -q -p tollgate-server --test redis fresh_instances -- --nocapture
