#!/usr/bin/env bash
# Set up (if needed), then lint and run the whole test suite.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh" --all
venv="${POLYTRAIN_VENV:-$repo/.venv}"
cd "$repo"
"$venv/bin/ruff" check .
# two workers (pytest-xdist): most of a multi-process test's time is process start-up, which the other worker's
# tests fill; a file's tests stay on one worker (tests/conftest.py's groups)
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=30 -n 2 --dist loadgroup "$@"
