"""Worker for ``test_workloads.py``: several Trainer runs, one after the other, in one launched job.

``python workload_runs.py PLAN_JSON`` — PLAN_JSON is ``{"runs": [{"spec": null | SPEC_FILE, "sets": [KEY=VALUE, ...],
"resume": null | "auto" | PATH}, ...]}``. Every rank runs ``Trainer(spec, resume=...).fit()`` for each run in turn (rank 0
writes its metrics.jsonl and model). A process start costs seconds (TensorFlow's import alone several), so
one launch trains every source. Under a launcher with several PyTorch ranks the gloo process group is
started once and every run's backend joins it (a backend destroys only a group it started).
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
    specs = [spec_mod.load(run.get("spec"), run["sets"]) for run in plan["runs"]]
    group = world.size > 1 and all(s.framework == "torch" and s.backend not in ("mpi", "horovod") for s in specs)
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
