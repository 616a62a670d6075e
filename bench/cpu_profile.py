#!/usr/bin/python3
"""Where the ranks' CPU time goes, per training mode, from `perf record` samples.

  python3 bench/cpu_profile.py [--nproc 2] [--steps 12] [--modes local,fsdp,fsdp2,...]
  python3 bench/cpu_profile.py --from-report perf_report.txt [--comm fsdp-bench]

Runs each mode once (fsdp-bench --mode M for local, ddp, fsdp, fsdp-noreshard; bench/torch_ddp.py
for PyTorch's DDP (torch-ddp) and FSDP2 (fsdp2)) under `perf record`, skipping the first
--delay-s seconds (start-up, model build, warm-up), and sorts the samples of the rank processes
into what they were doing: matrix multiplies, other compute, copies (tensor copies and memcpy: the
communication buffers' copy-in/pack/copy-out, shared-memory and socket transfers), the reductions'
summation, the allocator (malloc/free and the kernel's page faults: each fresh page is
zero-filled), communication and waiting (sockets, futexes, the scheduler), the Python interpreter,
and the rest. Prints one Markdown table: the share of each mode's CPU samples per category, the
step time of the same run, and the samples counted. On a machine whose cores the ranks' compute
fills (2 ranks on 2 cores), every category but compute adds to the step time.

Needs Linux `perf` with permission to record the ranks (perf_event_paranoid <= 1, or root), and
for the Python peers torch 2.15 (--python, as fsdp-bench --compare). Standard library only.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CPP_MODES = ["local", "ddp", "fsdp", "fsdp-noreshard"]
PY_MODES = {"torch-ddp": "ddp", "fsdp2": "fsdp2"}

# (category, regex over the symbol), first match wins: user space, then the kernel's.
USER = [
    ("matmul", r"gemm|mkl_blas|dnnl|brgemm|jit_avx"),
    ("summation", r"sum_spans|rank_order_sum|gloo::sum|gloo::.*reduce"),
    ("copies", r"direct_copy_kernel|copy_kernel|memmove|memcpy|cat_serial|copy_impl"),
    ("allocator, page faults", r"malloc|_int_free|^free$|cfree|sysmalloc|munmap|mmap|madvise"),
    ("communication, waiting", r"gloo|c10d|ShmExchange|futex|pthread_cond|epoll|recv|send"),
    ("python interpreter", r"_PyEval|PyObject|_Py|Py_"),
]
KERNEL = [
    ("copies", r"copy_user|copy_to_user|copy_from_user|copy_page|memcpy|memmove"),
    ("allocator, page faults", r"page_fault|clear_page|anonymous_page|handle_mm_fault|alloc_pages|"
                               r"zap_pte|unmap_page|free_pages|release_pages|folio|lru|memcg|"
                               r"pte_|tlb|rmqueue|vma|charge|mmap|munmap|madvise|page"),
    ("communication, waiting", r"futex|schedule|finish_task_switch|tcp|skb|sock|ep_poll|poll|"
                               r"recv|send|inet|ip_|net_|loopback|sched|pick_next|switch|wake|"
                               r"nanosleep|hrtimer|syscall|irq|softirq"),
]
ORDER = ["matmul", "other compute", "copies", "summation", "allocator, page faults",
         "communication, waiting", "python interpreter", "other kernel"]


def classify(dso, sym, kernel):
    for name, pattern in KERNEL if kernel else USER:
        if re.search(pattern, sym):
            return name
    if kernel:
        return "other kernel"
    if re.search(r"libpython|python3", dso):
        return "python interpreter"
    return "other compute"


def parse_report(text, rank_comms):
    """Shares per category from `perf report --stdio --sort comm,dso,sym` output, counting only
    the samples of the rank processes' threads (command names starting with `rank_comms`: the
    ranks' own threads and Gloo's, which name themselves gloo_*)."""
    shares = {}
    line_re = re.compile(r"^\s*([\d.]+)%\s+(\S+)\s+(\S+)\s+\[([.k])\]\s+(.*?)\s*$")
    for line in text.splitlines():
        m = line_re.match(line)
        if not m:
            continue
        pct, comm, dso, sym = float(m.group(1)), m.group(2), m.group(3), m.group(5)
        if not any(comm.startswith(c) for c in rank_comms):
            continue
        cat = classify(dso, sym, m.group(4) == "k")
        shares[cat] = shares.get(cat, 0.0) + pct
    total = sum(shares.values())
    return {k: 100.0 * v / total for k, v in shares.items()} if total else {}


def command(mode, args):
    size = ["--layers", str(args.layers), "--width", str(args.width), "--seq", str(args.seq),
            "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if mode in PY_MODES:
        return [args.python, os.path.join(HERE, "torch_ddp.py"), "--nproc", str(args.nproc),
                "--mode", PY_MODES[mode]] + size, ("python", "pt_", "gloo")
    return [args.bench, "--mode", mode, "--nproc", str(args.nproc)] + size, ("fsdp-bench", "gloo")


def profile(mode, args, workdir):
    cmd, comms = command(mode, args)
    data = os.path.join(workdir, f"{mode}.data")
    rec = ["perf", "record", "-F", str(args.frequency), "-D", str(int(args.delay_s * 1000)),
           "-o", data, "--"] + cmd
    run = subprocess.run(rec, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"cpu_profile: {' '.join(rec)} failed ({run.returncode}): {run.stderr[-2000:]}")
    line = next((l for l in run.stdout.splitlines() if l.startswith("{")), "{}")
    rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--sort", "comm,dso,sym"],
                         capture_output=True, text=True)
    samples = re.search(r"# Samples: (\S+)", rep.stdout)
    return json.loads(line), parse_report(rep.stdout, comms), samples.group(1) if samples else "?"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="local,ddp,fsdp,fsdp-noreshard,torch-ddp,fsdp2")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    for name, default in (("layers", 8), ("width", 512), ("seq", 256), ("batch", 2)):
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--delay-s", type=float, default=10.0,
                   help="seconds after start before sampling (start-up, build, warm-up)")
    p.add_argument("--frequency", type=int, default=499, help="samples per second per CPU")
    p.add_argument("--bench", default=os.path.join(HERE, "..", "build", "bin", "fsdp-bench"))
    p.add_argument("--python", default=os.path.join(
        os.environ.get("TORCH_PIP_VENV", "/opt/fsdp-cpp/torch215"), "bin", "python3"))
    p.add_argument("--from-report", metavar="FILE",
                   help="classify a saved `perf report --stdio --sort comm,dso,sym` instead of "
                        "running anything (the samples of --comm's processes)")
    p.add_argument("--comm", default="fsdp-bench", help="--from-report: the ranks' command name")
    args = p.parse_args()
    if args.from_report:
        with open(args.from_report) as f:
            shares = parse_report(f.read(), (args.comm,))
        print("| share of the ranks' CPU samples, % | `report` |")
        print("|---|---|")
        for cat in ORDER:
            print(f"| {cat} | {shares.get(cat, 0):.1f} |")
        return
    modes = args.modes.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for mode in modes:
            print(f"cpu_profile: {mode} ...", file=sys.stderr, flush=True)
            results[mode] = profile(mode, args, workdir)
    print("| share of the ranks' CPU samples, % | " + " | ".join(f"`{m}`" for m in modes) + " |")
    print("|---|" + "---|" * len(modes))
    for cat in ORDER:
        if any(results[m][1].get(cat, 0) > 0.05 for m in modes):
            print(f"| {cat} | " + " | ".join(f"{results[m][1].get(cat, 0):.1f}" for m in modes) + " |")
    print("| step s (this run, median) | " +
          " | ".join(f"{results[m][0].get('step_s_median', float('nan')):.2f}" for m in modes) + " |")
    print("| samples | " + " | ".join(results[m][2] for m in modes) + " |")


if __name__ == "__main__":
    main()
