"""A hand-written loop keeps training in place when a rank is SIGKILLed (issue 51, items 4 and 5, on ddp, on
horovod with polytrain's Horovod implementation and on fsdp, whose re-form shards the commit into a fresh module):
tests/multiproc/elastic_loop_worker.py on 3 ranks under ``polytrain launch --launcher local --elastic`` loses spawn
rank 1 right after step 3; the two survivors roll back to their commit of step 2, re-form the group at 2 ranks in
the same processes and go on with the same global batch of 9 (shares of 5 and 4, each rank's loss weighted by its
share), through the rest of epoch 0 and all of epoch 1.

Checked against what a run that never failed does: each step trains the next 9 samples of the epoch's one-process
order (so every sample of each epoch exactly once), and one process training those global batches in turn
ends on the same weights (rtol 1e-5)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from procs import PYTHON, check, loopback_env, run

pytestmark = [pytest.mark.multiproc]

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "elastic_loop_worker.py")
KILL_STEP, KILL_RANK = 3, 1
# each rank on a loopback "host" of its own: the driver blacklists the dead rank's host only (Horovod's rule)
HOSTS = "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["ddp", "horovod", "fsdp"])
def test_an_own_loop_goes_on_in_place_after_a_killed_rank(tmp_path: Path, backend: str) -> None:
    sys.path.insert(0, str(HERE))
    import elastic_loop_worker as worker
    from multiproc.elastic_parts import last_trained
    from torch.utils.data import TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    env = loopback_env(POLYTRAIN_ELASTIC_DISCOVERY_INTERVAL="0.2", HOROVOD_GLOO_TIMEOUT_SECONDS="60",
                       POLYTRAIN_HOROVOD_IMPL="shim")
    result = run([*PYTHON, "-m", "polytrain.cli", "launch", "--launcher", "local", "--elastic", "-np", "3",
                  "--min-np", "2", "-H", HOSTS, WORKER, backend, str(tmp_path), "--kill", f"{KILL_STEP}:{KILL_RANK}"],
                 env=env, timeout=300)
    check(result)
    assert result.left_behind == []
    assert "re-formed from 3 to 2 ranks" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]

    pids = {r["spawn"]: r["pid"] for r in records if r["round"] == 0}
    assert len(pids) == 3
    # the survivors went on in the processes they were: none was started for them
    assert {r["pid"] for r in records if r["round"] == 1} == {pids[0], pids[2]}
    final = last_trained(records)
    steps = sorted(final)
    per_epoch = -(-worker.N // (worker.BATCH * 3))
    assert steps == list(range(1, 2 * per_epoch + 1))
    redone = {r["step"] for r in records if r["round"] == 1} & {r["step"] for r in records if r["round"] == 0}
    assert redone == {KILL_STEP}  # rolled back to the commit of step 2: only step 3 is trained again
    assert [len(final[s]) for s in steps] == [3] * (KILL_STEP - 1) + [2] * (len(steps) - KILL_STEP + 1)

    # each step: the next global batch of the epoch's order, as one process reads it (every sample once per epoch)
    glob = worker.BATCH * 3
    dataset = TensorDataset(torch.arange(worker.N))
    batches = []
    for epoch in range(2):
        whole = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        whole.set_epoch(epoch)
        order = list(whole)
        for i, step in enumerate(steps[epoch * per_epoch:(epoch + 1) * per_epoch]):
            rows = [row for r in final[step] if r["weight"] > 0 for row in r["rows"]]
            assert sorted(rows) == sorted(order[i * glob:(i + 1) * glob]), (epoch, step)
            if final[step][0]["size"] == 2:  # shares of 5 and 4 (or what is left): each loss weighted by its share
                assert sorted(r["weight"] * len(rows) / 2 for r in final[step]) == \
                    pytest.approx(sorted(len(r["rows"]) for r in final[step]))
            batches.append(rows)

    # one process training those global batches in turn: the same weights
    x, y = worker.data()
    net = worker.model()
    opt = worker.optimizer(net)
    for rows in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
        opt.step()
    weights = json.loads((tmp_path / "weights.json").read_text())
    reference = net.state_dict()
    assert sorted(weights) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(torch.tensor(weights[name]), value, rtol=1e-5, atol=1e-6, msg=name)
