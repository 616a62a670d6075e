"""PyTorch's FSDP2 (or no sharding) on one GPU, the same GPT and figures as `fsdp-gpu-check
--bench` (bench/gpu_check.cpp): step time, tokens/s, MFU and peak allocated GPU memory.

The model is bench/fsdp2_peer.py's port of fsdp-cpp's GPT; fully_shard on every block, then the
root; bf16 is MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32). Random tokens, AdamW.

  torchrun --nproc_per_node 1 bench/gpu_fsdp2.py [--none] [--bf16] [--layers 12 --width 1024 ...]
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_peer import GPT  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 12), ("width", 1024), ("heads", 16), ("seq", 1024),
                          ("vocab", 32768), ("batch", 8), ("steps", 10)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--none", action="store_true", help="no sharding (fp32 only)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy()")
    p.add_argument("--peak-tflops", type=float, default=0.0)
    a = p.parse_args()
    peak = a.peak_tflops or (989.0 if a.bf16 else 67.0)
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    torch.manual_seed(0)
    model = GPT(a.vocab, a.seq, a.layers, a.heads, a.width).cuda()
    n_params = sum(t.numel() for t in model.parameters())
    if not a.none:
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                            fully_shard)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if a.bf16 else MixedPrecisionPolicy()
        off = CPUOffloadPolicy() if a.offload else OffloadPolicy()
        for b in model.h:
            fully_shard(b, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tok = torch.randint(a.vocab, (a.batch, a.seq + 1), device="cuda")
    x, y = tok[:, :-1], tok[:, 1:]

    def step():
        logits = model(x)
        F.cross_entropy(logits.float().reshape(-1, a.vocab), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    torch.cuda.synchronize()
    s = (time.perf_counter() - t0) / a.steps
    tokens = a.batch * a.seq
    flops = tokens * (6.0 * n_params + 12.0 * a.layers * a.seq * a.width)
    print(f"bench {'none' if a.none else 'fsdp2'}{' offload' if a.offload else ''} {'bf16' if a.bf16 else 'fp32'}: layers {a.layers}"
          f" width {a.width} seq {a.seq} batch {a.batch} params {n_params / 1e6:.1f}M: step "
          f"{s:.4f} s, {tokens / s:.0f} tokens/s, MFU {100 * flops / s / (peak * 1e12):.1f}% of "
          f"{peak:.0f} TFLOP/s, peak allocated {torch.cuda.max_memory_allocated() / 1e9:.2f} GB",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
