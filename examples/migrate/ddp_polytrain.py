"""ddp_original.py moved to `polytrain.torch`: `Distributed.launch` starts the ranks (as `mp.spawn` did), and
`Distributed` makes the process group, the sampler and the DDP wrapper; `Distributed("fsdp")`,
`"deepspeed"`, `"horovod"` or `"mpi"` runs the same loop on another backend. Usage: python ddp_polytrain.py
OUT.json (starts 2 ranks itself; under torchrun, mpirun or srun it is one of the ranks they started).
"""

import sys

import torch
import torch.nn.functional as F
from digits_task import CLIP, EPOCHS, GLOBAL_BATCH, LR, MOMENTUM, SEED, datasets, make_model, write_result
from torch.utils.data import DataLoader

from polytrain.torch import Distributed


def main(out: str) -> None:
    dist = Distributed("ddp", seed=SEED)
    train_set, _ = datasets()
    loader = DataLoader(train_set, batch_size=GLOBAL_BATCH // dist.world_size, shuffle=True)
    loader = dist.setup_dataloaders(loader)

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model, optimizer = dist.setup(model, optimizer)

    losses, norms = [], []
    for _ in range(EPOCHS):
        for x, y in loader:
            x, y = x.to(dist.device), y.to(dist.device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            dist.backward(loss)
            norm = dist.clip_grad_norm_(model, CLIP)
            optimizer.step()
            losses.append(dist.all_reduce(loss.detach(), "mean").item())
            norms.append(float(norm))

    state = dist.get_state_dict(model)
    if dist.is_main:
        write_result(out, losses, norms, state)
    dist.end()


if __name__ == "__main__":
    Distributed.launch(main, sys.argv[1], np=2)
