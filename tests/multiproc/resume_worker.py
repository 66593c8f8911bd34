"""Several Trainer runs in one launched job: ``test_resume_matrix.py``, ``test_workloads.py`` and, through
`procs.trained_runs`, the tied-pipeline, sharded-parity and checkpointing/compile files.

``python resume_worker.py PLAN_JSON`` — PLAN_JSON is ``{"sets": [KEY=VALUE, ...], "runs": [{"spec": SPEC_FILE,
"sets": [KEY=VALUE, ...], "output": DIR, "resume": CHECKPOINT | "auto"}, ...]}``, every key but ``runs``
optional. Every rank runs ``Trainer(spec, resume=...).fit()`` for each run in turn: the run's spec file (or
the defaults) with the common ``sets``, the run's own ``sets`` and ``output=DIR``; rank 0 writes each run's
``metrics.jsonl`` and model.

Starting a process costs seconds (DeepSpeed's and TensorFlow's imports alone several), so one launch of a
target backend resumes from every source's checkpoint, or trains every data source. Under torchrun the worker starts the gloo process
group once and every run's backend joins it (a backend only starts a group when none exists, and
only destroys one it started); under mpirun the ``mpi`` backend uses ``MPI_COMM_WORLD`` as usual.
"""

from __future__ import annotations

import datetime
import json
import sys

from polytrain import validation
from polytrain.environments import detect_world
from polytrain.train.trainer import Trainer


def main(plan_json: str) -> None:
    plan = json.loads(plan_json)
    world = detect_world()
    specs = [validation.load(r.get("spec"), [*plan.get("sets", ()), *r.get("sets", ()),
                                              *([f"output={r['output']}"] if "output" in r else [])])
             for r in plan["runs"]]
    group = world.size > 1 and all(s.framework == "torch" and s.backend != "mpi" for s in specs)
    if group:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=world.rank, world_size=world.size,
                                timeout=datetime.timedelta(seconds=120))
    try:
        for spec, run in zip(specs, plan["runs"]):
            Trainer(spec, world, show_progress=False, resume=run.get("resume")).fit()
    finally:
        if group:
            dist.destroy_process_group()


if __name__ == "__main__":
    from polytrain.cli import exit_after_training

    main(sys.argv[1])
    exit_after_training()
