#!/usr/bin/env bash
# Kill trials without a launcher (issue 13): two ranks started directly (no fsdp-run, no torchrun)
# train a tiny sharded GPT (the rank body of netns_test, on loopback); once both passed step 20,
# rank 1 gets SIGKILL. Reports, per trial, rank 0's exit status, its exit time after the kill, and
# the first line of its error. Usage: tests/kill_trials.sh [trials=20] [FSDP_TIMEOUT_S=20]
# (FSDP_KILL_BIN=path runs a copy of build/bin/fsdp_tests, e.g. while a build relinks it).
set -uo pipefail
cd "$(dirname "$0")/.."
TRIALS="${1:-20}"
TIMEOUT="${2:-20}"
BIN=${FSDP_KILL_BIN:-build/bin/fsdp_tests}
FILTER=--gtest_filter=TwoHostsTest.TrainsAcrossNamespacesThenACutLinkEndsBothRanks
dir=$(mktemp -d /tmp/fsdp-kill-XXXXXX)
for t in $(seq 1 "$TRIALS"); do
  port=$((30000 + RANDOM % 20000))
  for r in 0 1; do
    FSDP_NETNS_RANK=1 RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      FSDP_TIMEOUT_S=$TIMEOUT OMP_NUM_THREADS=1 "$BIN" "$FILTER" >"$dir/r$r.log" 2>&1 &
    eval "pid$r=\$!"
  done
  for _ in $(seq 1 600); do
    grep -q "^step 20 " "$dir/r0.log" && grep -q "^step 20 " "$dir/r1.log" && break
    sleep 0.05
  done
  start=$(date +%s.%N)
  kill -KILL "$pid1"
  wait "$pid0"; status=$?
  end=$(date +%s.%N)
  wait "$pid1" 2>/dev/null
  msg=$(grep -m1 "^error: " "$dir/r0.log" | cut -c1-400)
  printf 'trial %2d: rank 0 exit %d after %.2f s: %s\n' "$t" "$status" "$(echo "$end - $start" | bc)" "$msg"
done
rm -rf "$dir"
