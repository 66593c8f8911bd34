"""The original: one process drives every GPU with `nn.DataParallel` (on a machine without GPUs it runs the
module as it is). Usage: python dataparallel_original.py OUT.json

Moved to polytrain: dataparallel_polytrain.py (README.md shows the lines that change).
"""

import sys

import torch
import torch.nn.functional as F
from digits_task import CLIP, EPOCHS, GLOBAL_BATCH, LR, MOMENTUM, SEED, datasets, make_model, write_result
from torch.utils.data import DataLoader, RandomSampler

out = sys.argv[1]
device = "cuda" if torch.cuda.is_available() else "cpu"
train_set, val_set = datasets()
order = torch.Generator()
loader = DataLoader(train_set, batch_size=GLOBAL_BATCH, sampler=RandomSampler(train_set, generator=order))
val_loader = DataLoader(val_set, batch_size=16)

model = torch.nn.DataParallel(make_model()).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

losses, norms = [], []
for epoch in range(EPOCHS):
    order.manual_seed(SEED + epoch)  # each epoch's order drawn from its own seed
    model.train()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append(loss.item())
        norms.append(norm.item())

model.eval()
preds, targets = [], []
with torch.no_grad():
    for x, y in val_loader:
        preds.append(model(x.to(device)).argmax(1).cpu())
        targets.append(y)
preds, targets = torch.cat(preds), torch.cat(targets)
accuracy = (preds == targets).float().mean().item()
print(f"val accuracy {accuracy:.4f} over {len(targets)} samples")
write_result(out, losses, norms, model.module.state_dict(), val_accuracy=accuracy, val_count=len(targets))
