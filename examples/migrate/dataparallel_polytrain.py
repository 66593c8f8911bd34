"""dataparallel_original.py moved to `polytrain.torch`: one process per device instead of one process for all
of them; each rank reads half of every global batch, and the gradients are averaged over the ranks, so each
update is the original's. Usage: python dataparallel_polytrain.py OUT.json (starts 2 ranks itself; under a
launcher, it is one of them).
"""

import sys

import torch
import torch.nn.functional as F
from digits_task import CLIP, EPOCHS, GLOBAL_BATCH, LR, MOMENTUM, SEED, datasets, make_model, write_result
from torch.utils.data import DataLoader

from polytrain.torch import Distributed


def main(out: str) -> None:
    dist = Distributed("ddp", seed=SEED)
    train_set, val_set = datasets()
    loader = DataLoader(train_set, batch_size=GLOBAL_BATCH // dist.world_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=16)
    loader, val_loader = dist.setup_dataloaders(loader, val_loader)

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model, optimizer = dist.setup(model, optimizer)

    losses, norms = [], []
    for _ in range(EPOCHS):
        model.train()
        for x, y in loader:
            x, y = x.to(dist.device), y.to(dist.device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            dist.backward(loss)
            norm = dist.clip_grad_norm_(model, CLIP)
            optimizer.step()
            losses.append(dist.all_reduce(loss.detach(), "mean").item())
            norms.append(float(norm))

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


if __name__ == "__main__":
    Distributed.launch(main, sys.argv[1], np=2)
