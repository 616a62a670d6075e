#!/usr/bin/env bash
# Checks that a build against a pip LibTorch used nothing of Debian's LibTorch: no header from
# /usr/include/{torch,c10,ATen,caffe2} (a header the wheel lacks would silently resolve there) and
# no Debian libtorch/libc10 on any link line. Reads ninja's dependency log and link commands.
#   scripts/check_torch_single.sh <build dir>
set -euo pipefail
build=${1:?usage: check_torch_single.sh <build dir>}
cd "$build"
bad_headers=$(ninja -t deps | grep -E '^\s+/usr/include/(torch|c10|ATen|caffe2)/' | sort -u || true)
bad_libs=$(ninja -t commands | grep -oE '/usr/lib/[^ ]*lib(torch|c10)[^ ]*' | sort -u || true)
if [ -n "$bad_headers$bad_libs" ]; then
  echo "check_torch_single: $build mixes in Debian's LibTorch:" >&2
  echo "$bad_headers" | head -20 >&2
  echo "$bad_libs" | head -20 >&2
  echo "Fix: configure with -DCMAKE_PREFIX_PATH=<site-packages>/torch (scripts/torch_pip.sh)" >&2
  exit 1
fi
echo "check_torch_single: $build uses one LibTorch ($(grep -m1 '^Torch_DIR' CMakeCache.txt))"
