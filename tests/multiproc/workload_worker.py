"""An example script and then several Trainer runs in one launched job (``test_workloads.py``).

``python workload_worker.py SCRIPT OUTPUT PLAN_JSON``: every rank first runs SCRIPT (``examples/fit/...``) as
its ``__main__`` with the argument OUTPUT, as ``python SCRIPT OUTPUT`` would in a fresh process up to its end,
then the Trainer runs of PLAN_JSON (`resume_worker.main`, its format) in the same process. A launch costs
seconds of CPU per rank before anything trains (torch's import, TensorFlow's ~10 s), so an example's launch
carries the runs that need the same launcher (and, for TensorFlow's multi-worker strategy, a fresh process:
the script comes first).
"""

from __future__ import annotations

import runpy
import sys


def main(script: str, output: str, plan_json: str) -> None:
    argv = sys.argv
    sys.argv = [script, output]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv
    sys.stdout.flush()
    import resume_worker  # this folder is the script's, first on sys.path

    resume_worker.main(plan_json)


if __name__ == "__main__":
    from polytrain.cli import exit_after_training

    main(*sys.argv[1:4])
    exit_after_training()
