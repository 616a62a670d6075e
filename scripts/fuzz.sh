#!/usr/bin/env bash
# Builds and runs the libFuzzer targets of the checkpoint parsers (docs/checkpoint.md):
#   fuzz_safetensors  the safetensors header parser + range reader (fuzz/fuzz_safetensors.cpp)
#   fuzz_index        the checkpoint index parser (fuzz/fuzz_index.cpp)
# Usage: scripts/fuzz.sh [seconds per target, default 120] [target...]
# Needs clang (14+) with its libFuzzer runtime (Debian: clang-14 + libclang-rt-14-dev); the parsers
# are torch-free, so only libxxhash is linked. Findings (crash-*, leak-*, timeout-*) are written to
# build-fuzz/findings/; the script exits non-zero when a target finds one.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${1:-120}"
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(fuzz_safetensors fuzz_index)
CXX="${FUZZ_CXX:-$(command -v clang++-14 || command -v clang++)}"
OUT=build-fuzz
mkdir -p "$OUT/findings"
FLAGS=(-std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Iinclude -Isrc)
SRCS=(src/checkpoint/safetensors_header.cpp src/checkpoint/safetensors_file.cpp
      src/checkpoint/index.cpp src/checkpoint/strict_json.cpp
      src/checkpoint/hex.cpp src/checkpoint/atomic_file.cpp)
declare -A SEEDS=([fuzz_safetensors]=fuzz/corpus/safetensors [fuzz_index]=fuzz/corpus/index)
status=0
for t in "${TARGETS[@]}"; do
  echo "== building $t with $CXX"
  "$CXX" "${FLAGS[@]}" "fuzz/$t.cpp" "${SRCS[@]}" -lxxhash -o "$OUT/$t"
  mkdir -p "$OUT/corpus-$t"
  echo "== running $t for ${SECS}s"
  # New inputs go to build-fuzz/corpus-<t>; the checked-in seeds are read only.
  rc=0
  "$OUT/$t" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$OUT/findings/$t-" \
    "$OUT/corpus-$t" "${SEEDS[$t]}" >"$OUT/$t.log" 2>&1 || rc=$?
  grep -E "^(Done|==[0-9]+==ERROR|SUMMARY|stat::number_of_executed_units)" "$OUT/$t.log" || true
  if [ "$rc" -ne 0 ]; then
    echo "== $t: FINDING (exit $rc), see $OUT/$t.log and $OUT/findings/"
    status=1
  fi
done
exit $status
