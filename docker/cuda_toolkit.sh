#!/usr/bin/env bash
# The CUDA toolkit Dockerfile.cuda's builder compiles with (Horovod's NCCL ops, DeepSpeed's ops): nvcc, the
# CUDA runtime's headers and libraries and NCCL, under /usr/local/cuda.
#
#   docker/cuda_toolkit.sh image VERSION NCCL   an NVIDIA devel base brought them: check they are there
#   docker/cuda_toolkit.sh pypi  VERSION NCCL   any base (plain Debian or Ubuntu): NVIDIA's toolkit wheels from
#                                               PyPI (nvcc, runtime, CCCL, CRT, NVVM of CUDA VERSION, and NCCL
#                                               version NCCL: the one torch's wheel requires), installed to
#                                               /opt/cuda-toolkit and laid out as /usr/local/cuda
#
# Prints the NCCL link mode Horovod must use (STATIC where libnccl_static.a exists; the NCCL wheel has only
# the shared library, which torch's own NCCL wheel provides at run time) to the file named by $NCCL_LINK_FILE.
set -euo pipefail
usage="usage: cuda_toolkit.sh image|pypi CUDA_VERSION NCCL_VERSION"
mode="${1:?$usage}"
version="${2:?$usage}"
nccl="${3:?$usage}"
major="${version%%.*}"
cuda=/usr/local/cuda

if [[ "$mode" = pypi ]]; then
    tools=/opt/cuda-toolkit
    python3 -m venv /tmp/cuda-pip
    /tmp/cuda-pip/bin/pip install --quiet --no-deps --target "$tools" \
        "nvidia-cuda-nvcc==${version}.*" "nvidia-cuda-runtime==${version}.*" "nvidia-cuda-cccl==${version}.*" \
        "nvidia-cuda-crt==${version}.*" "nvidia-nvvm==${version}.*" "nvidia-nccl-cu${major}==${nccl}"
    rm -rf /tmp/cuda-pip
    root="$tools/nvidia/cu${major}"
    ln -sfn lib "$root/lib64"  # where CMake's and torch's CUDA lookups expect the libraries
    cp -a "$tools"/nvidia/nccl/include/. "$root/include/"
    cp -a "$tools"/nvidia/nccl/lib/libnccl.so* "$root/lib/"
    for lib in "$root"/lib/lib*.so.*; do  # the names linkers and CMake's FindCUDAToolkit look for (libcudart.so)
        [[ -e "${lib%.so.*}.so" ]] || ln -s "$(basename "$lib")" "${lib%.so.*}.so"
    done
    ln -sfn "$root" "$cuda"
elif [[ "$mode" != image ]]; then
    echo "cuda_toolkit.sh: mode must be image or pypi, got '$mode'" >&2
    exit 2
fi

"$cuda/bin/nvcc" --version | tail -n 2
nccl_header="$(find "$cuda/include" /usr/include -maxdepth 1 -name nccl.h -print -quit)"
test -n "$nccl_header" || { echo "cuda_toolkit.sh: no nccl.h under $cuda/include or /usr/include" >&2; exit 1; }
if [[ -n "$(find /usr/lib "$cuda/lib64/" -name 'libnccl_static.a' -print -quit)" ]]; then
    link=STATIC
else
    link=SHARED
fi
echo "cuda_toolkit.sh: CUDA $version toolkit in $cuda ($mode); Horovod links NCCL $link"
if [[ -n "${NCCL_LINK_FILE:-}" ]]; then echo "$link" > "$NCCL_LINK_FILE"; fi
