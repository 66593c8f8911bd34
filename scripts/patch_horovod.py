"""Patch an unpacked Horovod 0.28.1 sdist so it builds against torch 2.x and TF 2.21.

Usage: python scripts/patch_horovod.py SOURCE_DIR
       python scripts/patch_horovod.py --level     (prints PATCH_LEVEL)

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
    if argv[1:] == ["--level"]:
        print(PATCH_LEVEL)
        return 0
    if len(argv) != 2 or not Path(argv[1], "setup.py").is_file():
        print("usage: patch_horovod.py SOURCE_DIR (an unpacked horovod sdist) | --level", file=sys.stderr)
        return 2
    root = Path(argv[1])
    for rel, old, new in PATCHES:
        print(f"  {rel}: {apply_patch(root, rel, old, new)} ({old.strip().splitlines()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
