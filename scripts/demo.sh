#!/usr/bin/env bash
# Set up (if needed), then train the default job: an MLP on the bundled digits data,
# PyTorch DDP over gloo, 2 processes started by torchrun; then plot its curves.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh"
venv="${POLYTRAIN_VENV:-$repo/.venv}"
cd "$repo"
export MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo
rm -f runs/digits/metrics.jsonl  # a re-run plots this run only
"$venv/bin/polytrain" launch --launcher torchrun -np 2 examples/digits.yaml "$@"
"$venv/bin/polytrain" plot runs/digits -o runs/digits/curves.png
