#!/usr/bin/env bash
# Set up (if needed), then lint and run the whole test suite (--quick: the fast single-process tests only).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$repo/scripts/setup.sh" --all
venv="${POLYTRAIN_VENV:-$repo/.venv}"
cd "$repo"
"$venv/bin/ruff" check .
# byte-compile the checkout once: where PYTHONDONTWRITEBYTECODE is set (this machine's shells set it), every rank
# of every launch would otherwise compile polytrain's modules again (~0.35 s of CPU each, a thousand-odd ranks)
"$venv/bin/python" -m compileall -q -j 0 polytrain adapters launchers tests bench examples docker scripts > /dev/null
# three workers (pytest-xdist) on 2 cores: a multi-process test waits in rendezvous, timeouts and its launcher,
# which the other workers' tests fill (two left the CPU ~18 % idle; three keep it busy: the whole suite took
# 79 min at two, 71 at three, with the image built in it); a file's tests stay on one worker (tests/conftest.py)
if [[ "${1:-}" == "--quick" ]]; then
    # for iterating: the tests that start no multi-process job and take no more than a few seconds (a few minutes
    # in all); CI runs everything
    shift
    set -- -m "not multiproc and not slow" --ignore=tests/multiproc --ignore=tests/cluster --ignore=tests/docker "$@"
fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=30 -n 3 --dist loadgroup "$@"
