#!/usr/bin/python3
"""PyTorch's own DDP or FSDP2 on fsdp-bench's GPT: the peers of `fsdp-bench --compare` (issues 12, 30).

Rank 0 prints one JSON line with the keys of fsdp-bench's modes (mode "torch-ddp", "fsdp2", or
"torch-local": `--mode local`, the model unwrapped on every rank, no communication: the Python floor
of `--preset overhead`, issue 50).
The model, its layout and AdamW are bench/fsdp2_peer.py's (the same GPT as src/models/gpt.cpp, its
Linear layers computed as LibTorch's C++ frontend does; FSDP2: fully_shard on every block, the last
not resharded after forward, then the root; DDP: DistributedDataParallel with --bucket-mb buckets;
AdamW with fsdp-train's betas and weight decay on the 2-D weights only), with fsdp-bench's initial
weights bit for bit (`--init-draws libtorch`: torch.manual_seed, the constructors' draws, then
GPTImpl::init_weights). This file adds what fsdp-bench measures: its synthetic batches (make_batch
in bench/train_bench.cpp), a constant learning rate, --warmup untimed steps then --steps timed ones,
one intra-op thread per rank, Gloo.

  /opt/fsdp-cpp/torch215/bin/python3 bench/torch_ddp.py --nproc 2 [--mode ddp|fsdp2]
      [--layers 8 --width 512 --heads 8 --seq 256 --batch 2 --mixed-precision none|bf16 ...]

--batch is rows per rank, --warmup untimed steps (fsdp-bench's meanings). --mixed-precision bf16
(FSDP2 only) is MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), the root's output fp32.
With --nproc it starts the ranks itself with the env:// variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) on a free loopback port. Needs torch 2.15 (scripts/torch_pip.sh's venv); exits with
status 3 and a message when it cannot import it.

Training memory, as in every fsdp-bench mode: the peak resident set (VmHWM, reset just before the
model is built) minus the resident set just before the model is built, the worst rank.
Not measured here: exposed communication and bytes sent (no hook into DDP's or FSDP2's
collectives), so those keys are absent.
"""
import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=0, help="start this many local ranks")
    p.add_argument("--mode", choices=["ddp", "fsdp2", "local"], default="ddp")
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default="none")
    p.add_argument("--preset", default="default", help="reported only: sizes are explicit")
    for name, default in [("layers", 8), ("width", 512), ("heads", 8), ("seq", 256), ("batch", 2),
                          ("steps", 5), ("warmup", 2), ("threads", 1)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout-s", type=float, default=600, help="give up on the ranks after this")
    return p.parse_args(argv)


def free_loopback_port():
    """A free loopback port drawn at random below the kernel's ephemeral range.

    A port from bind(("127.0.0.1", 0)) comes from the range the kernel also hands out as source
    ports of outgoing connections: another process's connection could take it before rank 0's
    store binds it. Below that range only an explicit bind can (fsdp-run draws its ports alike).
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    candidates = [rng.randint(10000, low - 1) for _ in range(64)] if low - 1 > 11000 else []
    for port in candidates + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise SystemExit("torch_ddp.py: no free loopback port")


def launch(args, argv):
    """Starts args.nproc ranks of this script; passes rank 0's stdout through."""
    port = free_loopback_port()
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


def make_batch(torch, args, step, rank):
    """bench/train_bench.cpp make_batch: a function of (seed, step, rank) only."""
    g = torch.Generator().manual_seed(
        (args.seed * 1000003 + step * 4099 + rank) % (1 << 64))
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g, dtype=torch.long)
    return tokens[:, :args.seq].contiguous(), tokens[:, 1:].contiguous()


def peer_args(peer, args, world):
    """bench/fsdp2_peer.py's settings for this run (its defaults: fsdp-train's AdamW)."""
    return peer.parse_args([
        "--mode", args.mode, "--mixed-precision", args.mixed_precision, "--init-draws", "libtorch",
        "--layers", str(args.layers), "--width", str(args.width), "--heads", str(args.heads),
        "--seq", str(args.seq), "--batch", str(args.batch * world), "--lr", repr(args.lr),
        "--seed", str(args.seed), "--threads", str(args.threads),
        "--bucket-mb", repr(args.bucket_mb)])


def run_rank(args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.dont_write_bytecode = True  # no __pycache__ in the source tree
    import fsdp2_peer as peer  # exits with status 3 and a message where torch 2.15 is missing
    torch, dist = peer.torch, peer.dist
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method="env://")
    rank, ws = dist.get_rank(), dist.get_world_size()
    pargs = peer_args(peer, args, ws)
    rss_before = peer.training_memory_start()
    model, wrapped, opt = peer.build(pargs, rank, ws)
    params = sum(p.numel() for p in model.parameters())  # global shapes under FSDP2 (DTensor)
    dist.barrier()
    step_s, losses = [], []
    for s in range(args.warmup + args.steps):
        x, y = make_batch(torch, args, s, rank)
        t0 = time.perf_counter()
        loss = peer.loss_of(wrapped, x, y, pargs.vocab)
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
    mem = torch.tensor([peer.peak_rss_mb(), peer.peak_rss_mb() - rss_before], dtype=torch.float64)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    if rank == 0:
        med = statistics.median(times.tolist())
        print(json.dumps({
            "mode": {"fsdp2": "fsdp2", "local": "torch-local"}.get(args.mode, "torch-ddp"),
            "world": ws,
            "step_s_median": round(med, 4), "step_s_min": round(times.min().item(), 4),
            "step_s_max": round(times.max().item(), 4),
            "tokens_per_s_per_rank": round(args.batch * args.seq / med, 1),
            "peak_rss_mb": round(mem[0].item(), 1), "train_memory_mb": round(mem[1].item(), 1),
            "loss": round(loss_t[-1].item(), 6), "loss_step1": loss_t[0].item(), "params": params,
            "mixed_precision": args.mixed_precision, "preset": args.preset,
            "layers": args.layers, "width": args.width, "seq": args.seq, "batch": args.batch,
            "threads": args.threads, "steps": args.steps,
            "torch_version": torch.__version__}), flush=True)
    # As bench/fsdp2_peer.py: leave without the process group's teardown, which torch 2.15's Gloo
    # group has aborted in once after every result was out.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv):
    args = parse_args(argv)
    if args.mode != "fsdp2" and args.mixed_precision != "none":
        sys.exit("torch_ddp.py: --mixed-precision bf16 is FSDP2's policy; use --mode fsdp2")
    if args.nproc > 0 and "RANK" not in os.environ:
        return launch(args, argv)
    return run_rank(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
