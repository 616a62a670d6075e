#!/usr/bin/python3
"""PyTorch's own DDP on fsdp-bench's GPT: the peer baseline of `fsdp-bench --compare` (issue 12).

Same model (src/models/gpt.cpp: pre-LN GPT-2 blocks, tied head, GPT-2 initialisation, drawn in the
same order from the same seed), same synthetic batches (make_batch in bench/train_bench.cpp), AdamW,
Gloo, one intra-op thread per rank, torch.nn.parallel.DistributedDataParallel with the same bucket
size. Rank 0 prints one JSON line with the keys of fsdp-bench's modes (mode "torch-ddp").

  /usr/bin/python3 bench/torch_ddp.py --nproc 2 [--layers 8 --width 512 --heads 8 --seq 256 --batch 2 ...]

With --nproc it starts the ranks itself with the env:// variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; torchrun 1.13 fails on Python 3.11), on a free loopback port. Needs python3-torch;
exits with status 3 and a message when torch cannot be imported.
"""
import argparse
import json
import math
import os
import resource
import socket
import subprocess
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=0, help="start this many local ranks")
    for name, default in [("layers", 8), ("width", 512), ("heads", 8), ("seq", 256), ("batch", 2),
                          ("steps", 5), ("warmup", 2), ("threads", 1)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout-s", type=float, default=600, help="give up on the ranks after this")
    return p.parse_args(argv)


def launch(args, argv):
    """Starts args.nproc ranks of this script; passes rank 0's stdout through."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child_argv = [a for i, a in enumerate(argv)
                  if a != "--nproc" and not a.startswith("--nproc=") and
                  (i == 0 or argv[i - 1] != "--nproc")]
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(args.threads))
        procs.append(subprocess.Popen([sys.executable, __file__] + child_argv, env=env,
                                      stdout=None if rank == 0 else subprocess.DEVNULL))
    deadline = time.time() + args.timeout_s
    status = 0
    for p in procs:
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            rc = 124
        if rc != 0 and status == 0:
            status = rc
            for q in procs:  # one rank failed: stop the others rather than hang
                if q.poll() is None:
                    q.kill()
    if status != 0:
        print(f"torch_ddp.py: a rank failed with status {status}", file=sys.stderr)
    return status


def build_gpt(torch, args):
    nn, F = torch.nn, torch.nn.functional
    C, H, L = args.width, args.heads, args.layers

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C)
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)
            self.ln_2 = nn.LayerNorm(C)
            self.c_fc = nn.Linear(C, 4 * C)
            self.mlp_proj = nn.Linear(4 * C, C)

        def forward(self, x):  # (B, T, C) -> (B, T, C)
            B, T, _ = x.shape
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2)
                       for t in self.c_attn(self.ln_1(x)).split(C, dim=2))
            att = q.matmul(k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))
            mask = torch.ones(T, T, dtype=torch.bool).triu(1)
            att = torch.softmax(att.masked_fill(mask, float("-inf")), -1)
            y = att.matmul(v).transpose(1, 2).contiguous().view(B, T, C)
            h = x + self.c_proj(y)
            return h + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(256, C)
            self.wpe = nn.Embedding(args.seq, C)
            self.h = nn.ModuleList([Block() for _ in range(L)])
            self.ln_f = nn.LayerNorm(C)
            with torch.no_grad():  # GPTImpl::init_weights, same order of draws
                std, proj_std = 0.02, 0.02 / math.sqrt(2.0 * L)
                self.wte.weight.normal_(0.0, std)
                self.wpe.weight.normal_(0.0, std)
                for b in self.h:
                    for lin in (b.c_attn, b.c_proj, b.c_fc, b.mlp_proj):
                        lin.weight.normal_(0.0, proj_std if lin in (b.c_proj, b.mlp_proj) else std)
                        lin.bias.zero_()

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.h:
                x = b(x)
            logits = self.ln_f(x).matmul(self.wte.weight.t())
            return F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))

    return GPT()


def make_batch(torch, args, step, rank):
    """bench/train_bench.cpp make_batch: a function of (seed, step, rank) only."""
    g = torch.Generator().manual_seed(
        (args.seed * 1000003 + step * 4099 + rank) % (1 << 64))
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g, dtype=torch.long)
    return tokens[:, :args.seq].contiguous(), tokens[:, 1:].contiguous()


def run_rank(args):
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print(f"torch_ddp.py: cannot import torch ({e}); install python3-torch", file=sys.stderr)
        return 3
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method="env://")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = build_gpt(torch, args)
    params = sum(p.numel() for p in model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    dist.barrier()
    step_s, losses = [], []
    for s in range(args.warmup + args.steps):
        x, y = make_batch(torch, args, s, rank)
        t0 = time.perf_counter()
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if s >= args.warmup:
            step_s.append(dt)
    # A step takes as long as its slowest rank; losses are averaged over ranks as fsdp-bench does.
    times = torch.tensor(step_s, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    loss_t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_t)
    loss_t /= ws
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0],
                        dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        med = times.median().item() if len(step_s) % 2 else times.sort().values[
            len(step_s) // 2 - 1:len(step_s) // 2 + 1].mean().item()
        print(json.dumps({
            "mode": "torch-ddp", "world": ws, "step_s_median": round(med, 4),
            "step_s_min": round(times.min().item(), 4), "step_s_max": round(times.max().item(), 4),
            "tokens_per_s_per_rank": round(args.batch * args.seq / med, 1),
            "peak_rss_mb": round(peak.item(), 1), "loss": round(loss_t[-1].item(), 6),
            "loss_step1": loss_t[0].item(), "params": params, "layers": args.layers,
            "width": args.width, "seq": args.seq, "batch": args.batch, "threads": args.threads,
            "steps": args.steps, "torch_version": torch.__version__}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv):
    args = parse_args(argv)
    if args.nproc > 0 and "RANK" not in os.environ:
        return launch(args, argv)
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
