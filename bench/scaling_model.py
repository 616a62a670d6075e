#!/usr/bin/python3
"""A scaling model of a fully sharded training step (issue 50, item 4; docs/performance.md).

The step is simulated as two resources in time: the compute stream, which runs each group's
forward, then each group's backward (in reverse), then the optimizer step; and the network, which
runs the collectives one after another in the order they are issued (all-gathers and
reduce-scatters share its bandwidth). A group's forward or backward waits for its all-gather; a
group's all-gather is issued when the group `prefetch` places before it starts (fsdp-cpp's
default and FSDP2's: one ahead, `max_unsharded_groups = 2`); a group's reduce-scatter is issued
when its backward ends; the optimizer waits for the last reduce-scatter. A collective of B bytes
over N ranks takes alpha(N) + B (N - 1) / N / busbw (nccl-tests' bus bandwidth convention).
Resharding after forward (`true`) gathers every block again in backward, except the last (kept
gathered, as fsdp-cpp's trainer and torchtitan do); `false` gathers once; hpZ (`k`) gathers the
backward's copy within k ranks, over the intra-node links.

  python3 bench/scaling_model.py table [--dtype bf16|fp32] [--batch 4]
      the step of the 1.28 B GPT of docs/performance.md's H200 table (24 x 2048, 16 heads, seq
      1024, batch 4 per GPU, vocabulary 32768) at 8, 64 and 512 GPUs, fsdp-cpp's schedule and
      FSDP2's, from the H200 step at N = 1 and published NCCL bus bandwidths (printed with their
      sources)
  python3 bench/scaling_model.py validate TRACE_DIR --world N --ag-gbps A --rs-gbps R
      [--layers 8 --width 512 --vocab 256 --seq 256]
      this machine: the per-group compute times, the optimizer step and the step itself from an
      `fsdp-bench --mode fsdp --nproc N --trace TRACE_DIR` run (mean over ranks and steps), the
      bus bandwidths from `fsdp-bench --comm --nproc N`; prints the model's step beside the
      measured one

Standard library only.
"""
import argparse
import collections
import json
import os
import statistics
import sys


# ---- the model ----------------------------------------------------------------------------------
class Net:
    """The links: busbw in bytes/s, alpha in seconds (per collective, latency)."""

    def __init__(self, busbw, alpha, intra_busbw=None, intra_alpha=None):
        self.busbw, self.alpha = busbw, alpha
        self.intra_busbw = intra_busbw or busbw
        self.intra_alpha = alpha if intra_alpha is None else intra_alpha

    def time(self, nbytes, ranks, intra=False):
        if ranks <= 1:
            return 0.0
        bw, a = (self.intra_busbw, self.intra_alpha) if intra else (self.busbw, self.alpha)
        return a + nbytes * (ranks - 1) / ranks / bw


def simulate(groups, n, net, optimizer_s, reshard="true", hpz=8, prefetch=1, copy_out_s=None,
             host_s=0.0):
    """Seconds of one step.

    groups: [(name, forward_s, backward_s, gather_bytes, reduce_bytes)] in forward order, the
    root first (gathered first, kept gathered to the end, reduced last; its own compute, the
    embedding and the head, is counted with the last block, which runs next to the head). Or one
    such list per rank (their compute times differ; sizes must not): a collective then starts
    when the last rank has issued it, so a slower rank's compute shows as the others' waits.
    reshard: "true" (the blocks but the last are gathered again in backward), "false" (gathered
    once), or "hpz" (gathered again within `hpz` ranks, over the intra-node links).
    copy_out_s: per group, compute-stream seconds after each of its all-gathers (FSDP2's copy-out
    of the gathered parameters; fsdp-cpp gathers into place: None).
    host_s: the host's seconds per group and step (hooks, bookkeeping, Python), half in forward
    and half in backward; a group's work starts on the device only once the host has issued it
    (the host otherwise runs ahead).
    optimizer_s: seconds, or one per rank. Returns the slowest rank's step.
    """
    per_rank = groups if isinstance(groups[0], list) else [groups]
    ranks = len(per_rank)
    opt = optimizer_s if isinstance(optimizer_s, list) else [optimizer_s] * ranks
    sizes = per_rank[0]
    host_t = [0.0] * ranks
    net_free = 0.0  # when the network is free
    done = {}       # collective -> completion time

    def issue(key, nbytes, at, span=n, intra=False):
        nonlocal net_free
        start = max(max(at), net_free)
        net_free = start + net.time(nbytes, span, intra)
        done[key] = net_free

    def wait(key, t):
        if key not in done:
            return t
        return [max(x, done[key]) + (copy_out_s[key[1]] if copy_out_s else 0.0) for x in t]

    last = len(sizes) - 1
    t = [0.0] * ranks
    for i in range(len(sizes)):  # forward: each group prefetches the next `prefetch`
        if i == 0:
            issue(("ag", 0), sizes[0][3], t)
        for j in range(i + 1, min(i + 1 + prefetch, len(sizes))):
            issue(("ag", j), sizes[j][3], t)
        host_t = [h + host_s / 2 for h in host_t]
        t = [max(x, h) + per_rank[r][i][1]
             for r, (x, h) in enumerate(zip(wait(("ag", i), t), host_t))]
    kept = {0, last} if reshard != "false" else set(range(len(sizes)))
    order = list(range(last, 0, -1))  # backward: the blocks in reverse, then the root

    def regather(k, at):
        if k in kept or ("bg", k) in done:
            return
        hpz_on = reshard == "hpz"
        issue(("bg", k), sizes[k][3], at, span=min(hpz, n) if hpz_on else n, intra=hpz_on)

    for pos, k in enumerate(order):
        for j in [k] + order[pos + 1:pos + 1 + prefetch]:
            regather(j, t)
        host_t = [h + host_s / 2 for h in host_t]
        t = [max(x, h) + per_rank[r][k][2]
             for r, (x, h) in enumerate(zip(wait(("bg", k), t), host_t))]
        issue(("rs", k), sizes[k][4], t)
    t = [x + per_rank[r][0][2] for r, x in enumerate(t)]
    issue(("rs", 0), sizes[0][4], t)
    end = max(v for key, v in done.items() if key[0] == "rs")
    return max(max(x, end) + o for x, o in zip(t, opt))


# ---- the 1.28 B GPT on H200s ----------------------------------------------------------------
# Published figures the table rests on (sources in docs/performance.md, "A scaling model"):
NVLINK_BUSBW = 370e9     # 8 GPUs, NVLink 4 (450 GB/s line rate): nccl-tests busbw of
                         # all-gather / reduce-scatter (NVIDIA/nccl-tests#212, NCCL maintainer)
NIC_BUSBW = 8 * 47e9     # 8 x 400 Gb/s NDR per node, 46-48 GB/s each (NVIDIA/nccl-tests#290)
AT_SCALE_BUSBW = 200e9   # all-gather measured at 256 H100s (32 nodes) (NVIDIA/nccl#1218)
HBM_BW = 4.8e12 * 0.8    # H200 HBM3e 4.8 TB/s; a device copy reaches about 80% of it (assumed)
ALPHA_HOP = 1e-6         # ring latency per hop (assumed; grows linearly with N, NVIDIA/nccl#1712)
ALPHA_BASE = 10e-6       # launch and first hop (assumed; ~12 us for small collectives on 8 GPUs)


def gpt_sizes(L, C, V, T):
    block = 12 * C * C + 13 * C
    root = (V + T) * C + 2 * C
    return block, root


def h200_groups(dtype, batch=4, L=24, C=2048, V=32768, T=1024, B=4):
    """Per-group compute from the H200 step at N = 1 (docs/performance.md, "On one GPU"): the
    step minus the optimizer's (LibTorch's AdamW, about 23 passes over 4 bytes per parameter at
    HBM bandwidth), split over the groups by FLOPs (6 x parameters per token, attention 12 T C
    per token and layer, the tied head 6 V C per token; forward a third of each)."""
    step = {"fp32": 0.765, "bf16": 0.137}[dtype]
    block_p, root_p = gpt_sizes(L, C, V, T)
    params = L * block_p + root_p
    opt = 23 * 4 * params / HBM_BW
    tokens = B * T
    f_block = 6 * block_p * tokens + 12 * T * C * tokens
    f_head = 6 * V * C * tokens
    rate = (L * f_block + f_head) / (step - opt)  # FLOP/s achieved
    elem = 2 if dtype == "bf16" else 4
    scale = batch / B  # another batch per GPU: compute in proportion, at the same FLOP rate
    groups = [("root", 0.0, 0.0, root_p * elem, root_p * elem)]
    for i in range(L):
        head = f_head if i == L - 1 else 0.0  # the head runs right after the last block
        groups.append((f"h.{i}", scale * (f_block + head) / rate / 3,
                       scale * (f_block + head) / rate * 2 / 3, block_p * elem, block_p * elem))
    return groups, opt, params


def table(args):
    groups, opt1, params = h200_groups(args.dtype, args.batch)
    copy_out = [2 * g[3] / HBM_BW for g in groups]  # FSDP2: read + write the gathered bytes
    host = (args.host_us_fsdp * 1e-6, args.host_us_fsdp2 * 1e-6)
    print("| GPUs | network busbw | reshard after forward | compute + optimizer s | fsdp-cpp s | "
          "FSDP2 s | fsdp-cpp / FSDP2 | fsdp-cpp exposed | with the hosts' time: fsdp-cpp s, "
          "FSDP2 s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (8, 64, 512):
        opt = opt1 / n
        compute = sum(g[1] + g[2] for g in groups) + opt
        nets = [("NVLink", NVLINK_BUSBW)] if n == 8 else [
            ("8 NICs' line rate", min(NIC_BUSBW, NVLINK_BUSBW)), ("at scale", AT_SCALE_BUSBW)]
        for bw_name, bw in nets:
            net = Net(bw, ALPHA_BASE + ALPHA_HOP * (n - 1), NVLINK_BUSBW,
                      ALPHA_BASE + 7 * ALPHA_HOP)
            for reshard in ("true", "false") + (("hpz",) if n > 8 else ()):
                ours = simulate(groups, n, net, opt, reshard)
                fsdp2 = simulate(groups, n, net, opt, reshard, copy_out_s=copy_out)
                ours_h = simulate(groups, n, net, opt, reshard, host_s=host[0])
                fsdp2_h = simulate(groups, n, net, opt, reshard, copy_out_s=copy_out,
                                   host_s=host[1])
                label = {"true": "true", "false": "false", "hpz": "8 (hpZ)"}[reshard]
                print(f"| {n} | {bw / 1e9:.0f} GB/s ({bw_name}) | {label} | {compute:.3f} | "
                      f"{ours:.3f} | {fsdp2:.3f} | {ours / fsdp2:.3f} | "
                      f"{100 * (ours - compute) / ours:.1f}% | {ours_h:.3f}, {fsdp2_h:.3f} |")
    print(f"\n{args.dtype}: {params / 1e9:.3f} B parameters; per block forward "
          f"{1e3 * groups[1][1]:.2f} ms, backward {1e3 * groups[1][2]:.2f} ms, all-gather "
          f"{groups[1][3] / 1e6:.0f} MB; the head with the last block; optimizer at N = 1 "
          f"{1e3 * opt1:.1f} ms (divided by N); hosts' time per group and step: fsdp-cpp "
          f"{args.host_us_fsdp:.0f} us, FSDP2 {args.host_us_fsdp2:.0f} us")
    return 0


# ---- validation against this machine's trace -------------------------------------------------
def trace_steps(path):
    """One rank's timed steps from its trace: per step, seconds of each group's forward and
    backward span, of the step's three parts, and of the exposed waits inside forward and
    backward."""
    ev = json.load(open(path))["traceEvents"]
    spans = sorted((e for e in ev if e.get("ph") == "X"), key=lambda e: e["ts"])
    ends = [e["ts"] + e["dur"] for e in spans if e["name"] == "optimizer.step"]
    steps = [collections.Counter() for _ in ends]
    phases = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in spans if e.get("cat") == "step"]
    for e in spans:
        k = next((i for i, end in enumerate(ends) if e["ts"] < end), None)
        if k is None:
            continue
        name = e["name"]
        if name.startswith(("forward ", "backward ")) or e.get("cat") == "step":
            steps[k][name] += e["dur"] / 1e6
        elif e.get("cat") == "wait":
            for a, b, phase in phases:
                if a <= e["ts"] < b:
                    steps[k]["wait in " + phase] += e["dur"] / 1e6
    return steps


def groups_of(step, layers, sizes):
    """The simulate() groups of one rank's step: the blocks' spans; what they and the waits
    leave of forward and backward (the root's own compute, copies, bookkeeping) with the last
    block, which runs next to the head."""
    blocks_f = [step.get(f"forward h.{i}", 0.0) for i in range(layers)]
    blocks_b = [step.get(f"backward h.{i}", 0.0) for i in range(layers)]
    rest_f = step["model.forward"] - sum(blocks_f) - step.get("wait in model.forward", 0.0)
    rest_b = step["model.backward"] - sum(blocks_b) - step.get("wait in model.backward", 0.0)
    groups = [("root", 0.0, 0.0) + sizes[0]]
    for i in range(layers):
        last = i == layers - 1
        groups.append((f"h.{i}", blocks_f[i] + (rest_f if last else 0.0),
                       blocks_b[i] + (rest_b if last else 0.0)) + sizes[1])
    return groups


def validate(args):
    files = sorted(f for f in os.listdir(args.trace_dir)
                   if f.startswith("rank") and f.endswith(".json"))
    ranks = [trace_steps(os.path.join(args.trace_dir, f)) for f in files]
    block_p, root_p = gpt_sizes(args.layers, args.width, args.vocab, args.seq)
    ag, rs = args.ag_gbps * 1e9, args.rs_gbps * 1e9
    sizes = [(root_p * 4, root_p * 4 * ag / rs), (block_p * 4, block_p * 4 * ag / rs)]
    net = Net(ag, args.alpha_us * 1e-6)
    rows = []
    for k in range(min(len(r) for r in ranks)):
        steps = [r[k] for r in ranks]
        groups = [groups_of(s, args.layers, sizes) for s in steps]
        opt = [s["optimizer.step"] for s in steps]
        measured = max(s["model.forward"] + s["model.backward"] + s["optimizer.step"]
                       for s in steps)
        waits = statistics.mean(s.get("wait in model.forward", 0.0) +
                                s.get("wait in model.backward", 0.0) for s in steps)
        both = simulate(groups, args.world, net, opt, "true")
        alike = statistics.mean(simulate(g, args.world, net, o, "true")
                                for g, o in zip(groups, opt))
        rows.append((measured, waits, both, alike))
    mean = [statistics.mean(c) for c in zip(*rows)]
    print("| N | steps | step, trace s | exposed waits, trace s | model, every rank's compute s | "
          "model / trace | model, ranks alike s | model, ranks alike / trace |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.world} | {len(rows)} | {mean[0]:.3f} | {mean[1]:.3f} | {mean[2]:.3f} | "
          f"{mean[2] / mean[0]:.3f} | {mean[3]:.3f} | {mean[3] / mean[0]:.3f} |")
    return 0


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    t.add_argument("--batch", type=int, default=4,
                   help="sequences per GPU (the H200 run had 4; compute scales with it)")
    # This VM's per-group host time (fsdp-bench --compare --preset overhead --nproc 2): fsdp above
    # `local`, FSDP2 above PyTorch's own unwrapped model (docs/performance.md).
    t.add_argument("--host-us-fsdp", type=float, default=1463.0)
    t.add_argument("--host-us-fsdp2", type=float, default=11247.0)
    v = sub.add_parser("validate")
    v.add_argument("trace_dir")
    v.add_argument("--world", type=int, required=True)
    v.add_argument("--ag-gbps", type=float, required=True, help="all-gather bus bandwidth")
    v.add_argument("--rs-gbps", type=float, required=True, help="reduce-scatter bus bandwidth")
    v.add_argument("--alpha-us", type=float, default=50.0,
                   help="latency per collective (fsdp-bench --comm's smallest size)")
    for name, default in [("layers", 8), ("width", 512), ("vocab", 256), ("seq", 256)]:
        v.add_argument("--" + name, type=int, default=default)
    args = p.parse_args(argv)
    return table(args) if args.cmd == "table" else validate(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
