#!/usr/bin/python3
"""Markdown tables for README.md and docs/benchmarks.md from fsdp-bench's JSON lines (stdin).

  build/bin/fsdp-bench --compare --nproc 2 | tee compare.jsonl | python3 bench/tables.py
  build/bin/fsdp-bench --comm --nproc 2 --ops all_gather,reduce_scatter | python3 bench/tables.py

Understands the mode lines and the summary of --compare (per mode: the median over rounds of each
round's figures; ratios: median [min, max] over rounds), the rows of --memory-scaling and
--max-model, and --comm's bandwidth and ratio lines. Several --compare runs may follow each other
on stdin (N=2 and 4, fp32 and bf16): each summary closes its run, one pair of tables per run.
The Python peers (`torch-ddp`, `fsdp2`) do not measure exposed communication or bytes: "n/a".
Standard library only.
"""
import json
import statistics
import sys


def fmt(x, nd=2):
    return f"{x:.{nd}f}"


def median_of(runs, key, scale=1.0, nd=2):
    """The median over rounds of `key`, or n/a where the mode does not report it."""
    values = [r[key] / scale for r in runs if key in r]
    return fmt(statistics.median(values), nd) if values else "n/a"


def mode_table(modes):
    print("| mode | step s, median of rounds [min, max of rounds] | tokens/s/rank | exposed comm s/step"
          " | MB sent/step | training memory MB | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for m, runs in modes.items():
        med = [r["step_s_median"] for r in runs]
        mp = runs[0].get("mixed_precision", "none")
        label = f"`{m}`" + (f" ({mp})" if mp != "none" else "")
        print(f"| {label} | {fmt(statistics.median(med))} [{fmt(min(med))}, {fmt(max(med))}] | "
              f"{median_of(runs, 'tokens_per_s_per_rank', nd=1)} | "
              f"{median_of(runs, 'exposed_comm_s', nd=3)} | "
              f"{median_of(runs, 'bytes_sent_per_step', 1e6, 1)} | "
              f"{median_of(runs, 'train_memory_mb', nd=0)} | {median_of(runs, 'peak_rss_mb', nd=0)} |")
    print()


def main():
    modes, summaries, comm, ratios = {}, [], {}, {}
    for line in sys.stdin:
        line = line.strip()
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        if "summary" in j:
            summaries.append((j, modes))
            modes = {}  # the next run's
        elif "mode" in j:
            modes.setdefault(j["mode"], []).append(j)
        elif "ratio" in j:
            ratios[(j["world"], j["bytes"])] = j
        elif "op" in j:
            comm[(j["world"], j["bytes"], j["op"])] = j
    for s, run_modes in summaries:
        if s["summary"] == "compare":
            if run_modes:
                mode_table(run_modes)
            mp = s.get("mixed_precision", "none")
            print(f"| ratio (N={s['world']}, {s['preset']} preset, {'fp32' if mp == 'none' else mp}, "
                  f"{s['rounds']} rounds) | median [min, max] | target |")
            print("|---|---|---|")
            targets = {k.split("<=")[0]: (k.split("<=")[1], v) for k, v in s["targets_met"].items()}
            for k, v in s.items():
                if "_over_" in k and not k.endswith("_range"):
                    lo, hi = s[k + "_range"]
                    t = targets.get(k)
                    goal = f"<= {t[0]}: {'met' if t[1] else 'missed'}" if t else ""
                    print(f"| `{k}` | {fmt(v)} [{fmt(lo)}, {fmt(hi)}] | {goal} |")
            print(f"\nload average (1, 5, 15 min): {s['loadavg_start']} at the start, "
                  f"{s['loadavg_end']} at the end\n")
        elif s["summary"] == "memory-scaling":
            print(f"| N | fsdp MB | ddp MB | 16P/N MB | fsdp/ddp |  ({s['params'] / 1e6:.1f} M parameters)")
            print("|---|---|---|---|---|")
            for r in s["rows"]:
                print(f"| {r['world']} | {fmt(r['fsdp_mb'], 0)} | {fmt(r['ddp_mb'], 0)} | "
                      f"{fmt(r['states_16p_over_n_mb'], 0)} | {fmt(r['fsdp_over_ddp'])} |")
            print(f"\nload average: {s['loadavg_start']} -> {s['loadavg_end']}\n")
        elif s["summary"] == "max-model":
            print(f"| N={s['world']}, {s['memory_mb']:.0f} MB per rank | layers | parameters | "
                  "peak RSS MB |")
            print("|---|---|---|---|")
            for m in ("ddp", "fsdp"):
                r = s[m]
                print(f"| `{m}` | {r['layers']} | {r['params'] / 1e6:.1f} M | "
                      f"{fmt(r.get('peak_rss_mb', 0), 0)} |")
            print(f"\nfsdp/ddp trainable parameters: {s.get('fsdp_params_over_ddp')}; load average: "
                  f"{s['loadavg_start']} -> {s['loadavg_end']}\n")
    if comm:
        worlds = sorted({w for w, _, _ in comm})
        sizes = sorted({b for _, b, _ in comm})
        ops = [o for o in ("all_gather", "reduce_scatter", "all_reduce") if any(k[2] == o for k in comm)]
        head = [f"N={w} {o}" for w in worlds for o in ops]
        if ratios:
            head += [f"N={w} rs/ag" for w in worlds]
        print("| bytes | " + " | ".join(head) + " |")
        print("|---|" + "---|" * len(head))
        for b in sizes:
            cells = []
            for w in worlds:
                for o in ops:
                    j = comm.get((w, b, o))
                    cells.append(f"{j['busbw_gbps_median']:.2f}" if j else "")
            for w in worlds if ratios else []:
                r = ratios.get((w, b))
                cells.append(f"{r['busbw_ratio_median']:.2f} [{r['busbw_ratio_min']:.2f}, "
                             f"{r['busbw_ratio_max']:.2f}]" if r else "")
            label = f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
            print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
