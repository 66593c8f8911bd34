"""Test-only parts of the elastic Trainer's proof (tests/multiproc/test_elastic_trainer.py), imported by the
workers through the spec (``model.name: elastic_parts:model``, ``callbacks: [elastic_parts:Samples]``).

`model`: the digits MLP, which notes a digest of every sample row it trains on. `Samples`: at each step's end it
appends the rows of that step, with its step number, its world size, this process's pid and how many times
training (re)started in it (``on_train_start``: once, then once after each recovery), to ``<output>/samples.jsonl``;
with ``ELASTIC_TEST_KILL=STEP:RANK`` the process spawned as rank RANK (``HOROVOD_RANK``, never rewritten)
SIGKILLs itself at the end of step STEP, once its rows are written; with ``ELASTIC_TEST_KILL_AT_START=ROUND:RANK``
the process spawned as rank RANK SIGKILLs itself when training starts for the ROUND-th time in it (after that
many recoveries: the group is re-formed, the commit loaded, no step trained yet). `last_trained`: the tests' reading
of such records.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

from torch import nn

from polytrain.adapters.torch.models import build_model

PENDING: list[str] = []  # rows trained on since the last step's end


class Recording(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Any) -> Any:
        if self.training:
            PENDING.extend(hashlib.sha1(row.numpy().tobytes()).hexdigest()[:20] for row in x.detach().cpu())
        return self.inner(x)


def model(info: Any, **params: Any) -> nn.Module:
    return Recording(build_model("mlp", params, info))


class Samples:
    def __init__(self) -> None:
        self.round = -1
        step, _, rank = os.environ.get("ELASTIC_TEST_KILL", "").partition(":")
        self.kill = (int(step), int(rank)) if step else None
        start, _, rank = os.environ.get("ELASTIC_TEST_KILL_AT_START", "").partition(":")
        self.kill_at_start = (int(start), int(rank)) if start else None

    def on_train_start(self, run: Any) -> None:
        self.round += 1
        PENDING.clear()
        if self.kill_at_start == (self.round, int(os.environ.get("HOROVOD_RANK", "-1"))):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, run: Any, step: int, logs: Any) -> None:
        record = {"pid": os.getpid(), "round": self.round, "step": step, "size": run.world_size, "rank": run.rank,
                  "rows": list(PENDING)}
        PENDING.clear()
        with open(Path(run.spec.output) / "samples.jsonl", "a") as out:
            out.write(json.dumps(record) + "\n")
        if self.kill == (step, int(os.environ.get("HOROVOD_RANK", "-1"))):
            os.kill(os.getpid(), signal.SIGKILL)


def last_trained(records: list[dict]) -> dict[int, list[dict]]:
    """Each step's records (as `Samples` and tests/multiproc/elastic_loop_worker.py write them) from the last time
    it was trained: a step redone after a rollback counts once."""
    last: dict[int, int] = {}
    for r in records:
        last[r["step"]] = max(last.get(r["step"], -1), r["round"])
    out: dict[int, list[dict]] = {}
    for r in records:
        if r["round"] == last[r["step"]]:
            out.setdefault(r["step"], []).append(r)
    return out
