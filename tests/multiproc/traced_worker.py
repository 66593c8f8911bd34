"""Several traced Trainer runs in one launched job (``test_timeline.py``, ``test_profile_ddp.py``): a process start
costs seconds of CPU (torch, torch._dynamo, DeepSpeed), so the 2-rank torchrun cases of a file train in turn in one
launch.

``python traced_worker.py PLAN_JSON`` — PLAN_JSON is ``{"runs": [{"sets": [KEY=VALUE, ...], "timeline": FILE}, ...]}``
(``timeline`` optional: ``polytrain train --timeline FILE``). Every rank runs ``Trainer(spec, timeline=...).fit()`` for
each run in turn, as ``resume_worker.py`` does: the worker starts the gloo process group once and every run's backend
joins it (a backend only starts a group when none exists, and only destroys one it started). DeepSpeed's
communication object (``deepspeed.comm.comm.cdb``) keeps the ``torch.distributed`` functions it found when made
(the timeline's wrappers of the run that made it): it is dropped after each run, so that each run's DeepSpeed
makes its own, with that run's wrappers, as in a process of its own.
"""

from __future__ import annotations

import datetime
import json
import sys

from polytrain import validation
from polytrain.environments import detect_world
from polytrain.train.trainer import Trainer


def main(plan_json: str) -> None:
    runs = json.loads(plan_json)["runs"]
    world = detect_world()
    specs = [validation.load(None, r["sets"]) for r in runs]
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=world.rank, world_size=world.size, timeout=datetime.timedelta(seconds=120))
    try:
        for spec, run in zip(specs, runs):
            Trainer(spec, world, show_progress=False, timeline=run.get("timeline")).fit()
            if "deepspeed.comm.comm" in sys.modules:
                sys.modules["deepspeed.comm.comm"].cdb = None
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from polytrain.cli import exit_after_training

    main(sys.argv[1])
    exit_after_training()
