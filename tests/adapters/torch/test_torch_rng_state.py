"""Every rank's RNG state in a torch checkpoint (issue 48 item 5), the Trainer's and a hand-written loop's: an entry
``{"cpu": [bytes], "cuda": [bytes]}`` per rank — the CPU generator, and on a rank that trains on a CUDA device
that device's generator (dropout on a GPU draws from it), so a resumed run draws what the run that did not stop
drew. Read from what is saved, on this machine's device; which generators a rank keeps is
`framework.cuda_generator`'s choice, tested as a function (no torch is faked). An older checkpoint's entry, the
CPU generator's list alone, still loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import polytrain  # noqa: E402
from polytrain.adapters.torch.framework import cuda_generator, rng_state, set_rng_state  # noqa: E402
from polytrain.torch import Distributed  # noqa: E402
from polytrain.train.callbacks import Callback  # noqa: E402

CPU_BYTES = torch.get_rng_state().numel()  # 5056: the Mersenne Twister's state and torch's extras


def generators(device: torch.device) -> set[str]:
    """What a rank on ``device`` keeps on this machine."""
    return {"cpu", "cuda"} if device.type == "cuda" and torch.cuda.is_available() else {"cpu"}


def test_a_cuda_rank_keeps_its_own_devices_generator_and_a_cpu_rank_none() -> None:
    assert cuda_generator(torch.device("cuda", 1), available=True) == torch.device("cuda", 1)
    assert cuda_generator(torch.device("cuda"), available=True) == torch.device("cuda")  # the current device
    assert cuda_generator(torch.device("cpu"), available=True) is None  # a CPU rank makes no CUDA context
    assert cuda_generator(torch.device("cuda", 0), available=False) is None
    here = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    state = rng_state(here)
    assert set(state) == generators(here) and state["cpu"] == torch.get_rng_state().tolist()


def test_an_older_checkpoints_list_still_loads_and_a_malformed_state_is_refused() -> None:
    cpu = torch.device("cpu")
    saved = torch.get_rng_state().tolist()
    first = torch.rand(4)
    set_rng_state(saved, cpu)  # an older checkpoint's entry: the CPU generator's bytes alone
    assert torch.equal(torch.rand(4), first)
    set_rng_state({"cpu": saved}, cpu)
    assert torch.equal(torch.rand(4), first)
    for bad, why in [({"cpu": saved[:-1]}, "has 5055 bytes; torch's has 5056"), ({"cuda": saved}, "expected"),
                     ({"cpu": saved, "cuda": [256]}, "'cuda' generator's state is not a list of bytes"),
                     ("abc", "expected")]:
        with pytest.raises(ValueError, match=why):
            set_rng_state(bad, cpu)


def dropout_net() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))


def test_the_own_loop_saves_each_generator_and_a_resume_draws_what_the_run_that_went_on_drew(tmp_path: Path) -> None:
    x = torch.ones(8, 4)
    with Distributed("local") as dist:
        model = dropout_net()
        model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        dist.backward(model(x).pow(2).mean())  # dropout draws
        optimizer.step()
        before = rng_state(dist.backend.device)
        dist.save(tmp_path, {"model": model, "optimizer": optimizer, "step": 1})
        going_on = [model(x).detach() for _ in range(3)]  # training mode: new dropout masks each time
        device = dist.backend.device
    entries = json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())["rng_states"]
    assert len(entries) == 1 and set(entries[0]) == generators(device)
    assert entries[0] == before and len(entries[0]["cpu"]) == CPU_BYTES
    with Distributed("local") as dist:
        torch.manual_seed(1234)  # another stream: the checkpoint's must replace it
        model = dropout_net()
        model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        dist.load(tmp_path, {"model": model, "optimizer": optimizer})
        resumed = [model(x).detach() for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(resumed, going_on)) and not torch.equal(going_on[0], going_on[1])


class Losses(Callback):
    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_step_end(self, run: Any, step: int, logs: Any) -> None:
        self.by_step[step] = float(logs["loss"])


def test_the_trainer_saves_each_generator_and_its_resume_draws_the_same_dropout(tmp_path: Path) -> None:
    """``polytrain.fit`` (the Trainer, one process): the checkpoint of step 2 holds this rank's generators; resumed
    from it, steps 3 and 4 have the losses (dropout masks) of the run that went on."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    data = ((digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64))
    spec = {"output": str(tmp_path), "loop": {"max_steps": 4, "log_every_n_steps": 1},
            "checkpoint": {"every_n_steps": 2}, "optimizer": {"name": "sgd", "lr": 0.1}, "data": {"batch_size": 32}}

    def net() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                   torch.nn.Linear(32, 10))

    whole, resumed = Losses(), Losses()
    polytrain.fit(spec, model=net, train_data=data, loss="cross_entropy", callbacks=[whole], show_progress=False)
    step2 = tmp_path / "checkpoints" / "step-00000002"
    entries = json.loads((step2 / "manifest.json").read_text())["rng_states"]
    assert len(entries) == 1 and set(entries[0]) == generators(torch.device("cpu"))  # polytrain.fit here: CPU
    assert len(entries[0]["cpu"]) == CPU_BYTES and entries[0]["cpu"] != torch.get_rng_state().tolist()
    polytrain.fit(spec, model=net, train_data=data, loss="cross_entropy", callbacks=[resumed], show_progress=False,
                  resume=str(step2))
    assert sorted(resumed.by_step) == [3, 4]
    assert [resumed.by_step[s] for s in (3, 4)] == [whole.by_step[s] for s in (3, 4)]
