"""Tensor parallel in a hand-written loop (tests/multiproc/own_loop_tp_worker.py) under torchrun equals the same
loop in one process: every micro-step's loss (gathered per sample), each update's gradient norm, the final full
weights (`get_state_dict`) and an evaluation pass's gathered logits over an uneven set, with accumulation,
clipping that bites and a short last batch.

- the zoo transformer (its plan built in) on 2 ranks: ``ddp`` data 1 × tensor 2;
- a user's model split by its own plan, given as a function, on 4 ranks: ``fsdp`` data 2 × tensor 2 — 4 ranks
  so that FSDP really shards over the data dimension and the loaders, the gradient average and
  `gather_for_metrics` see two shards, each read by a tensor group of two ranks.

One process of each loop (``local``) is the reference; the tolerance is the Trainer's for its layouts (1e-5
relative; the runs differ by the order of float sums only).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from procs import check, command, job_env, run

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

WORKER = str(Path(__file__).resolve().parent / "own_loop_tp_worker.py")
CASES = {"transformer": ("ddp", 2), "user": ("fsdp", 4)}  # model: (data backend, ranks), tensor 2 in each


def loop_runs(out: Path, models: str, backend: str, tensor: int, launcher: str, nproc: int) -> dict[str, dict]:
    out.mkdir(parents=True, exist_ok=True)
    done = check(run(command(launcher, [WORKER, models, backend, str(tensor), str(out)], nproc), env=job_env({}),
                     timeout=240))
    assert not done.left_behind, done.left_behind
    return {which: json.loads((out / f"{which}.json").read_text()) for which in models.split(",")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return loop_runs(tmp_path_factory.mktemp("one"), ",".join(CASES), "local", 1, "python", 1)


def relative(got: list[float], want: list[float]) -> float:
    want_arr = np.asarray(want)
    return float(np.max(np.abs(np.asarray(got) - want_arr)) / np.max(np.abs(want_arr)))


@pytest.mark.parametrize("model", list(CASES))
def test_tensor_parallel_loop_equals_one_process(one_process: dict[str, dict], tmp_path: Path, model: str) -> None:
    backend, nproc = CASES[model]
    ref = one_process[model]
    got = loop_runs(tmp_path, model, backend, 2, "torchrun", nproc)[model]
    assert (got["backend"], got["world"]) == (backend, nproc)
    assert len(got["losses"]) == len(ref["losses"]) == 12  # 2 epochs of 6 micro-steps, the last one short
    assert ref["losses"][-1] < ref["losses"][0] and min(ref["norms"]) > 0.3  # it learned; the clip bit each time
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["norms"], ref["norms"], rtol=1e-5)
    assert got["ids"] == ref["ids"] == list(range(13))  # each evaluation sample once, in one process's order
    assert got["threads_left"] == [], got["threads_left"]  # the groups ended with end(), the model still held
    assert relative(got["logits"], ref["logits"]) < 1e-5
    assert got["weights"].keys() == ref["weights"].keys()  # the plain model's names (qkv rows back in order)
    for name, values in ref["weights"].items():
        assert relative(got["weights"][name], values) < 1e-5, name
    draws = got["draws"]  # after setup, the ranks of a tensor group draw alike (their dropout masks), shards not
    tensor_groups = [draws[r:r + 2] for r in range(0, nproc, 2)]
    assert all(group[0] == group[1] for group in tensor_groups)
    assert len({tuple(group[0]) for group in tensor_groups}) == nproc // 2
