#!/usr/bin/env bash
# Installs the Debian packages fsdp-cpp builds with, only those that are missing. Quick (a dpkg
# query) when everything is present.
#   scripts/setup.sh [--test] [--libtorch pip|debian]
# --libtorch pip (the default): python3-venv, for the torch wheel's venv (scripts/torch_pip.sh);
#   debian: Debian's LibTorch 1.13 (libtorch-dev, with the OpenBLAS it runs best on).
# --test: what only the test suite uses instead: iproute2 (the two-namespace test); slurmctld,
#   slurmd, slurm-client, munge (the one-node Slurm cluster that tests/slurm_cluster_test.cpp
#   starts with its own configuration), clang (make thread-safety); for the wheel, Debian's
#   libtorch-dev beside it (the package tests check that an installed fsdp-cpp finds the LibTorch
#   it was built with, not Debian's 1.13); for Debian's LibTorch, python3-torch (torchrun and the
#   Python DDP peer of the same torch).
set -euo pipefail
test=0
libtorch=pip
while [ $# -gt 0 ]; do
  case "$1" in
    --test) test=1 ;;
    --libtorch) libtorch=${2:?--libtorch needs pip or debian}; shift ;;
    *) echo "setup.sh: unknown argument '$1'; usage: setup.sh [--test] [--libtorch pip|debian]" >&2
       exit 2 ;;
  esac
  shift
done
case "$libtorch" in
  pip) torch_pkgs=(python3-venv) test_torch_pkgs=(libtorch-dev) ;;
  debian) torch_pkgs=(libtorch-dev libopenblas0-openmp) test_torch_pkgs=(python3-torch) ;;
  *) echo "setup.sh: --libtorch '$libtorch'; expected pip or debian" >&2; exit 2 ;;
esac
pkgs=(cmake ninja-build g++ lld libgloo-dev libgtest-dev nlohmann-json3-dev libcli11-dev
      libtomlplusplus-dev libxxhash-dev "${torch_pkgs[@]}")
[ $test = 1 ] && pkgs=(iproute2 slurmctld slurmd slurm-client munge clang "${test_torch_pkgs[@]}")
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "setup: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
