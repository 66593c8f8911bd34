"""Patch an unpacked Horovod 0.28.1 sdist so it builds against torch 2.x and TF 2.21.

Usage: python scripts/patch_horovod.py SOURCE_DIR [--gpu]
       python scripts/patch_horovod.py --level [--gpu]     (prints the patch level: PATCH_LEVEL, with --gpu
                                                            followed by g<GPU_PATCH_LEVEL>)

--gpu also applies GPU_PATCHES (the NCCL build's TensorFlow GPU code); they live apart, with a level of their
own, so that a change to them never changes the CPU build's cache key.

Each patch must match exactly once (or already be applied), so a different
sdist fails loudly here instead of half-way through a 15-minute compile.
Running it twice is harmless.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The RUNPATH patch: CMake would bake the absolute directory of the linked
# libmpi (e.g. /work/main/.venv/lib) into the extensions. The extensions live
# in site-packages/horovod/<framework>/, so $ORIGIN/../../../.. is <prefix>/lib
# of whichever environment the wheel is installed into, which keeps a cached
# wheel usable by a venv at another path. System MPIs sit on the default path.
_RPATH_BLOCK = (
    "\nset(CMAKE_CXX_EXTENSIONS OFF)\n"
    "# polytrain: relative RUNPATH so the wheel finds <prefix>/lib/libmpi wherever it is installed\n"
    "set(CMAKE_BUILD_WITH_INSTALL_RPATH TRUE)\n"
    'set(CMAKE_INSTALL_RPATH "\\$ORIGIN/../../../..")\n'
)

# Bump whenever PATCHES changes: build_horovod.sh puts it in the wheel's cache key.
PATCH_LEVEL = 2

# (file, old text, new text): why
PATCHES: list[tuple[str, str, str]] = [
    # torch >= 2.1 and TF >= 2.16 headers need C++17.
    # Whole lines only: the root file also holds "set(CMAKE_CXX_STANDARD 17)" inside a string.
    ("CMakeLists.txt", "\nset(CMAKE_CXX_STANDARD 14)\n", "\nset(CMAKE_CXX_STANDARD 17)\n"),
    ("horovod/torch/CMakeLists.txt", "\n    set(CMAKE_CXX_STANDARD 14)\n", "\n    set(CMAKE_CXX_STANDARD 17)\n"),
    # The XLA custom-call ops include GPU-only TF headers; compile them only with GPU support.
    (
        "horovod/tensorflow/xla_mpi_ops.cc",
        "\n#if TENSORFLOW_VERSION >= 2006000000\n",
        "\n#if TENSORFLOW_VERSION >= 2006000000 && HAVE_GPU\n",
    ),
    ("CMakeLists.txt", "\nset(CMAKE_CXX_EXTENSIONS OFF)\n", _RPATH_BLOCK),
    # horovodrun --mpi: Open MPI 5's mpirun rejects the single-dash "-bind-to none -map-by slot"
    # ("Executable: none"); the double-dash spelling works with Open MPI 4 and 5.
    (
        "horovod/runner/mpi_run.py",
        "\n        return list(_OMPI_FLAGS), list(_NO_BINDING_ARGS), _OMPI_IMPL\n",
        "\n        return list(_OMPI_FLAGS), ['--bind-to none', '--map-by slot'], _OMPI_IMPL\n",
    ),
]


#: TF's stream handle: the code below stands in for stream_executor::gpu::AsGpuStreamValue, which TF 2.17 removed
_STREAM_HANDLE = """namespace stream_executor {
namespace gpu {
// polytrain: the CUDA/HIP stream behind a TensorFlow stream, as TF >= 2.17 hands it out
inline ::GpuStreamHandle AsGpuStreamValue(Stream* stream) {
  return static_cast<::GpuStreamHandle>(stream->platform_specific_handle().stream);
}
} // namespace gpu
} // namespace stream_executor
"""

# Bump whenever GPU_PATCHES changes: it is in the NCCL build's cache key only.
GPU_PATCH_LEVEL = 2

# Compiled only with HAVE_GPU (HOROVOD_GPU_OPERATIONS=NCCL), against TF 2.21's headers and libraries.
GPU_PATCHES: list[tuple[str, str, str]] = [
    # NCCL's shared library, where HOROVOD_NCCL_LINK=SHARED linked it (the nvidia-nccl wheel; libnccl_static.a
    # comes only with NVIDIA's devel images), found from the extensions in site-packages/horovod/<framework>/
    # also by a process that loads TensorFlow's op library before (or without) torch.
    (
        "CMakeLists.txt",
        'set(CMAKE_INSTALL_RPATH "\\$ORIGIN/../../../..")\n',
        'set(CMAKE_INSTALL_RPATH "\\$ORIGIN/../../../..")\n'
        'list(APPEND CMAKE_INSTALL_RPATH "\\$ORIGIN/../../nvidia/nccl/lib")  # polytrain: the NCCL wheel\n',
    ),
    # TF >= 2.17 has no stream_executor::gpu::AsGpuStreamValue (an undefined symbol at run time): declare nothing
    # here, and define it after stream.h from the stream's platform handle.
    (
        "horovod/tensorflow/mpi_ops.cc",
        "// Forward declaration of AsGpuStreamValue\nnamespace stream_executor {\nnamespace gpu {\n"
        "GpuStreamHandle AsGpuStreamValue(Stream* stream);\n} // namespace stream_executor\n} // namespace gpu\n",
        "// polytrain: AsGpuStreamValue is defined after stream.h below\n",
    ),
    (
        "horovod/tensorflow/mpi_ops.cc",
        '#include "tensorflow/stream_executor/stream.h"\n#endif // TENSORFLOW_VERSION >= 2011000000\n',
        '#include "tensorflow/stream_executor/stream.h"\n#endif // TENSORFLOW_VERSION >= 2011000000\n'
        + _STREAM_HANDLE,
    ),
    # The XLA custom-call ops are written against XLA headers TF 2.17+ no longer ships (tensorflow/compiler/xla/
    # service, client): not built. HOROVOD_ENABLE_XLA_OPS then finds no Horovod XLA ops.
    (
        "horovod/tensorflow/xla_mpi_ops.cc",
        "\n#include <unordered_map>\n",
        "\n#include <unordered_map>\n\n#if TENSORFLOW_VERSION < 2017000000  // polytrain: not built on TF >= 2.17\n",
    ),
    (
        "horovod/tensorflow/xla_mpi_ops.cc",
        "#endif // TENSORFLOW_VERSION >= 2006000000\n",
        "#endif // TENSORFLOW_VERSION >= 2006000000\n#endif  // polytrain: TENSORFLOW_VERSION < 2017000000\n",
    ),
]


def apply_patch(root: Path, rel: str, old: str, new: str) -> str:
    """Apply one replacement; return 'patched' or 'already patched'."""
    path = root / rel
    text = path.read_text()
    if new in text:  # every `new` is absent from the pristine sdist
        return "already patched"
    count = text.count(old)
    if count != 1:
        raise SystemExit(f"patch_horovod: expected exactly one {old.strip()!r} in {rel}, found {count}")
    path.write_text(text.replace(old, new))
    return "patched"


def main(argv: list[str]) -> int:
    args = [a for a in argv[1:] if a != "--gpu"]
    gpu = "--gpu" in argv[1:]
    if args == ["--level"]:
        print(f"{PATCH_LEVEL}g{GPU_PATCH_LEVEL}" if gpu else PATCH_LEVEL)
        return 0
    if len(args) != 1 or not Path(args[0], "setup.py").is_file():
        print("usage: patch_horovod.py SOURCE_DIR [--gpu] (an unpacked horovod sdist) | --level [--gpu]",
              file=sys.stderr)
        return 2
    root = Path(args[0])
    for rel, old, new in PATCHES + (GPU_PATCHES if gpu else []):
        print(f"  {rel}: {apply_patch(root, rel, old, new)} ({old.strip().splitlines()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
