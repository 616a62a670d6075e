#!/bin/bash
# clang's thread-safety analysis (-Wthread-safety, as errors) over every source that takes or
# declares an annotated lock (src/util/mutex.h), with the include paths and definitions of the
# build in $1 (its compile_commands.json). Syntax only: nothing is built.
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
command -v clang++ > /dev/null || { echo "thread-safety: clang++ is missing (apt-get install clang)"; exit 1; }
[ -f "$build/compile_commands.json" ] || { echo "thread-safety: $build/compile_commands.json is missing: configure $build first"; exit 1; }
# The sources that include util/mutex.h, directly or through other headers of src/.
headers="util/mutex.h"
while :; do
  pattern=$(for h in $headers; do printf '#include ".*%s"\\|' "$(basename "$h")"; done | sed 's/\\|$//')
  more=$(git grep -l -e "$pattern" -- 'src/*.h' | sed 's|^src/||' | sort -u)
  all=$(printf '%s\n' $headers $more | sort -u)
  [ "$all" = "$(printf '%s\n' $headers | sort -u)" ] && break
  headers=$all
done
sources=$(git grep -l -e "$pattern" -- 'src/*.cpp')
python3 - "$build" $sources <<'PY'
import json, shlex, subprocess, sys
build, sources = sys.argv[1], sys.argv[2:]
cmd = next(e["command"] for e in json.load(open(f"{build}/compile_commands.json"))
           if "/fsdp.dir/" in e.get("output", e["command"]))
flags, skip = [], False
for a in shlex.split(cmd)[1:]:
    if skip:
        skip = False
        continue
    if a in ("-o", "-c", "-include"):
        skip = True
        continue
    if a.startswith(("-D", "-I", "-isystem", "-std=")) or (flags and flags[-1] == "-isystem"):
        flags.append(a)
failed = 0
for src in sources:
    r = subprocess.run(["clang++", *flags, "-fsyntax-only", "-Wthread-safety",
                        "-Werror=thread-safety", "-Wno-unknown-warning-option", src],
                       capture_output=True, text=True)
    errors = [l for l in r.stderr.splitlines() if "thread-safety" in l or "error" in l]
    print(f"thread-safety: {src}: {'ok' if r.returncode == 0 else 'FAILED'}")
    if r.returncode != 0:
        failed += 1
        print(r.stderr[-4000:])
sys.exit(1 if failed else 0)
PY
