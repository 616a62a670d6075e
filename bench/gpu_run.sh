#!/usr/bin/env bash
# The GPU run: fsdp-gpu-check's correctness checks, then fsdp-cpp against PyTorch's FSDP2 and
# against no sharding on one GPU (bench/gpu_check.cpp, bench/gpu_fsdp2.py), for the default
# fsdp-bench-sized GPT and a larger one. Run on the GPU machine from the source tree:
#   bench/gpu_run.sh DIR [quick]
# DIR holds fsdp-gpu-check (built with -DFSDP_CUDA=ON against this machine's LibTorch) and any
# shared library it needs that the machine lacks; LibTorch's libraries are the machine's torch
# wheel's. quick: the checks, the default GPT in bf16 and with CPUOffloadPolicy only.
set -uo pipefail
dir=$(cd "${1:?usage: bench/gpu_run.sh DIR [quick]}" && pwd)
quick=${2:-}
py=${PYTHON:-python3}
site=$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
libs=$site/torch/lib:$dir
for d in "$site"/nvidia/*/lib "$site"/nvidia/cu*/lib; do [ -d "$d" ] && libs=$libs:$d; done
export LD_LIBRARY_PATH=$libs:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c 'import torch; print("torch", torch.__version__)'
echo "== checks"
start=$(date +%s)
timeout 180 "$dir/fsdp-gpu-check"
echo "checks exit status $? in $(( $(date +%s) - start )) s"
bench() {  # $1: sizes; $2: the modes (default fp32 and bf16, then no sharding)
  local sizes=$1 modes=${2:-fp32 bf16}
  for mode in $modes; do
    [ "$mode" = fp32 ] && mode=""
    timeout 120 "$dir/fsdp-gpu-check" --bench $sizes $mode
    timeout 120 "$py" -m torch.distributed.run --nproc_per_node 1 --master_port 29517 bench/gpu_fsdp2.py \
      $sizes $mode 2>&1 | grep -v "^W\|^\*\|OMP_NUM"
  done
  [ -n "${2:-}" ] && return
  timeout 120 "$dir/fsdp-gpu-check" --bench $sizes --none
  timeout 120 "$py" -m torch.distributed.run --nproc_per_node 1 --master_port 29517 bench/gpu_fsdp2.py \
    $sizes --none 2>&1 | grep -v "^W\|^\*\|OMP_NUM"
}
echo "== GPT 12 x 1024, seq 1024, batch 8"
if [ "$quick" = quick ]; then
  bench "--layers 12 --width 1024 --heads 16 --seq 1024 --vocab 32768 --batch 8 --steps 10" "--bf16 --bf16"
else
  bench "--layers 12 --width 1024 --heads 16 --seq 1024 --vocab 32768 --batch 8 --steps 10"
fi
echo "== the same, CPUOffloadPolicy (bf16)"
offload="--layers 12 --width 1024 --heads 16 --seq 1024 --vocab 32768 --batch 8 --steps 3 --bf16 --offload"
timeout 120 "$dir/fsdp-gpu-check" --bench $offload
timeout 120 "$py" -m torch.distributed.run --nproc_per_node 1 --master_port 29517 bench/gpu_fsdp2.py \
  $offload 2>&1 | grep -v "^W\|^\*\|OMP_NUM"
[ "$quick" = quick ] && { echo "total $(( $(date +%s) - start )) s"; exit 0; }
echo "== GPT 24 x 2048, seq 1024, batch 4"
bench "--layers 24 --width 2048 --heads 16 --seq 1024 --vocab 32768 --batch 4 --steps 5"
echo "total $(( $(date +%s) - start )) s"
