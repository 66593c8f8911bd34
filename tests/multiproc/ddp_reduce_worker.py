"""Two ranks under torchrun: the ddp backend's gradient reduction (the comm hook that averages each bucket and
notes NaN/Inf) against DDP's own, on real gloo. Each rank writes its findings to ``<dir>/rank<r>.json``."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from polytrain import validation
from polytrain.adapters.torch.ddp import DDPBackend
from polytrain.environments import detect_world


def main() -> None:
    world = detect_world()  # torchrun's
    rank = world.rank
    backend = DDPBackend(validation.from_dict({"backend": "ddp"}), world)
    backend.setup()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 300), nn.Tanh(), nn.Linear(300, 70000 // 300), nn.Tanh(), nn.Linear(233, 3))
    plain = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.1)  # DDP's own mean, several buckets
    backend.checks_finite = True
    ours, _ = backend.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(100 + rank)  # each rank its own batch
    x, y = torch.randn(8, 16) * 3, torch.randint(0, 3, (8,))
    report: dict[str, object] = {"rank": rank}
    for net in (ours, plain):
        nn.functional.cross_entropy(net(x), y).backward()
    pairs = list(zip(ours.module.parameters(), plain.module.parameters()))
    report["identical"] = all(torch.equal(a.grad, b.grad) for a, b in pairs)
    report["finite"] = [backend.grads_finite(ours)]
    for poison in (rank == 1, False):  # a NaN on rank 1 only, then a clean step
        for p in ours.parameters():
            p.grad = None
        loss = nn.functional.cross_entropy(ours(x), y)
        (loss * float("nan") if poison else loss).backward()
        report["finite"].append(backend.grads_finite(ours))
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(report))
    backend.teardown()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
