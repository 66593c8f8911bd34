"""Elastic training; ``crash`` mode: under ``torchrun --max-restarts=1`` rank 1 dies once right
after epoch 3's commit; ``raise`` mode: every rank hits a HorovodInternalError once in epoch 4
(after uncommitted progress) and ``hvd.elastic.run`` rolls back and re-initialises in process; ``preempt`` mode:
rank 1 gets a real SIGTERM in epoch 3, before its commit (with POLYTRAIN_PREEMPTION_SIGNALS set, every rank stops
at that commit with exit code 75; the next start resumes there).

Every start appends ``{"rank", "restart", "start_epoch"}`` to $RESULT_DIR/starts.jsonl; at the
end each rank reports its weights and those of the same training done in one process.
"""

import json
import os
import signal
import sys

import torch

import polytrain.horovod.torch as hvd

EPOCHS = 6
MODE = sys.argv[1]
hvd.init()
r, n = hvd.rank(), hvd.size()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
gen = torch.Generator().manual_seed(0)
X, Y = torch.randn(EPOCHS, n * 4, 3, generator=gen), torch.randn(EPOCHS, n * 4, 1, generator=gen)


def make():
    torch.manual_seed(7)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)


model, inner = make()
optimizer = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, epoch=0, losses=[])


failed = []


@hvd.elastic.run
def train(state):
    with open(os.path.join(os.environ["RESULT_DIR"], "starts.jsonl"), "a") as f:
        f.write(json.dumps({"rank": r, "restart": restart, "start_epoch": state.epoch}) + "\n")
    for epoch in range(state.epoch, EPOCHS):
        rows = slice(r * 4, (r + 1) * 4)
        loss = torch.nn.functional.mse_loss(state.model(X[epoch, rows]), Y[epoch, rows])
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.epoch = epoch + 1
        state.losses = state.losses + [loss.item()]
        if MODE == "raise" and epoch == 3 and not failed:
            failed.append(epoch)  # progress of epoch 4 is not committed: it must be redone
            raise hvd.HorovodInternalError("simulated failure of a collective")
        if MODE == "preempt" and epoch == 2 and r == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # noted only: every rank stops at this epoch's commit
        state.commit()
        if MODE == "crash" and epoch == 2 and r == 1 and restart == 0:
            os._exit(1)  # a crash right after committing epoch 3


train(state)
reference, reference_opt = make()
for epoch in range(EPOCHS):
    torch.nn.functional.mse_loss(reference(X[epoch]), Y[epoch]).backward()
    reference_opt.step()
    reference_opt.zero_grad()
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
with open(os.path.join(os.environ["RESULT_DIR"], f"rank{r}.json"), "w") as f:
    json.dump({"rank": r, "restart": restart, "max_error": float((weights - expected).abs().max()),
               "epochs": state.epoch, "losses": len(state.losses)}, f)
hvd.shutdown()
