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

# The wheel ships no gloo headers; src/compat/gloo.cpp compiles ProcessGroupGloo.hpp against
# Debian's older libgloo-dev ([Note: Gloo headers]). That is safe only while no code from those
# headers reaches the programs: no gloo symbol defined in them, and the only Gloo references the
# four exported c10d functions that build the backend.
allowed='c10d::ProcessGroupGloo::(createDefaultDevice|createDeviceForHostname|Options::Options|ProcessGroupGloo)\('
for prog in bin/*; do
  [ -x "$prog" ] && [ "$(head -c 4 "$prog" | tail -c 3)" = ELF ] || continue
  defined=$(nm -C --defined-only "$prog" | grep -E ' (gloo::|c10d::ProcessGroupGloo::)' || true)
  used=$(nm -C -u "$prog" | grep -i gloo | grep -vE "$allowed" || true)
  if [ -n "$defined$used" ]; then
    echo "check_torch_single: $prog uses Gloo beyond the four exported c10d functions" \
         "([Note: Gloo headers] in docs/design.md):" >&2
    echo "$defined" "$used" | head -20 >&2
    exit 1
  fi
done
echo "check_torch_single: no code from the gloo headers in $build/bin (only c10d's exported functions)"
