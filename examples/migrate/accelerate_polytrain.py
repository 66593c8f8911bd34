"""accelerate_original.py moved to `polytrain.torch`: the same verbs (`setup` for `prepare`, `accumulate`,
`backward`, `clip_grad_norm_`, `gather_for_metrics`, `print`), on any of polytrain's backends and launchers.
Usage: torchrun --nproc_per_node 2 accelerate_polytrain.py OUT.json (or polytrain launch, mpirun, srun, ...).
"""

import sys

import torch
import torch.nn.functional as F
from digits_task import CLIP, EPOCHS, GLOBAL_BATCH, LR, MOMENTUM, SEED, datasets, make_model, write_result
from torch.utils.data import DataLoader

from polytrain.torch import Distributed

ACCUM = 2  # micro-steps per optimizer step

out = sys.argv[1]
dist = Distributed("ddp", grad_accum_steps=ACCUM, seed=SEED)
train_set, val_set = datasets()
loader = DataLoader(train_set, batch_size=GLOBAL_BATCH // (ACCUM * dist.world_size), shuffle=True)
val_loader = DataLoader(val_set, batch_size=16)

model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
model, optimizer = dist.setup(model, optimizer)
loader, val_loader = dist.setup_dataloaders(loader, val_loader)

losses, norms, window = [], [], 0.0
for _ in range(EPOCHS):
    model.train()
    for x, y in loader:
        x, y = x.to(dist.device), y.to(dist.device)
        with dist.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            dist.backward(loss)
            if dist.sync_gradients:
                norms.append(dist.clip_grad_norm_(model, CLIP))
            optimizer.step()
            optimizer.zero_grad()
        window += dist.all_reduce(loss.detach(), "mean").item() / ACCUM
        if dist.sync_gradients:
            losses.append(window)
            window = 0.0

model.eval()
preds, targets = [], []
with torch.no_grad():
    for x, y in val_loader:
        p, t = dist.gather_for_metrics((model(x.to(dist.device)).argmax(1), y.to(dist.device)))
        preds.append(p.cpu())
        targets.append(t.cpu())
preds, targets = torch.cat(preds), torch.cat(targets)
accuracy = (preds == targets).float().mean().item()
dist.print(f"val accuracy {accuracy:.4f} over {len(targets)} samples")
state = dist.get_state_dict(model)
if dist.is_main:
    write_result(out, losses, norms, state, val_accuracy=accuracy, val_count=len(targets))
dist.end()
