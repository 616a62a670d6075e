#!/usr/bin/env bash
# LibTorch from PyPI's torch wheel, in a virtual environment outside the source tree (default
# /opt/fsdp-cpp/torch<major><minor>, e.g. torch215). Installs it when missing (about 5.4 GB), then prints
# the directory to pass as CMAKE_PREFIX_PATH: the wheel's torch/ package. Passing that (and not
# Torch_DIR alone) matters where Debian's libtorch-dev is installed too: with Torch_DIR alone,
# Torch's config finds Debian's Caffe2 config first and mixes 1.13 libraries into the link.
# Also installs `safetensors` when missing: the PyTorch peer (bench/fsdp2_peer.py) and its tests
# read fsdp-cpp's checkpoints with it; and transformers 5.x with tokenizers (bench/hf_peer.py).
#   scripts/torch_pip.sh [version] [venv]
set -euo pipefail
version=${1:-2.15.0}
minor=${version%.*}
venv=${2:-/opt/fsdp-cpp/torch${minor//./}}
py=$venv/bin/python
if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" \
    2>/dev/null; then
  echo "torch_pip: installing torch==$version into $venv" >&2
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "torch==$version" >&2
fi
if ! "$py" -c "import safetensors" 2>/dev/null; then
  echo "torch_pip: installing safetensors into $venv" >&2
  "$venv/bin/pip" install --quiet safetensors >&2
fi
# transformers 5.x (with tokenizers): the oracle of the Llama and its Hugging Face directories
# (bench/hf_peer.py, tests/hf_parity_test.cpp) and scripts/tokenize.py's tokenizer.
if ! "$py" -c "import sys, transformers, tokenizers; sys.exit(transformers.__version__.split('.')[0] != '5')" \
    2>/dev/null; then
  echo "torch_pip: installing transformers 5.x into $venv" >&2
  "$venv/bin/pip" install --quiet "transformers>=5,<6" >&2
fi
"$py" -c "import os, torch; print(os.path.dirname(torch.__file__))" 2>/dev/null
