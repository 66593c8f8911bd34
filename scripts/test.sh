#!/usr/bin/env bash
# Set up (if needed), then lint and run the whole test suite.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh" --all
venv="${POLYTRAIN_VENV:-$repo/.venv}"
cd "$repo"
"$venv/bin/ruff" check .
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=30 "$@"
