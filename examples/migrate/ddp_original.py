"""The original: plain DDP, its processes started by `torch.multiprocessing.spawn`, a gloo process group, a
`DistributedSampler` per rank. Usage: python ddp_original.py OUT.json

Moved to polytrain: ddp_polytrain.py (README.md shows the lines that change).
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (see the end of main)
import torch.multiprocessing as mp
import torch.nn.functional as F
from digits_task import CLIP, EPOCHS, GLOBAL_BATCH, LR, MOMENTUM, SEED, datasets, make_model, write_result
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

WORLD_SIZE = 2


def main(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    train_set, _ = datasets()
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(train_set, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)

    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    losses, norms = [], []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
            norms.append(norm.item())

    if rank == 0:
        write_result(out, losses, norms, model.module.state_dict())
    # A clean exit. gloo's threads run until nothing holds the process group: DDP holds it, and so would the
    # defaults of torch.distributed.nn had DDP imported it after init_process_group (hence the import at the top).
    # Left running into interpreter shutdown, a thread that frees a tensor there aborts the process (SIGABRT after
    # a finished run: a rank of this script did so in two of three runs of the whole test suite here). With the
    # model let go first, destroy_process_group joins those threads now, while `mean`, the last collective's
    # tensor, is still alive (so freeing it needs no interpreter lock).
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:  # a free port on loopback for the process group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(main, args=(WORLD_SIZE, port, sys.argv[1]), nprocs=WORLD_SIZE)
