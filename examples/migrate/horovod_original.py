"""The original: a Horovod script (`hvd.init`, `DistributedOptimizer`, `broadcast_parameters`, a
`DistributedSampler` over `hvd.size()` ranks, clipping between `synchronize` and `step`). Usage:
horovodrun -np 2 python horovod_original.py OUT.json

It also runs on polytrain's Horovod-compatible API, on PyTorch versions Horovod does not build for, with one
line changed (`import polytrain.horovod.torch as hvd`). Moved to the own-loop API: horovod_polytrain.py.
"""

import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from digits_task import CLIP, EPOCHS, GLOBAL_BATCH, LR, MOMENTUM, SEED, datasets, make_model, write_result
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

out = sys.argv[1]
hvd.init()
train_set, _ = datasets()
sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=SEED)
loader = DataLoader(train_set, batch_size=GLOBAL_BATCH // hvd.size(), sampler=sampler)

model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

losses, norms = [], []
for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.synchronize()  # the averaged gradients, before clipping them
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        with optimizer.skip_synchronize():
            optimizer.step()
        losses.append(hvd.allreduce(loss.detach(), name="loss").item())
        norms.append(norm.item())

if hvd.rank() == 0:
    write_result(out, losses, norms, model.state_dict())
