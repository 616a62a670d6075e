#!/usr/bin/env bash
# Kill trials (issue 13, extended by issue 49). Usage:
#   tests/kill_trials.sh [trials=20] [FSDP_TIMEOUT_S=20]
#     Without a launcher: two ranks started directly (no fsdp-run, no torchrun) train a tiny
#     sharded GPT (the rank body of netns_test, on loopback); once both passed step 20, rank 1 gets
#     SIGKILL. Reports, per trial, rank 0's exit status, its exit time after the kill, and the first
#     line of its error.
#   tests/kill_trials.sh --async-save [trials=20]
#     fsdp-train (2 ranks under fsdp-run) with a background save after every step (--save-every 1
#     --async-save --resume auto) is killed with SIGKILL at a random moment (fsdp-run, whose ranks
#     die with it, or one rank), then started again with the same command line. Reports per trial
#     where it was killed, the checkpoint it resumed from, and whether its losses equal an
#     uninterrupted run's (exit status 1 when any trial's do not).
# (FSDP_KILL_BIN=path runs a copy of build/bin/fsdp_tests, e.g. while a build relinks it.)
set -uo pipefail
cd "$(dirname "$0")/.."

async_trials() {
  local trials="${1:-20}" steps=60 bad=0
  local dir
  dir=$(mktemp -d /tmp/fsdp-kill-async-XXXXXX)
  # fsdp-train's default model (a save takes about a step): the kill lands in steps and saves alike.
  local args=(--threads 1 --steps $steps --warmup 5 --sample-tokens 0 --eval-every 0 --quiet
              --nproc 2)
  build/bin/fsdp-train "${args[@]}" --run-dir "$dir/ref" >/dev/null 2>&1 || { echo "reference run failed"; exit 1; }
  local want
  want=$(cut -d, -f2 "$dir/ref/metrics.csv" | tail -n +2 | md5sum)
  for t in $(seq 1 "$trials"); do
    local run="$dir/t$t" after=$((3 + RANDOM % 40))
    build/bin/fsdp-train "${args[@]}" --save-every 1 --async-save --resume auto --run-dir "$run" \
      >"$run.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 6000); do
      [ -f "$run/metrics.csv" ] && [ "$(($(wc -l <"$run/metrics.csv") - 1))" -ge "$after" ] && break
      sleep 0.01
    done
    sleep "0.0$((RANDOM % 10))"
    local victim=fsdp-run
    if ((t % 2)); then
      kill -KILL "$pid"
    else
      local ranks
      ranks=$(pgrep -P "$pid" fsdp-train | head -1)
      victim="rank pid $ranks"
      kill -KILL "$ranks" 2>/dev/null || kill -KILL "$pid"
    fi
    wait "$pid" 2>/dev/null
    sleep 0.3
    local steps_done=0
    [ -f "$run/metrics.csv" ] && steps_done=$(($(wc -l <"$run/metrics.csv") - 1))
    local out
    out=$(build/bin/fsdp-train "${args[@]}" --save-every 1 --async-save --resume auto \
      --run-dir "$run" 2>&1)
    local status=$? from got
    from=$(grep -o "resuming from [^ ]*" <<<"$out" | sed 's/.*step_0*//')
    got=$(cut -d, -f2 "$run/metrics.csv" | tail -n +2 | md5sum)
    local same=equal
    [ "$got" = "$want" ] && [ $status -eq 0 ] || { same=DIFFERENT; bad=1; }
    printf 'trial %2d: killed %s after %d steps recorded; resumed from step %s; exit %d; losses %s\n' \
      "$t" "$victim" "$steps_done" "${from:-?}" "$status" "$same"
  done
  rm -rf "$dir"
  exit $bad
}

if [ "${1:-}" = "--async-save" ]; then
  async_trials "${2:-20}"
fi

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
