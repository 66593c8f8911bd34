"""The original: a Hugging Face Accelerate script (`Accelerator`, `prepare`, `accumulate`, `backward`,
`gather_for_metrics`). Usage: accelerate launch --num_processes 2 accelerate_original.py OUT.json

Shown, not run, here: Accelerate is not installed in polytrain's environment, so the tests run only the moved
version (accelerate_polytrain.py) and compare it with the one-process original of the same problem
(dataparallel_original.py). README.md shows the lines that change and why the updates are the same.
"""

import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from digits_task import CLIP, EPOCHS, GLOBAL_BATCH, LR, MOMENTUM, SEED, datasets, make_model, write_result
from torch.utils.data import DataLoader, RandomSampler

ACCUM = 2  # micro-steps per optimizer step

out = sys.argv[1]
accelerator = Accelerator(gradient_accumulation_steps=ACCUM)
train_set, val_set = datasets()
order = torch.Generator()
loader = DataLoader(train_set, batch_size=GLOBAL_BATCH // (ACCUM * accelerator.num_processes),
                    sampler=RandomSampler(train_set, generator=order))
val_loader = DataLoader(val_set, batch_size=16)

model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
model, optimizer, loader, val_loader = accelerator.prepare(model, optimizer, loader, val_loader)

losses, norms, window = [], [], 0.0
for epoch in range(EPOCHS):
    order.manual_seed(SEED + epoch)  # each epoch's order drawn from its own seed
    model.train()
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), CLIP).item())
            optimizer.step()
            optimizer.zero_grad()
        window += accelerator.reduce(loss.detach(), "mean").item() / ACCUM
        if accelerator.sync_gradients:
            losses.append(window)
            window = 0.0

model.eval()
preds, targets = [], []
with torch.no_grad():
    for x, y in val_loader:
        p, t = accelerator.gather_for_metrics((model(x).argmax(1), y))
        preds.append(p.cpu())
        targets.append(t.cpu())
preds, targets = torch.cat(preds), torch.cat(targets)
accuracy = (preds == targets).float().mean().item()
accelerator.print(f"val accuracy {accuracy:.4f} over {len(targets)} samples")
state = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    write_result(out, losses, norms, state, val_accuracy=accuracy, val_count=len(targets))
accelerator.end_training()
