#!/usr/bin/python3
"""Where one training step's time goes, per mode, from fsdp-bench's Chrome traces.

  build/bin/fsdp-bench --compare --nproc 2 --trace /tmp/tr --no-torch-ddp --no-fsdp2 | tee c.jsonl
  python3 bench/trace_breakdown.py /tmp/tr [c.jsonl] [--per-group G] [--above MODE]

--per-group G prints microseconds per group and step (G groups: blocks + the root; --preset
overhead's 48 blocks: 49) instead of milliseconds per step; --above MODE adds, for every other
mode, its difference from MODE (e.g. `local`, the compute floor). The exposed waits and the copies
are also split by collective (all_gather, which includes the small all-gathers of the forward
rounds, reduce_scatter) and by kind (copy-in, pack, copy-out).

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
import argparse
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
            f["exposed: " + e["name"].split(" ", 1)[-1]] += sec  # wait all_gather -> all_gather
        elif e["tid"] == compute_tid and e["cat"] == "copy":
            f["copies"] += sec
            f["copies: " + e["name"].split(" ", 1)[0]] += sec  # copy-out h.3 -> copy-out
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
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("dir")
    p.add_argument("lines", nargs="?")
    p.add_argument("--per-group", type=int, default=0)
    p.add_argument("--above", default="")
    args = p.parse_args(argv)
    argv = [args.dir] + ([args.lines] if args.lines else [])
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
    def present(prefix):
        return sorted({k for m in per_mode.values() for k in m if k.startswith(prefix)})
    rows = ["step", "model.forward", "model.backward", "optimizer.step", "compute (rest)",
            "exposed comm"] + present("exposed: ") + ["copies"] + present("copies: ")
    rows += present("in flight")
    modes = list(per_mode)
    groups = args.per_group
    unit, scale = ("us per group and step", 1e6 / groups) if groups else ("ms per step", 1e3)
    floor = args.above if args.above in per_mode else None
    cols = modes + ([f"{m} - {floor}" for m in modes if m != floor] if floor else [])
    print(f"| {unit} (mean over ranks) | " + " | ".join(f"`{c}`" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        vals = [per_mode[m].get(r, 0.0) for m in modes]
        if floor:
            vals += [per_mode[m].get(r, 0.0) - per_mode[floor].get(r, 0.0)
                     for m in modes if m != floor]
        print(f"| {r} | " + " | ".join(f"{scale * v:.2f}" for v in vals) + " |")
    if lines:
        # ddp's waits are inside c10d::Reducer, not traced: its line measures them.
        exposed = from_lines(lines, "exposed_comm_s")
        print("| exposed comm, the run's lines | " +
              " | ".join(f"{scale * exposed.get(m, float('nan')):.2f}" for m in modes) + " |")
        fault = from_lines(lines, "minor_faults_per_step")
        per = f"per group and step" if groups else "per step"
        print(f"| minor page faults {per} | " +
              " | ".join(f"{fault.get(m, float('nan')) / (groups or 1):.0f}" for m in modes) +
              " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
