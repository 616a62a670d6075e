#!/usr/bin/env python3
"""Tokenizes a text file for fsdp-train with a Hugging Face tokenizer (the `tokenizers` package).

  scripts/tokenize.py --tokenizer MODEL_DIR_OR_TOKENIZER_JSON input.txt output.u32
  scripts/tokenize.py --tokenizer MODEL_DIR --ids "And God said"    # ids for --prompt

The output's extension gives its format, as fsdp-train reads it (docs/trainer.md, "Data"):
.bin or .u16: little-endian uint16 tokens (nanoGPT's format; vocabularies up to 65,536),
.u32: little-endian uint32 tokens (Llama 3's 128,256, and any other). A vocabulary too large for
uint16 with .bin/.u16 is an error naming .u32. The tokenizer adds its special tokens (e.g. Llama's
<|begin_of_text|>) at the start of each document unless --no-special; documents are separated by
blank lines with --split-documents (else the whole file is one). Prints the token count and the
vocabulary size to pass as fsdp-train's --vocab (a --init-from model directory sets it itself).

Needs `tokenizers` (scripts/torch_pip.sh installs it in the tests' venv; or pip install tokenizers).
"""
import argparse
import array
import os
import sys


def load_tokenizer(path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("tokenize.py: the `tokenizers` package is missing; pip install tokenizers")
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        sys.exit(f"tokenize.py: no tokenizer.json at '{file}'; pass a model directory holding "
                 "one or the file itself")
    return Tokenizer.from_file(file)


def documents(text, split):
    if not split:
        return [text]
    return [d for d in text.split("\n\n") if d.strip()]


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--tokenizer", required=True, help="tokenizer.json or a directory holding one")
    p.add_argument("--ids", help="print the ids of this text (for fsdp-train --prompt) and exit")
    p.add_argument("--no-special", action="store_true", help="do not add special tokens")
    p.add_argument("--split-documents", action="store_true",
                   help="blank lines separate documents, each encoded on its own")
    p.add_argument("input", nargs="?")
    p.add_argument("output", nargs="?")
    args = p.parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    special = not args.no_special
    if args.ids is not None:
        print(",".join(str(i) for i in tok.encode(args.ids, add_special_tokens=False).ids))
        return
    if not args.input or not args.output:
        p.error("give INPUT and OUTPUT (or --ids TEXT)")
    ext = os.path.splitext(args.output)[1].lower()
    if ext not in (".bin", ".u16", ".u32"):
        p.error(f"OUTPUT '{args.output}' must end in .bin or .u16 (uint16) or .u32 (uint32): "
                "fsdp-train takes any other extension for text")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if ext != ".u32" and vocab > 65536:
        sys.exit(f"tokenize.py: the tokenizer has {vocab} tokens, more than uint16 holds; write "
                 f"{os.path.splitext(args.output)[0]}.u32 instead")
    with open(args.input, encoding="utf-8") as f:
        text = f.read()
    ids = array.array("I" if ext == ".u32" else "H")
    docs = documents(text, args.split_documents)
    for enc in tok.encode_batch(docs, add_special_tokens=special):
        ids.extend(enc.ids)
    if sys.byteorder != "little":
        ids.byteswap()
    tmp = args.output + f".tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        ids.tofile(f)
    os.replace(tmp, args.output)
    print(f"tokenize.py: {len(ids)} tokens of {len(docs)} document(s) -> {args.output} "
          f"({'uint32' if ext == '.u32' else 'uint16'}); fsdp-train --vocab {vocab}")


if __name__ == "__main__":
    main(sys.argv[1:])
