"""A Horovod elastic script in its usual shape (``hvd.elastic.run``, ``TorchState`` with an ``ElasticSampler``,
``record_batch``, ``state.commit()``) for polytrain's elastic driver and the shim: the group is re-formed in the
same processes when a host joins and when a worker is SIGKILLed.

``python elastic_inplace.py LOGDIR``. 48 samples, 2 per rank and step, 2 epochs, a commit every 2 steps and at
each epoch's end. Rank 0 creates ``$ELASTIC_TEST_MARK`` (the discovery script then lists a new host) at the
commit after 16 samples of epoch 0 and waits until the driver has seen it, so the newcomer joins at the next
commit (24 samples). The worker on host ``$ELASTIC_TEST_KILL_HOST`` SIGKILLs itself before the step at 42
samples (after the commit at 36), so the survivors roll back and redo nothing else. In epoch 1 the worker on host
``$ELASTIC_TEST_PREEMPT_HOST`` gets a SIGTERM before the step at 8 samples (``POLYTRAIN_PREEMPTION_SIGNALS``
set): it leaves after the next commit (16) with exit code 75, and the last worker goes on alone. Each commit appends, per
rank, the steps trained since the previous commit (epoch, samples processed before the step, size, the
sample indices) to LOGDIR/<pid>.jsonl: steps rolled back are never written there; every step trained is also
written at once ("trained"), to count what was done again. Rank 0 writes the final weights.
"""

import json
import os
import signal
import sys
import time

import numpy as np
import torch

import polytrain.horovod.torch as hvd

SAMPLES, BATCH, EPOCHS, COMMIT_EVERY = 48, 2, 2, 2
MARK_AT, KILL_AT, PREEMPT_AT = 16, 42, 8
logdir = sys.argv[1]
hvd.init()
X = torch.from_numpy(np.random.default_rng(0).standard_normal((SAMPLES, 4)).astype(np.float32))
Y = X @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]])
torch.manual_seed(0)
model = torch.nn.Linear(4, 1, bias=False)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(SAMPLES), shuffle=False)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
pending: list[dict] = []
log = open(os.path.join(logdir, f"{os.getpid()}.jsonl"), "a")


def write(event: str, **fields) -> None:
    log.write(json.dumps({"event": event, "pid": os.getpid(), "rank": hvd.rank(), "size": hvd.size(), **fields})
              + "\n")
    log.flush()


def commit() -> None:
    try:
        state.commit()
    except BaseException:  # raised after the commit was made (hosts changed, this rank leaves, a peer lost)
        flush()
        raise
    flush()


def flush() -> None:
    for step in pending:
        write("step", **step)
    pending.clear()


def on_reset() -> None:
    pending.clear()  # rolled back
    write("reset")


state.register_reset_callbacks([on_reset])


def driver_saw_the_new_host() -> None:
    # the one look inside polytrain: whether the driver has seen the new host
    from polytrain.horovod.torch import elastic_world

    member = elastic_world.membership()
    deadline = time.monotonic() + 120
    while member.hosts_update() is None and time.monotonic() < deadline:
        time.sleep(0.05)


@hvd.elastic.run
def train(state) -> None:
    write("formed")
    while state.epoch < EPOCHS:
        loader = torch.utils.data.DataLoader(range(SAMPLES), batch_size=BATCH, sampler=state.sampler)
        for index in loader:
            at = state.sampler.processed_num
            host = os.environ.get("HOROVOD_HOSTNAME")
            if (state.epoch, at) == (0, KILL_AT) and host == os.environ.get("ELASTIC_TEST_KILL_HOST"):
                os.kill(os.getpid(), signal.SIGKILL)
            if (state.epoch, at) == (1, PREEMPT_AT) and host == os.environ.get("ELASTIC_TEST_PREEMPT_HOST"):
                os.kill(os.getpid(), signal.SIGTERM)  # noted; this rank leaves at the next commit
            optimizer.zero_grad()
            loss = ((model(X[index]) - Y[index]) ** 2).mean()
            loss.backward()
            optimizer.step()
            write("trained", epoch=state.epoch, at=at)
            pending.append({"epoch": state.epoch, "at": at, "indices": index.tolist()})
            state.sampler.record_batch(0, BATCH)
            state.batch += 1
            if state.batch % COMMIT_EVERY == 0:
                commit()
                if (state.epoch, state.sampler.processed_num) == (0, MARK_AT) and hvd.rank() == 0 and \
                        os.environ.get("ELASTIC_TEST_MARK") and not os.path.exists(os.environ["ELASTIC_TEST_MARK"]):
                    open(os.environ["ELASTIC_TEST_MARK"], "w").close()
                    driver_saw_the_new_host()
        state.epoch += 1
        state.batch = 0
        state.sampler.set_epoch(state.epoch)
        commit()


train(state)
if hvd.rank() == 0:
    write("done", weight=model.weight.detach().double().flatten().tolist())
else:
    write("done")
