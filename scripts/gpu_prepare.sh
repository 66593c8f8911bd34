#!/usr/bin/env bash
# Prepare, here (with network), what the GPU machine lacks for scripts/gpu_check.sh.
#
#   bash scripts/gpu_prepare.sh              # downloads into .gpu-wheels/ (git-ignored, ~5 MB)
#   bash scripts/gpu_prepare.sh --check      # only says what is there and what is missing
#
# The GPU machine (see /work/.library/device/KINDS.md) has Python 3.12 with torch + CUDA, Lightning,
# Accelerate, mpi4py, pyarrow, numpy, pyyaml, safetensors, tqdm, scikit-learn, matplotlib and pillow,
# and no network. polytrain itself travels as the working tree (gpu_check.sh installs it there from the
# tree, offline); everything it imports is on the image (tensorboardX, which it uses only when present,
# is not needed). What is missing is DeepSpeed, for the backend's ZeRO 1-3 rows:
#   - DeepSpeed as its source archive: built there by gpu_check.sh with DS_BUILD_OPS=0 against the
#     machine's CUDA torch (a wheel built here would record this machine's CPU accelerator);
#   - its pure-Python needs the image lacks: hjson, pydantic (+ pydantic-core for cp312 manylinux
#     x86_64, annotated-types, typing-inspection) and a typing-extensions new enough for pydantic-core.
# Everything else DeepSpeed needs (einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, torch,
# tqdm) is on the image. Horovod and TensorFlow are not carried: horovod runs through polytrain's shim.
#
# Then, in every device run that needs them, carry the folder (run tool: carry [".gpu-wheels"]);
# gpu_check.sh installs them into $POLYTRAIN_GPU_SITE (default /tmp/polytrain-gpu-site) by itself.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DEST="${POLYTRAIN_GPU_WHEELS:-$REPO/.gpu-wheels}"
PY="${POLYTRAIN_PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

# name==version: the versions polytrain's test set-up runs DeepSpeed with (constraints.txt pins deepspeed)
DEEPSPEED="deepspeed==0.19.8"
WHEELS=(
  "hjson==3.1.0"
  "pydantic==2.14.4"
  "pydantic-core==2.50.5"
  "annotated-types==0.8.0"
  "typing-inspection==0.4.5"
  "typing-extensions==4.16.0"
)
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$tag")
done

if [[ "${1:-}" == "--check" ]]; then
  ls -l "$DEST" 2>/dev/null || echo "gpu_prepare: $DEST does not exist yet"
  exit 0
fi

# keep the folder out of git without touching .gitignore
exclude="$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)"
mkdir -p "$(dirname "$exclude")"
entry="/$(basename "$DEST")/"
if [[ "$DEST" == "$REPO/"* ]] && ! grep -qxF "$entry" "$exclude" 2>/dev/null; then
  echo "$entry" >>"$exclude"
  echo "gpu_prepare: added $entry to $exclude"
fi

mkdir -p "$DEST"
rm -f "$DEST"/*.whl "$DEST"/*.tar.gz  # one version of each: two would stop the install there
echo "gpu_prepare: wheels for CPython 3.12, manylinux x86_64 -> $DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"
echo "gpu_prepare: $DEEPSPEED as a source archive (built on the GPU machine)"
# --no-build-isolation: pip reads the archive's metadata with this Python's setuptools and torch
"$PY" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$DEST" "$DEEPSPEED"

count=$(find "$DEST" -maxdepth 1 \( -name '*.whl' -o -name '*.tar.gz' \) | wc -l)
echo "gpu_prepare: $count files, $(du -sh "$DEST" | cut -f1) in $DEST:"
ls -1 "$DEST"
