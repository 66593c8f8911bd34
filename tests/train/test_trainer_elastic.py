"""The Trainer's side of training in place (polytrain/train/elastic.py, issue 51.2/51.3), on the fakes of
tests/trainer_runs.py: commits every ``elastic.commit_every_n_steps`` steps, and after a lost peer the rollback to
the last commit, the data plan going on at the new world size with the same global batch, callbacks' state
restored. The group's re-forming itself (`polytrain.adapters.torch.elastic_group.regroup`) stands in here as the
driver's next round at one rank; tests/multiproc/test_elastic_trainer.py runs the real one (SIGKILL, gloo)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from trainer_fakes import FakeBackend, FakeJob
from trainer_runs import BATCH, PER_EPOCH, TWO, epoch_order, fit, fit_fails, make_spec, records, sample_ids

from polytrain.adapters.torch import elastic_group
from polytrain.errors import SpecError, TrainingFailure
from polytrain.protocols import DataShard
from polytrain.train.trainer import Trainer
from polytrain.world import World

#: the global batch fixed at the fakes' batch: 7 steps per epoch at any world size
SHAPE: dict[str, Any] = {"backend": "ddp", "loop": {"epochs": 1, "log_every_n_steps": 1},
                         "data": {"global_batch_size": BATCH}}
#: the peer is lost in step 6's gradient reduce; with commits every 2 steps, step 5's update at two ranks is undone
LOST_AT = 6


class DriverBackend(FakeBackend):
    """A fake backend that formed its group on an elastic driver's store; its collectives fail once at
    ``LOST_AT`` as gloo's do when a peer died (``failure`` overrides the error)."""

    name = "ddp"
    membership = "the driver's store"

    @property
    def in_place_refusal(self) -> str | None:  # the contract's answer of a real ddp backend, or of another's
        return None if self.name == "ddp" else f"backend: {self.name!r} cannot recover in place (the contract)"

    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        if self.activity is not None and self.activity.step == LOST_AT and not getattr(self, "failed", False):
            self.failed = True
            raise self._failure or RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        return super().all_reduce(values, op)


class Counter:
    """A callback whose state a commit keeps: the steps it saw."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_step_end(self, run: Any, step: int, logs: Any) -> None:
        self.seen.append(step)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def _one_rank_round(framework: Any, backend: Any, final: bool = False) -> Any:
    """The driver's next round, at one rank (what `elastic_group.regroup` leaves behind)."""
    backend.world = framework.world = World(rank=0, size=1, launcher="polytrain-elastic")
    backend.data_shard = DataShard(1, 0)
    return types.SimpleNamespace(version=1, final=None)


FINAL = "min-np 2 not met within --elastic-timeout 1 s: 1 slots available; lost b (blacklisted)"


def _final_round(framework: Any, backend: Any, final: bool = False) -> Any:
    """The driver's final round (too few slots), at one rank: taken only by a client that writes its commit."""
    assert final
    return types.SimpleNamespace(**{**vars(_one_rank_round(framework, backend)), "final": FINAL})


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int, failure: BaseException | None = None,
         regroup: Any = _one_rank_round) -> tuple[Trainer, FakeJob, Counter]:
    monkeypatch.setattr(elastic_group, "regroup", regroup)
    spec = make_spec(tmp_path / "out", **SHAPE, elastic={"min_np": 1, "commit_every_n_steps": every})
    job, counter = FakeJob(), Counter()

    def backend_factory(spec: Any, world: World, **kw: Any) -> FakeBackend:
        job.backend = DriverBackend(spec, world, failure=failure, **kw)
        return job.backend

    trainer = Trainer(spec, TWO, show_progress=False, backend_factory=backend_factory,
                      framework_factory=job.framework_factory, callbacks=[counter])
    trainer.fit()
    return trainer, job, counter


def test_a_lost_peer_rolls_back_to_the_commit_and_the_epoch_goes_on_at_the_new_size(tmp_path, monkeypatch):
    trainer, job, counter = _run(tmp_path, monkeypatch, every=2)
    spec = trainer.spec
    # steps 1-5 at two ranks (6 samples each), step 6 lost in its gradient reduce; from the commit of step 4
    # steps 5-7 at one rank, which takes the whole global batch (the last step of the epoch has 8 samples)
    assert [(c.step, len(c.x)) for c in job.fw.calls.micro] == [(s, 6) for s in range(1, 6)] + [
        (5, 12), (6, 12), (7, 8)]
    assert [r["step"] for r in records(spec, "elastic_recovery")] == [4]
    assert records(spec, "elastic_recovery")[0]["world_size"] == 1
    # the global batch is kept: one rank now takes every sample of each step, the epoch's order continued
    order, after = epoch_order(spec, 0), job.fw.calls.micro[5:]
    for step in range(5, PER_EPOCH + 1):
        ids = sample_ids(spec, [c for c in after if c.step == step])
        assert sorted(ids) == sorted(order[(step - 1) * BATCH:step * BATCH].tolist())
    # the callback's state came back with the commit: it saw each step once
    assert counter.seen == list(range(1, PER_EPOCH + 1))
    assert trainer.elastic is not None and trainer.elastic.recoveries == 1
    assert trainer.world.size == 1 and trainer.steps.shard.count == 1


def test_the_weights_are_those_of_a_run_that_went_from_two_ranks_to_one_at_the_commit(tmp_path, monkeypatch):
    """Parity with a run that never failed: two ranks to step 4 with a checkpoint there, resumed on one rank. The
    lost step's update at two ranks is undone by the rollback (carried over, it would end elsewhere)."""
    _, job, _ = _run(tmp_path, monkeypatch, every=2)
    ref = tmp_path / "ref"
    fit(make_spec(ref, **{**SHAPE, "loop": {"epochs": 1, "max_steps": 4}}, checkpoint={"every_n_steps": 4}), TWO)
    _, ref_job = fit(make_spec(ref, **SHAPE), World(rank=0, size=1, launcher="polytrain-elastic"), resume="auto")
    assert job.fw.params.keys() == ref_job.fw.params.keys()
    for name, value in job.fw.params.items():
        np.testing.assert_allclose(value, ref_job.fw.params[name], rtol=1e-6, err_msg=name)


def test_too_few_ranks_write_the_last_commit_as_a_checkpoint(tmp_path, monkeypatch):
    """The driver's final round: the commit of step 4 is loaded and written as a normal checkpoint, the run ends in
    one line naming it and the driver's reason; resumed, it ends where the run that went from two ranks to one at
    the commit does."""
    with pytest.raises(TrainingFailure) as failed:
        _run(tmp_path, monkeypatch, every=2, regroup=_final_round)
    saved = tmp_path / "out" / "checkpoints" / "step-00000004"
    assert str(failed.value) == (f"elastic: {FINAL}; the last commit (step 4) is saved as {saved}: resume from it "
                                 "with --resume auto")
    one = World(rank=0, size=1, launcher="polytrain-elastic")
    _, resumed = fit(make_spec(tmp_path / "out", **SHAPE), one, resume="auto")
    ref = tmp_path / "ref"
    fit(make_spec(ref, **{**SHAPE, "loop": {"epochs": 1, "max_steps": 4}}, checkpoint={"every_n_steps": 4}), TWO)
    _, ref_job = fit(make_spec(ref, **SHAPE), one, resume="auto")
    for name, value in resumed.fw.params.items():
        np.testing.assert_allclose(value, ref_job.fw.params[name], rtol=1e-6, err_msg=name)


def test_a_commit_is_a_copy(tmp_path, monkeypatch):
    trainer, job, _ = _run(tmp_path, monkeypatch, every=1)
    commit = trainer.elastic.commit
    before = {k: v.copy() for k, v in commit.model.items()}
    for value in job.fw.params.values():
        value += 1.0
    assert all(np.array_equal(commit.model[k], before[k]) for k in before)


def test_an_error_that_is_no_lost_peer_is_not_recovered(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="a bug"):
        _run(tmp_path, monkeypatch, every=1, failure=RuntimeError("a bug"))


def test_elastic_outside_the_driver_is_one_line(tmp_path):
    spec = make_spec(tmp_path / "out", backend="ddp", elastic={"min_np": 1})
    message = str(fit_fails(spec, SpecError, TWO)[0])
    assert message.startswith("elastic: this job was started by torchrun, not polytrain's elastic driver")
    fit(make_spec(tmp_path / "one", backend="ddp", elastic={"min_np": 1}))  # one process: nothing to recover


def test_a_backend_that_cannot_recover_is_one_line(tmp_path):
    spec = make_spec(tmp_path / "out", backend="ddp")

    job = FakeJob()

    def backend_factory(spec: Any, world: World, **kw: Any) -> FakeBackend:
        job.backend = DriverBackend(spec, world, **kw)
        job.backend.name = "deepspeed"
        return job.backend

    trainer = Trainer(spec, TWO, show_progress=False, backend_factory=backend_factory,
                      framework_factory=job.framework_factory)
    with pytest.raises(SpecError, match="^backend: 'deepspeed' cannot recover in place"):
        trainer.fit()
