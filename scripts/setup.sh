#!/usr/bin/env bash
# Installs the Debian packages fsdp-cpp builds with, only those that are missing; with --test also
# those only the test suite uses (python3-torch: torchrun and the Python peers; iproute2: the
# two-namespace test; slurmctld, slurmd, slurm-client, munge: the one-node Slurm cluster that
# tests/slurm_cluster_test.cpp starts with its own configuration). Quick (a dpkg query) when
# everything is present.
set -euo pipefail
pkgs=(cmake ninja-build g++ lld libtorch-dev libgloo-dev libopenblas0-openmp libgtest-dev
      nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libxxhash-dev)
[ "${1:-}" = "--test" ] && pkgs=(python3-torch iproute2 slurmctld slurmd slurm-client munge)
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
