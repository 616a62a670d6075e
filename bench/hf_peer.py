"""transformers' own LlamaForCausalLM as the oracle of fsdp-cpp's Llama (issue 48).

Subcommands (run with the Python of scripts/torch_pip.sh's venv: torch 2.15, transformers 5.x,
tokenizers, safetensors):

  make DIR       a random LlamaForCausalLM saved with save_pretrained (config.json and
                 model.safetensors, or shards with --max-shard-size), fp32 or --dtype bfloat16
  logits DIR     the logits of the first --rows windows of --seq tokens of --tokens, as
                 AutoModelForCausalLM.from_pretrained(DIR) computes them, into --out (safetensors:
                 "tokens" (R, T) int64, "logits" (R, T, V) fp32)
  train DIR      fine-tunes DIR's model in one process as fsdp-train trains (the data stream,
                 warmup + cosine schedule and AdamW with decay on the 2-D weights of
                 docs/trainer.md sections 5-7, the functions of bench/fsdp2_peer.py); per-step
                 losses into --json, the trained model into --save
  tokenizer DIR  a byte-level BPE tokenizer trained on --corpus (tokenizer.json), for the tests'
                 token files

The model's forward, the loss and the optimizer are transformers' and PyTorch's own, unchanged:
only the data order and the schedule are fsdp-train's.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_peer import Stream, load_corpus, lr_at  # noqa: E402

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402


def make(args):
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16)
    elif args.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=2.0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.ffn,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.max_positions,
                      rms_norm_eps=args.norm_eps, rope_parameters=rope,
                      tie_word_embeddings=args.tie, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1, so that a norm read wrongly shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, args.dtype))
    model.save_pretrained(args.dir, max_shard_size=args.max_shard_size)
    print(f"hf_peer: saved {sum(p.numel() for p in model.parameters())} parameters to {args.dir}")


def windows(args):
    train, _ = load_corpus(args.tokens, 0.0)
    return torch.stack([train[r * args.seq:(r + 1) * args.seq] for r in range(args.rows)])


def logits(args):
    kwargs = {} if args.dtype == "auto" else {"dtype": getattr(torch, args.dtype)}
    model = AutoModelForCausalLM.from_pretrained(args.dir, **kwargs).eval()
    x = windows(args)
    with torch.no_grad():
        out = model(x).logits.float().contiguous()
    save_file({"tokens": x.contiguous(), "logits": out}, args.out)
    print(f"hf_peer: logits {tuple(out.shape)} of {type(model).__name__} "
          f"({next(model.parameters()).dtype}) to {args.out}")


def train(args):
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32)
    model.train()
    tokens, _ = load_corpus(args.data, args.val_fraction)
    stream = Stream(tokens, args.data_order, args.seed, args.seq, args.batch)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)
    vocab = model.config.vocab_size
    steps = []
    for s in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(args, s)
        x, y = stream.fill(s, 0, args.batch)
        loss = F.cross_entropy(model(x).logits.view(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append({"step": s + 1, "loss": loss.item(), "lr": lr_at(args, s)})
        print(f"step {s + 1} loss {loss.item()!r}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__,
                   "steps": steps}, f, indent=1)
    if args.save:
        model.save_pretrained(args.save)


def tokenizer(args):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([args.corpus], trainer)
    os.makedirs(args.dir, exist_ok=True)
    tok.save(os.path.join(args.dir, "tokenizer.json"))
    print(f"hf_peer: tokenizer of {tok.get_vocab_size()} tokens to {args.dir}")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    for name, default in (("layers", 4), ("heads", 8), ("kv-heads", 2), ("width", 64),
                          ("ffn", 160), ("vocab", 512), ("max-positions", 128), ("seed", 0)):
        m.add_argument("--" + name, type=int, default=default)
    m.add_argument("--rope-theta", type=float, default=10000.0)
    m.add_argument("--rope-scaling", choices=["none", "linear", "llama3"], default="none")
    m.add_argument("--norm-eps", type=float, default=1e-5)
    m.add_argument("--tie", action="store_true")
    m.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    m.add_argument("--max-shard-size", default="5GB")
    lg = sub.add_parser("logits")
    lg.add_argument("dir")
    lg.add_argument("--tokens", required=True)
    lg.add_argument("--rows", type=int, default=2)
    lg.add_argument("--seq", type=int, default=32)
    lg.add_argument("--dtype", default="float32", help="auto: the config's dtype")
    lg.add_argument("--out", required=True)
    t = sub.add_parser("train")
    t.add_argument("dir")
    t.add_argument("--data", required=True)
    t.add_argument("--json", required=True)
    t.add_argument("--save")
    t.add_argument("--threads", type=int, default=1)
    for name, default in (("steps", 20), ("seq", 32), ("batch", 8), ("warmup", 5), ("seed", 1337)):
        t.add_argument("--" + name, type=int, default=default)
    for name, default in (("lr", 1e-3), ("min-lr-ratio", 0.1), ("weight-decay", 0.1),
                          ("beta1", 0.9), ("beta2", 0.95), ("eps", 1e-8), ("val-fraction", 0.05)):
        t.add_argument("--" + name, type=float, default=default)
    t.add_argument("--data-order", choices=["random", "sequential"], default="random")
    k = sub.add_parser("tokenizer")
    k.add_argument("dir")
    k.add_argument("--corpus", required=True)
    k.add_argument("--vocab", type=int, default=512)
    args = p.parse_args(argv)
    {"make": make, "logits": logits, "train": train, "tokenizer": tokenizer}[args.cmd](args)


if __name__ == "__main__":
    main(sys.argv[1:])
