#!/usr/bin/python3
"""Where one training step's time goes, per mode, from fsdp-bench's Chrome traces.

  build/bin/fsdp-bench --compare --nproc 2 --trace /tmp/tr --no-torch-ddp --no-fsdp2 | tee c.jsonl
  python3 bench/trace_breakdown.py /tmp/tr [c.jsonl]

Reads DIR/<mode>/rank<k>.json (the last round's trace of each C++ mode; or DIR/rank<k>.json of
one `--mode M --trace DIR` run) and prints, per mode, the
mean over ranks of milliseconds per timed step: the step (forward + backward + optimizer step spans),
each of the three, the calling thread's waits for collectives (exposed communication), its copies
into and out of communication buffers (category "copy"), what remains of the step (compute), and
the time each communication lane had a collective in flight. With the --compare JSON lines it adds
the exposed communication they measured (ddp's waits happen inside c10d::Reducer, which the trace
does not see) and the minor page faults per step (the allocator's cost shows there: each fresh
page is zero-filled). The per-group forward and backward spans nest (a root's contains its children's), so they are not
summed. Standard library only.
"""
import collections
import json
import os
import statistics
import sys


def rank_figures(path):
    """Seconds per step of one rank's trace, by figure."""
    all_events = json.load(open(path))["traceEvents"]
    events = [e for e in all_events if e.get("ph") == "X"]
    threads = {e["tid"]: e["args"]["name"] for e in all_events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    steps = sum(1 for e in events if e["name"] == "optimizer.step")
    if steps == 0:
        return None
    f = collections.Counter()
    compute_tid = next((t for t, n in threads.items() if n == "compute"), None)
    for e in events:
        sec = e["dur"] / 1e6
        if e["cat"] == "step":
            f[e["name"]] += sec
            f["step"] += sec
        elif e["tid"] == compute_tid and e["cat"] == "wait":
            f["exposed comm"] += sec
        elif e["tid"] == compute_tid and e["cat"] == "copy":
            f["copies"] += sec
        elif e["cat"] == "comm":
            lane = threads.get(e["tid"], str(e["tid"])).split("/")[-1].split("#")[0]
            f["in flight: " + lane] += sec
    f["compute (rest)"] = f["step"] - f["exposed comm"] - f["copies"]
    return {k: v / steps for k, v in f.items()}


def from_lines(jsonl, key):
    """Median over the run's mode lines of `key`, by mode."""
    out = collections.defaultdict(list)
    for line in open(jsonl):
        if line.startswith("{"):
            j = json.loads(line)
            if "mode" in j and key in j:
                out[j["mode"]].append(j[key])
    return {m: statistics.median(v) for m, v in out.items()}


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    root = argv[0].rstrip("/")
    # DIR/<mode>/rank<k>.json from --compare --trace DIR; DIR/rank<k>.json from --mode M --trace DIR.
    dirs = {m: os.path.join(root, m) for m in sorted(os.listdir(root))
            if os.path.isdir(os.path.join(root, m))} or {os.path.basename(root): root}
    per_mode = {}
    for mode, d in dirs.items():
        ranks = [rank_figures(os.path.join(d, f)) for f in sorted(os.listdir(d))
                 if f.startswith("rank") and f.endswith(".json")]
        ranks = [r for r in ranks if r]
        if ranks:
            keys = sorted({k for r in ranks for k in r})
            per_mode[mode] = {k: statistics.mean(r.get(k, 0.0) for r in ranks) for k in keys}
    if not per_mode:
        print(f"trace_breakdown: no traces with timed steps under {root}", file=sys.stderr)
        return 1
    lines = argv[1] if len(argv) > 1 else None
    rows = ["step", "model.forward", "model.backward", "optimizer.step", "compute (rest)",
            "exposed comm", "copies"]
    rows += sorted({k for m in per_mode.values() for k in m if k.startswith("in flight")})
    modes = list(per_mode)
    print("| ms per step (mean over ranks) | " + " | ".join(f"`{m}`" for m in modes) + " |")
    print("|---|" + "---|" * len(modes))
    for r in rows:
        print(f"| {r} | " + " | ".join(f"{1e3 * per_mode[m].get(r, 0.0):.2f}" for m in modes) + " |")
    if lines:
        # ddp's waits are inside c10d::Reducer, not traced: its line measures them.
        exposed = from_lines(lines, "exposed_comm_s")
        print("| exposed comm, the run's lines | " +
              " | ".join(f"{1e3 * exposed.get(m, float('nan')):.2f}" for m in modes) + " |")
        fault = from_lines(lines, "minor_faults_per_step")
        print("| minor page faults per step | " +
              " | ".join(f"{fault.get(m, float('nan')):.0f}" for m in modes) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
