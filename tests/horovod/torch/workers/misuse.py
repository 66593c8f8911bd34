"""Ranks that disagree: each mode must end in an error on every rank or a stall report, never a hang.

Usage: misuse.py MODE, with MODE one of
  shape  every rank allreduces 'grads', rank 1 with one more element
  op     rank 0 allreduces 'loss' while the others allgather it
  dtype  rank 1 broadcasts float64 where the others send float32
  model  rank 1 wraps a model with one more layer in DistributedOptimizer
  stall  rank 1 skips the allreduce 'skipped' and sleeps; the others wait in it
Each rank prints ``OUTCOME rank=<r> <ExceptionType>: <message>`` before exiting non-zero, and
writes the same outcome to ``$RESULT_DIR/outcome<r>.txt`` (lines from several ranks can interleave
in one pipe).
"""

import os
import sys
import time

import torch

import polytrain.horovod.torch as hvd

mode = sys.argv[1]
hvd.init()
r = hvd.rank()
hvd.allreduce(torch.ones(1), name="warmup")  # the ranks agree up to here
try:
    if mode == "shape":
        hvd.allreduce(torch.ones(4 + (r == 1)), name="grads")
    elif mode == "op":
        if r == 0:
            hvd.allreduce(torch.ones(2), name="loss")
        else:
            hvd.allgather(torch.ones(2), name="loss")
    elif mode == "dtype":
        hvd.broadcast(torch.ones(3, dtype=torch.float64 if r == 1 else torch.float32), root_rank=0, name="weights")
    elif mode == "model":
        layers = [torch.nn.Linear(4, 4) for _ in range(2 + (r == 1))]
        model = torch.nn.Sequential(*layers)
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    elif mode == "stall":
        if r == 1:
            time.sleep(120)
        else:
            hvd.allreduce(torch.ones(2), name="skipped")
    outcome = "no error"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
if os.environ.get("RESULT_DIR"):
    with open(os.path.join(os.environ["RESULT_DIR"], f"outcome{r}.txt"), "w") as handle:
        handle.write(outcome)
print(f"OUTCOME rank={r} {outcome}", flush=True)
sys.exit(0 if outcome == "no error" else 3)
