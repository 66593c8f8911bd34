"""Worker for ``test_resume_matrix.py``: several resumed Trainer runs in one launched job.

``python resume_worker.py PLAN_JSON`` — PLAN_JSON is ``{"sets": [KEY=VALUE, ...], "runs": [{"output": DIR,
"resume": CHECKPOINT}, ...]}``. Every rank runs ``Trainer(spec, resume=CHECKPOINT).fit()`` for each run in
turn, with the common ``sets`` plus ``output=DIR``; rank 0 writes each run's ``metrics.jsonl`` and model.

Starting a process costs seconds (DeepSpeed's import alone several), so one launch of a target
backend resumes from every source's checkpoint. Under torchrun the worker starts the gloo process
group once and every run's backend joins it (a backend only starts a group when none exists, and
only destroys one it started); under mpirun the ``mpi`` backend uses ``MPI_COMM_WORLD`` as usual.
"""

from __future__ import annotations

import datetime
import json
import sys

from polytrain import spec as spec_mod
from polytrain.environments import detect_world
from polytrain.trainer import Trainer


def main(plan_json: str) -> None:
    plan = json.loads(plan_json)
    world = detect_world()
    specs = [spec_mod.load(None, [*plan["sets"], f"output={r['output']}"]) for r in plan["runs"]]
    group = world.size > 1 and specs[0].framework == "torch" and specs[0].backend != "mpi"
    if group:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=world.rank, world_size=world.size,
                                timeout=datetime.timedelta(seconds=120))
    try:
        for spec, run in zip(specs, plan["runs"]):
            Trainer(spec, world, show_progress=False, resume=run["resume"]).fit()
    finally:
        if group:
            dist.destroy_process_group()


if __name__ == "__main__":
    from polytrain.cli import exit_after_training

    main(sys.argv[1])
    exit_after_training()
