"""A hand-written loop that takes over a Trainer's checkpoint and hands it back: `Distributed.load` of the
Trainer's checkpoint into the digits MLP (the zoo's module, so its state has the zoo's names), then
`Distributed.save` of what it loaded, with its step and epoch, for the Trainer to resume.

Usage: python loop_trainer_worker.py BACKEND TRAINER_CHECKPOINT LOOP_ROOT OUT.json (or `run`, from
own_loop_worker.py ``--jobs``)
"""

from __future__ import annotations

import json
import sys

import torch

from polytrain.adapters.torch.models import build_model
from polytrain.data.source import DatasetInfo
from polytrain.torch import Distributed


def main() -> None:
    run(*sys.argv[1:5])


def run(backend: str, given: str, root: str, out: str) -> None:
    with Distributed(backend) as dist:
        model = build_model("mlp", {"hidden_sizes": [32]}, DatasetInfo((64,), 10, "classification"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = dist.setup(model, optimizer)
        values = dist.load(given, {"model": model, "optimizer": optimizer})
        state = dist.get_state_dict(model)
        saved = dist.save(root, {"model": model, "optimizer": optimizer, "step": values["step"],
                                 "epoch": values["epoch"]})
        if dist.is_main:
            with open(out, "w") as f:
                json.dump({"values": values, "saved": str(saved), "world": dist.world_size,
                           "weights": {k: v.flatten().tolist() for k, v in state.items()}}, f)


if __name__ == "__main__":
    main()
