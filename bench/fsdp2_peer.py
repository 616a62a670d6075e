"""PyTorch FSDP2 (or DDP) training fsdp-train's GPT: the live peer and oracle of fsdp-cpp (issue 29).

The same computation as fsdp-train, written independently from docs/trainer.md and the C++:

- model (src/models/gpt.cpp): pre-LayerNorm GPT-2 blocks (LayerNorm eps 1e-5; causal attention
  through F.scaled_dot_product_attention, scale 1/sqrt(C/H), as the C++ model's
  at::scaled_dot_product_attention; GELU tanh approximation; MLP 4C), learned positions, the head
  tied to `wte`; parameter names those of fsdp-cpp's consolidated safetensors checkpoint
  (`wte.weight`, `h.0.c_attn.weight`, ...); Linear layers compute as LibTorch's C++ frontend does
  (matmul, then the bias added);
- data (src/train/data.cpp): the file's last floor(M * val_fraction) tokens held out; step s, row r
  is stream row j = s*B + r at offset mix64(seed ^ mix64(j)) mod (N - T) (random) or
  (j mod floor((N-1)/T)) * T (sequential); rank k takes rows [k B/N, (k+1) B/N), in grad_accum
  micro-batches;
- step (src/train/trainer.cpp): loss = mean cross-entropy of fp32 logits; (loss / K).backward() per
  micro-batch, gradients reduced on the last; optional clip of the global norm; AdamW with weight
  decay on the 2-D weights only; linear warmup then cosine to lr * min_lr_ratio
  (src/train/schedule.cpp); the logged loss is the mean over micro-batches and ranks;
- validation (trainer.cpp evaluate): eval_batches global batches of the held-out split in sequential
  order, each rank its rows in micro-batches, the mean of all those losses;
- layout (src/train/model_setup.cpp): fully_shard on every block (reshard after forward, but not
  the last block), then on the root; `--mixed-precision bf16` is FSDP2's
  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), the root also output_dtype=fp32, as
  fsdp-train's policy.

Weights: `--init FILE`, a full safetensors file (fsdp-cpp's `checkpoint::consolidate`, or the
file fsdp-train's `--init-from` takes); without it, GPT-2's initialisation from --seed (the same
distribution as fsdp-train, not the same bits).

Run with the Python of torch 2.15 (scripts/torch_pip.sh makes it), one process per rank:

  torchrun --nproc_per_node 2 bench/fsdp2_peer.py --init init.safetensors --data data/corpus.txt \
      --layers 1 --heads 2 --width 32 --seq 16 --batch 8 --steps 30 --json peer.json
  torchrun --nproc_per_node 2 bench/fsdp2_peer.py --init step15.safetensors --steps 0 ...
      # --steps 0: only the validation loss of the --init weights

`--adamw libtorch` replaces torch.optim.AdamW by the same update in the order of operations of
LibTorch's torch::optim::AdamW, which fsdp-train uses: the tests compare fsdp-cpp's sharding and
mixed precision to the last bits with it (docs/fsdp2_peer.md).

Rank 0 prints one line per step (`step S loss L`, full precision) and `val_loss V` where
evaluated; --json FILE gets the settings, per-step losses, learning rates and step times, the
validation losses, and each rank's training memory: peak RSS minus the RSS just before the model
is built. Each rank uses one intra-op thread (as fsdp-bench; --threads to change). Flags not given
take fsdp-train's defaults, or those of a --preset: `train` (fsdp-train's), `bench` (fsdp-bench's
default: 8 layers, width 512, 8 heads, seq 256, 2 rows per rank), `mem` (fsdp-bench --preset mem:
6 layers, width 1024, 16 heads, seq 32, 1 row per rank).
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings

# This venv has no NumPy, which fsdp2_peer does not use; torch warns about it on import.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
try:
    import torch  # noqa: E402
    import torch.distributed as dist  # noqa: E402
    import torch.nn as nn  # noqa: E402
    import torch.nn.functional as F  # noqa: E402
    from safetensors import safe_open  # noqa: E402
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
    from torch.distributed.fsdp._fully_shard._fsdp_api import (  # noqa: E402
        AllGather, ReduceScatter)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor  # noqa: E402
except ImportError as e:  # bench/torch_ddp.py (fsdp-bench --compare) reports status 3
    print(f"fsdp2_peer: {sys.executable} lacks torch 2.15's FSDP2 or safetensors ({e}); "
          "run scripts/torch_pip.sh and use its venv's python", file=sys.stderr)
    sys.exit(3)

PRESETS = {  # sizes; a `per_rank` batch is multiplied by the world size
    "train": dict(layers=4, heads=4, width=128, seq=64, batch=16),
    "bench": dict(layers=8, heads=8, width=512, seq=256, per_rank=2),
    "mem": dict(layers=6, heads=16, width=1024, seq=32, per_rank=1),
}
DEFAULT_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "corpus.txt")
MASK64 = (1 << 64) - 1


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["fsdp2", "ddp", "local"], default="fsdp2",
                   help="local: the model on every rank without a wrapper, no communication "
                   "(bench/torch_ddp.py's Python floor)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="train")
    p.add_argument("--init", help="full safetensors file of the initial weights")
    p.add_argument("--init-draws", choices=["peer", "libtorch"], default="peer",
                   help="without --init: GPT-2's initialisation from --seed on a generator of its "
                        "own (peer), or drawn as LibTorch's eager build draws it (libtorch: "
                        "fsdp-bench's and fsdp-train's initial weights, bit for bit)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="--mode ddp: bucket size in MiB")
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default="none")
    p.add_argument("--mixed-precision-reduce", choices=["param", "fp32"], default="param",
                   help="fp32: MixedPrecisionPolicy's reduce_dtype left unset, which torch 2.15 "
                   "reduces in the parameters' fp32 (fsdp-train's --mixed-precision-reduce); "
                   "param: reduce_dtype=bfloat16")
    p.add_argument("--hsdp", type=int, default=1,
                   help="R >= 2: HSDP, fully_shard over a 2-D mesh of R replicas x N/R shards "
                   "(fsdp-train's --hsdp)")
    p.add_argument("--reshard-after-forward-world", type=int, default=0,
                   help="K >= 2: the blocks' reshard_after_forward=K (hpZ); 0: True")
    p.add_argument("--shard-dim", type=int, choices=[0, 1], default=0,
                   help="1: shard_placement_fn gives Shard(1) to every parameter of 2 dims")
    p.add_argument("--ignored-params", default="",
                   help="comma-separated parameter names for fully_shard's ignored_params")
    p.add_argument("--custom-collectives", choices=["none", "bf16-round"], default="none",
                   help="bf16-round: set_custom_all_gather / set_custom_reduce_scatter on every "
                   "FSDP module, with collectives that round their input to bf16 (fsdp-train's "
                   "--custom-collectives)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--json", help="write the results here (rank 0)")
    for name in ("layers", "heads", "width", "seq", "batch"):
        p.add_argument("--" + name, type=int, help="default: the preset's")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=300, help="0: only evaluate the --init weights")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--clip", type=float, default=0.0, help="global gradient norm; 0: no clipping")
    p.add_argument("--adamw", choices=["torch", "libtorch"], default="torch",
                   help="torch.optim.AdamW, or the same update in LibTorch's order of operations")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--data-order", choices=["random", "sequential"], default="random")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--eval-every", type=int, default=50, help="and after the last step; 0: never")
    p.add_argument("--eval-batches", type=int, default=4)
    args = p.parse_args(argv)
    if args.mode != "fsdp2" and args.mixed_precision != "none":
        p.error("--mixed-precision bf16 is FSDP2's MixedPrecisionPolicy; use --mode fsdp2")
    if args.mixed_precision_reduce != "param" and args.mixed_precision == "none":
        p.error("--mixed-precision-reduce fp32 needs --mixed-precision bf16")
    return args


def resolve_sizes(args, world):
    preset = PRESETS[args.preset]
    for name in ("layers", "heads", "width", "seq"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    if args.batch is None:
        args.batch = preset.get("batch") or preset["per_rank"] * world
    if world % args.hsdp:
        sys.exit(f"fsdp2_peer: --hsdp {args.hsdp} does not divide {world} ranks")
    if args.batch % (world * args.grad_accum):
        sys.exit(f"fsdp2_peer: --batch {args.batch} is not divisible by {world} ranks x "
                 f"--grad-accum {args.grad_accum}")


# ---- model (src/models/gpt.cpp) ----
class Linear(nn.Linear):
    """torch::nn::Linear of LibTorch's C++ frontend (torch/nn/functional/linear.h): addmm for 2-D
    input, else matmul and then the bias added. Python's F.linear fuses the bias for 3-D input too
    (one rounding instead of two); in bf16 that moves fsdp-train's losses by up to 5e-4 in 30 steps
    (docs/fsdp2_peer.md)."""

    def forward(self, x):
        if x.dim() == 2:
            return torch.addmm(self.bias, x, self.weight.t())
        return x.matmul(self.weight.t()) + self.bias


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.n_head = H
        self.ln_1 = nn.LayerNorm(C)
        self.c_attn = Linear(C, 3 * C)
        self.c_proj = Linear(C, C)
        self.ln_2 = nn.LayerNorm(C)
        self.c_fc = Linear(C, 4 * C)
        self.mlp_proj = Linear(4 * C, C)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        B, T, C = x.shape
        hd = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
                   for t in self.c_attn(self.ln_1(x)).split(C, dim=2))
        # GPT's Attention::kFused: the fused kernel, causal, scale 1/sqrt(hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        h = x + self.c_proj(y)
        return h + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, seq, layers, heads, width):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.h = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)

    def forward(self, idx):  # (B, T) -> logits (B, T, V), head tied to wte
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        return self.ln_f(x).matmul(self.wte.weight.t())


def initial_value(name, shape, layers, gen):
    """GPTImpl::init_weights: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0,
    LayerNorm weights 1."""
    if name.endswith("bias"):
        return torch.zeros(shape)
    if ".ln_" in name or name.startswith("ln_"):
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2.0 * layers) if name.endswith(("c_proj.weight", "mlp_proj.weight")) \
        else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def load_weights(model, args):
    """Fills every parameter (a DTensor shard under FSDP2) from --init, or from GPT-2's rule.
    One full tensor at a time; each rank keeps its rows."""
    names = [n for n, _ in model.named_parameters()]
    if args.init:
        with safe_open(args.init, framework="pt") as f:
            missing = sorted(set(names) - set(f.keys()))
            if missing:
                sys.exit(f"fsdp2_peer: {args.init} lacks {', '.join(missing)}; pass a file of "
                         "this model's settings (--layers/--width/...)")
            fill(model, lambda name, shape: f.get_tensor(name))
    elif args.init_draws == "libtorch":
        replay_constructor_draws(model, args.seed)
        fill(model, lambda name, shape: initial_value(name, shape, args.layers,
                                                      torch.default_generator))
    else:
        gen = torch.Generator().manual_seed(args.seed)
        fill(model, lambda name, shape: initial_value(name, shape, args.layers, gen))


def replay_constructor_draws(model, seed):
    """torch::manual_seed(seed), then the draws of the modules' constructors in their order
    (Embedding: normal; Linear: Kaiming-uniform weight, uniform bias), one throwaway module at a
    time: the global generator then stands where GPTImpl::init_weights starts drawing, as in
    fsdp-cpp's eager build (and its deferred_init, which replays the same draws). The draws of
    init_weights follow in initial_value's order (that of named_parameters)."""
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            nn.Embedding(m.num_embeddings, m.embedding_dim)
        elif isinstance(m, nn.Linear):
            nn.Linear(m.in_features, m.out_features)


def fill(model, full_of):
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = full_of(name, tuple(p.shape))
            if tuple(full.shape) != tuple(p.shape) or full.dtype != torch.float32:
                sys.exit(f"fsdp2_peer: {name} is {full.dtype} {tuple(full.shape)} in the file, "
                         f"the model has float32 {tuple(p.shape)}")
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)


def bf16_rounded(t):
    return t.to(torch.bfloat16).to(t.dtype)


class Bf16RoundingAllGather(AllGather):
    """An all-gather that puts its input on the wire rounded to bf16 (src/train/rounding_collectives.h)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        # The input is a view of this rank's block of the output: round a copy first.
        return dist.all_gather_single(output_tensor, bf16_rounded(input_tensor), group=group,
                                      async_op=async_op)


class Bf16RoundingReduceScatter(ReduceScatter):
    """A reduce-scatter of gradients rounded to bf16 (src/train/rounding_collectives.h)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return dist.reduce_scatter_single(output=output_tensor, input=bf16_rounded(input_tensor),
                                          group=group, op=op, async_op=async_op)


def build(args, rank, world):
    """The model on this rank (sharded or replicated) and its AdamW."""
    dims = (args.vocab, args.seq, args.layers, args.heads, args.width)
    if args.mode == "fsdp2":
        with torch.device("meta"):
            model = GPT(*dims)
        mp = lambda root: MixedPrecisionPolicy()
        if args.mixed_precision == "bf16":
            # fp32: reduce_dtype left unset, torch 2.15's default (the parameters' fp32)
            reduce = None if args.mixed_precision_reduce == "fp32" else torch.bfloat16
            mp = lambda root: MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=reduce,
                output_dtype=torch.float32 if root else None)
        # fsdp-cpp's init_mesh: replica r holds world ranks [r S, (r + 1) S), row-major as here.
        mesh = init_device_mesh("cpu", (args.hsdp, world // args.hsdp),
                                mesh_dim_names=("replicate", "shard")) if args.hsdp > 1 else None
        reshard = args.reshard_after_forward_world or True
        placement = None
        if args.shard_dim:
            placement = lambda p: Shard(args.shard_dim) if p.dim() >= 2 else None
        named = dict(model.named_parameters())
        ignored = [n for n in args.ignored_params.split(",") if n]
        unknown = [n for n in ignored if n not in named]
        if unknown:
            sys.exit(f"fsdp2_peer: --ignored-params {', '.join(unknown)}: no such parameter")
        def ignored_in(prefix):  # block i: its "h.i." names; the root: the rest
            return {named[n] for n in ignored if n.startswith(prefix)} if prefix else {
                named[n] for n in ignored if not n.startswith("h.")} or None
        for i, b in enumerate(model.h):  # the last block keeps its parameters for backward
            fully_shard(b, reshard_after_forward=reshard if i + 1 < len(model.h) else False,
                        mesh=mesh, mp_policy=mp(False), shard_placement_fn=placement,
                        ignored_params=ignored_in(f"h.{i}.") or None)
        fully_shard(model, mesh=mesh, mp_policy=mp(True), shard_placement_fn=placement,
                    ignored_params=ignored_in(""))
        if args.custom_collectives == "bf16-round":
            for m in [*model.h, model]:
                m.set_custom_all_gather(Bf16RoundingAllGather())
                m.set_custom_reduce_scatter(Bf16RoundingReduceScatter())
        model.to_empty(device="cpu")
        load_weights(model, args)
        wrapped = model
    elif args.mode == "local":
        model = GPT(*dims)
        load_weights(model, args)
        wrapped = model
    else:
        model = GPT(*dims)
        load_weights(model, args)
        wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    adamw = torch.optim.AdamW if args.adamw == "torch" else LibTorchAdamW
    opt = adamw(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)
    return model, wrapped, opt


class LibTorchAdamW(torch.optim.Optimizer):
    """torch::optim::AdamW's operations in its order (torch/csrc/api/src/optim/adamw.cpp): the same
    update as torch.optim.AdamW, whose first moment uses lerp_ instead of mul_/add_ and so differs
    in the last bits of the weights (docs/fsdp2_peer.md)."""

    def __init__(self, params, lr, betas, eps):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                if wd != 0:
                    p.mul_(1 - lr * wd)
                bias_correction1 = 1 - beta1 ** state["step"]
                bias_correction2 = 1 - beta2 ** state["step"]
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(
                    group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / bias_correction1)


# ---- data (src/train/data.cpp) ----
def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def load_corpus(path, val_fraction):
    """(train, validation) token tensors (int64): bytes, or little-endian uint16 for .bin and
    .u16, uint32 for .u32 (src/train/data.cpp)."""
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    if path.lower().endswith((".bin", ".u16")):
        tokens = torch.frombuffer(raw, dtype=torch.int16).to(torch.int64) & 0xFFFF
    elif path.lower().endswith(".u32"):
        tokens = torch.frombuffer(raw, dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF
    else:
        tokens = torch.frombuffer(raw, dtype=torch.uint8).to(torch.int64)
    nv = math.floor(len(tokens) * val_fraction)
    return tokens[:len(tokens) - nv], tokens[len(tokens) - nv:]


class Stream:
    """DataStream: row r of step s at its offset; fill() gives (inputs, targets) of rows
    [begin, end), each (rows, T)."""

    def __init__(self, tokens, order, seed, seq, batch):
        self.tokens, self.order, self.seed, self.seq, self.batch = tokens, order, seed, seq, batch
        self.windows = (len(tokens) - 1) // seq

    def offset(self, step, row):
        j = step * self.batch + row
        if self.order == "sequential":
            return (j % self.windows) * self.seq
        return mix64(self.seed ^ mix64(j)) % (len(self.tokens) - self.seq)

    def fill(self, step, begin, end):
        rows = torch.stack([self.tokens[o:o + self.seq + 1]
                            for o in (self.offset(step, r) for r in range(begin, end))])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def lr_at(args, s):
    """LrSchedule::at (src/train/schedule.cpp)."""
    if s < args.warmup:
        return args.lr * (s + 1) / args.warmup
    floor = args.lr * args.min_lr_ratio
    p = min(max((s - args.warmup) / max(1, args.steps - 1 - args.warmup), 0.0), 1.0)
    return floor + (args.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * p))


def loss_of(model, x, y, vocab):
    """Mean cross-entropy of the logits, fp32 also under bf16 (the root's output_dtype)."""
    return F.cross_entropy(model(x).view(-1, vocab), y.reshape(-1))


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb():
    """VmHWM: the high-water mark since the last reset_peak_rss() (fsdp::memory::peak_rss_mb)."""
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024.0


def reset_peak_rss():
    """Resets VmHWM to the current RSS (Linux clear_refs), as fsdp::memory::reset_peak_rss."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def training_memory_start():
    """The RSS just before the model is built, with the high-water mark reset there: training
    memory is then peak_rss_mb() minus it (the definition of every fsdp-bench mode)."""
    reset_peak_rss()
    return rss_mb()


def train_step(args, model, wrapped, opt, stream, s, rank, world):
    """One optimizer step; returns this rank's mean loss over its micro-batches."""
    for g in opt.param_groups:
        g["lr"] = lr_at(args, s)
    micro = args.batch // world // args.grad_accum
    row0 = rank * (args.batch // world)
    total = 0.0
    for k in range(args.grad_accum):
        last = k + 1 == args.grad_accum
        x, y = stream.fill(s, row0 + k * micro, row0 + (k + 1) * micro)
        if args.mode == "fsdp2":
            model.set_requires_gradient_sync(last)
            loss = loss_of(wrapped, x, y, args.vocab)
            (loss / args.grad_accum).backward()
        else:
            with contextlib.nullcontext() if last or args.mode == "local" else wrapped.no_sync():
                loss = loss_of(wrapped, x, y, args.vocab)
                (loss / args.grad_accum).backward()
        total += loss.item()
    if args.clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total / args.grad_accum


def evaluate(args, wrapped, val, rank, world):
    """The trainer's validation loss: the mean over eval_batches x ranks x micro-batches."""
    micro = args.batch // world // args.grad_accum
    row0 = rank * (args.batch // world)
    total = 0.0
    with torch.no_grad():
        for b in range(args.eval_batches):
            for k in range(args.grad_accum):
                x, y = val.fill(b, row0 + k * micro, row0 + (k + 1) * micro)
                total += loss_of(wrapped, x, y, args.vocab).item()
    t = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / (world * args.eval_batches * args.grad_accum)


def main(argv):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    resolve_sizes(args, world)
    train_tokens, val_tokens = load_corpus(args.data, args.val_fraction)
    stream = Stream(train_tokens, args.data_order, args.seed, args.seq, args.batch)
    val = Stream(val_tokens, "sequential", args.seed, args.seq, args.batch) \
        if len(val_tokens) > 0 else None

    rss_before = training_memory_start()
    model, wrapped, opt = build(args, rank, world)
    dist.barrier()
    out = dict(mode=args.mode, world=world, torch_version=torch.__version__,
               settings=dict(vars(args)), steps=[])
    if args.steps == 0 and val is not None:
        v = evaluate(args, wrapped, val, rank, world)
        out["val_loss"] = v
        if rank == 0:
            print(f"val_loss {v!r}", flush=True)
    for s in range(args.steps):
        t0 = time.perf_counter()
        rank_loss = train_step(args, model, wrapped, opt, stream, s, rank, world)
        t = torch.tensor([rank_loss], dtype=torch.float64)
        dist.all_reduce(t)  # the trainer's metrics all-reduce: the mean over equal slices
        row = dict(step=s + 1, loss=t.item() / world, lr=lr_at(args, s),
                   step_time_s=time.perf_counter() - t0)
        if val is not None and args.eval_every > 0 and \
                ((s + 1) % args.eval_every == 0 or s + 1 == args.steps):
            row["val_loss"] = evaluate(args, wrapped, val, rank, world)
        out["steps"].append(row)
        if rank == 0:
            extra = f" val_loss {row['val_loss']!r}" if "val_loss" in row else ""
            print(f"step {s + 1} loss {row['loss']!r}{extra}", flush=True)
    mem = torch.zeros(world, dtype=torch.float64)
    mem[rank] = peak_rss_mb() - rss_before
    dist.all_reduce(mem)
    out["train_memory_mb"] = mem.tolist()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    # Every rank is past its last collective and rank 0 has written everything: leave without the
    # process group's teardown. torch 2.15's Gloo group aborted there once in a clean-clone test
    # run ("terminate called without an active exception", rank 3 of 4, exit -6) after all 30
    # steps had been printed.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
