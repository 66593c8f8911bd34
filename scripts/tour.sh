#!/usr/bin/env bash
# The 5-minute tour: the same spec (examples/digits.yaml) on PyTorch DDP, FSDP, DeepSpeed ZeRO-2,
# Horovod and TensorFlow, 2 processes each, then one figure of all five runs (docs/tour.png).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh" --all
venv="${POLYTRAIN_VENV:-$repo/.venv}"
cd "$repo"
export MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2 PATH="$venv/bin:$PATH"
polytrain="$venv/bin/polytrain"
run() {  # run NAME LAUNCH-ARGS... -- SET...
    local name="$1"; shift
    rm -rf "runs/tour/$name"
    "$polytrain" launch "$@" --set "output=runs/tour/$name" --quiet
}
run ddp --launcher torchrun -np 2 examples/digits.yaml --set backend=ddp
run fsdp --launcher torchrun -np 2 examples/digits.yaml --set backend=fsdp
run zero2 --launcher torchrun -np 2 examples/digits.yaml --set backend=deepspeed --set deepspeed.stage=2
run horovod --launcher horovodrun -np 2 --network-interfaces lo examples/digits.yaml --set backend=horovod
run tensorflow --launcher mpirun -np 2 examples/digits.yaml --set framework=tensorflow
"$polytrain" plot runs/tour/ddp runs/tour/fsdp runs/tour/zero2 runs/tour/horovod runs/tour/tensorflow \
    -o "${TOUR_FIGURE:-docs/tour.png}"
