#!/usr/bin/env bash
# Runs one coverage-guided fuzz target (cargo fuzz, libFuzzer) for SECONDS, starting from
# the committed seeds (fuzz/seeds/TARGET) and the corpus earlier runs grew
# (fuzz/corpus/TARGET, not committed). Prints libFuzzer's final stats (executions,
# coverage). A crash leaves its input in fuzz/artifacts/TARGET/: turn it into a
# regression test beside the code it broke, then fix.
#
# Needs a nightly toolchain (`rustup toolchain install nightly`) and cargo-fuzz
# (`cargo install cargo-fuzz`). Not part of the tests.
#
# Usage: tools/fuzz.sh TARGET SECONDS      tools/fuzz.sh --list
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
if [ "${1:-}" = "--list" ] || [ $# -lt 2 ]; then
  echo "usage: tools/fuzz.sh TARGET SECONDS; targets:"
  cargo +nightly fuzz list
  exit 0
fi
target=$1 seconds=$2
mkdir -p "corpus/$target"
# Each target's own limits: inputs up to 64 KB, 2 GB of memory (an input that needs
# more is a finding), one input at most 10 s.
cargo +nightly fuzz run "$target" "corpus/$target" "seeds/$target" -- \
  -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048 -timeout=10 \
  -print_final_stats=1
