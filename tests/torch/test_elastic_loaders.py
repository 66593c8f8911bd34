"""The own loop's loaders across an elastic recovery (`polytrain.torch.loaders`): a pass stopped after any step
on W ranks goes on at W' ranks from where it stood, at the same global batch, and the two parts together use
every sample of the epoch once; `gather_for_metrics`'s rows are the one-process order; each step's weights make
the ranks' average the mean over the step's samples."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from polytrain.protocols import DataShard
from polytrain.torch.loaders import EpochLoader, Loading, kept_rows, rest_plan


def _loaders(data: TensorDataset, batch: int, world: int, shuffle: bool) -> list[tuple[EpochLoader, Loading]]:
    made = []
    for rank in range(world):
        loading = Loading()
        made.append((EpochLoader(DataLoader(data, batch_size=batch, shuffle=shuffle), DataShard(world, rank), 3,
                                 loading), loading))
    return made


def _steps(iterators: list, loadings: list[Loading]) -> Iterator[tuple[list[list[int]], list]]:
    """The ranks' steps, one at a time: each rank's rows and the place it was told."""
    for batches in zip(*iterators):
        yield [[int(i) for i in b[0]] for b in batches], [loading.place for loading in loadings]


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_pass_goes_on_at_another_world_size_with_every_sample_once(shuffle: bool) -> None:
    for total, batch, world, after in itertools.product(range(1, 12), range(1, 4), range(1, 4), range(1, 5)):
        data = TensorDataset(torch.arange(total))
        order = _loaders(data, batch, world, shuffle)[0][0]._order(0)
        steps = -(-total // (batch * world))
        # the first part: `stop` steps on `world` ranks; the position every rank holds then
        for stop in range(steps + 1):
            first = _loaders(data, batch, world, shuffle)
            iterators = [iter(loader) for loader, _ in first]
            before = list(itertools.islice(_steps(iterators, [lg for _, lg in first]), stop))
            positions = {loader.position() for loader, _ in first}
            assert len(positions) == 1
            epoch, covered = positions.pop()
            assert (epoch, covered) == ((0, min(stop * batch * world, total)) if stop else (0, 0))
            second = []
            for rank in range(after):
                loader = EpochLoader(DataLoader(data, batch_size=batch, shuffle=shuffle), DataShard(world, 0), 3,
                                     Loading())
                loader.reshard(DataShard(after, rank))  # the same global batch, the shard of a new world
                loader.go_on(epoch, covered)
                second.append((loader, loader.loading))
            rest = list(_steps([iter(loader) for loader, _ in second], [lg for _, lg in second]))
            gathered, trained = [], []
            for rows, places in before + rest:
                assert len({(p.total, p.world, p.base) for p in places}) == 1  # the step's place, told to every rank
                place = places[0]
                counts = [len(r) for r in rows]
                gathered += [rows[r][i] for r, i in kept_rows(place, counts)]
            for rows, places in rest:
                weights = [p.weight for p in places]
                assert sum(weights) == pytest.approx(len(rows))  # the ranks' average is the step's mean
                samples = sum(len(r) for r, w in zip(rows, weights) if w > 0)
                for r, w in zip(rows, weights):
                    assert w == pytest.approx(len(r) * len(rows) / samples if w else 0.0)
                trained += [i for r, w in zip(rows, weights) if w > 0 for i in r]
            case = (total, batch, world, after, stop)
            assert gathered == order, case  # each sample once, in one process's order
            assert sorted(set(trained)) == sorted(order[covered:]), case  # the rest: what the first part did not use
            samples = [sum(len(r) for r, p in zip(rows, places) if p.weight) for rows, places in rest]
            assert samples[:-1] == [batch * world] * (len(samples) - 1), case  # each step the global batch


def test_the_plan_of_a_rest_keeps_the_global_batch() -> None:
    """7 samples left, a global batch of 6, 4 ranks: steps of 6 and 1; shares 2,2,1,1, then 1,0,0,0 (copies: 0)."""
    plans = [rest_plan(7, 6, 4, rank, False) for rank in range(4)]
    assert [[len(p[0]) for p in plan] for plan in plans] == [[2, 1], [2, 1], [1, 1], [1, 1]]
    assert [[p[2] for p in plan] for plan in plans] == [[4 * 2 / 6, 4.0], [4 * 2 / 6, 0.0], [4 / 6, 0.0],
                                                        [4 / 6, 0.0]]
    assert [p[0] for p in rest_plan(7, 6, 3, 1, False)] == [[1, 4], [7]]  # 3 divides 6: padded as the sampler does
    assert rest_plan(7, 6, 3, 1, True) == [([1, 4], 0, 1.0, 6)]  # drop_last: the short step is dropped


def _setup(dist: object) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer = dist.setup(model, optimizer)
    return model, optimizer, scheduler


def _step(dist: object, model: torch.nn.Module, optimizer: object) -> None:
    dist.backward(model(torch.ones(3, 4)).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def test_a_commit_is_put_back_whole_and_stays_as_it_was() -> None:
    """`elastic.take`/`put` on one process: the weights, the momentum, the group's learning rate, a scheduler's state,
    a tensor, plain values and the loader's position come back as committed — twice from the same commit (what it
    holds are copies: training after the first put does not change it)."""
    from polytrain.torch import Distributed
    from polytrain.torch.elastic import put

    with Distributed("local") as dist:
        model, optimizer, scheduler = _setup(dist)
        loader = dist.setup_dataloaders(DataLoader(TensorDataset(torch.arange(10)), batch_size=2, shuffle=True))
        batches = iter(loader)
        next(batches)
        _step(dist, model, optimizer)
        scheduler.step()
        state = dist.elastic_state(step=1, seen=[1], total=torch.zeros(2), scheduler=scheduler)
        state.commit()
        kept = ({k: v.clone() for k, v in model.state_dict().items()},
                optimizer.state[model.weight]["momentum_buffer"].clone(), optimizer.param_groups[0]["lr"],
                scheduler.state_dict(), loader.position())
        assert kept[4] == (0, 2)
        for _ in range(2):
            for _ in range(2):
                next(batches)
                _step(dist, model, optimizer)
                scheduler.step()
            state.step += 2
            state.seen.append(5)
            state.total += 1
            put(dist._loop_state(), state.last, state.values())
            assert all(torch.equal(v, kept[0][k]) for k, v in model.state_dict().items())
            assert torch.equal(optimizer.state[model.weight]["momentum_buffer"], kept[1])
            assert optimizer.param_groups[0]["lr"] == kept[2] and scheduler.state_dict() == kept[3]
            assert (state.step, state.seen, state.total.tolist()) == (1, [1], [0.0, 0.0])
            assert loader.position() == (0, 2)
            batches = iter(loader)  # the pass goes on from the commit: the 8 samples after the first 2
            assert len(loader) == 4


def test_the_elastic_api_outside_the_driver_and_its_misuse() -> None:
    """Outside the elastic driver `elastic_run` calls the body once and an error propagates; a value named like the
    state's own parts, a body given something else than the state, and a backend that cannot recover in place
    under the driver (``membership`` set, as `elastic_group.form` sets it) are one line each."""
    from polytrain.torch import Distributed, OwnLoopError

    with Distributed("local") as dist:
        model, optimizer, _ = _setup(dist)
        with pytest.raises(OwnLoopError, match=r"^elastic_state: commit, model is the state's own"):
            dist.elastic_state(model=1, commit=2)
        state = dist.elastic_state(step=0)
        calls = []

        @dist.elastic_run
        def train(state: object, times: int) -> int:
            calls.append(times)
            _step(dist, state.model, state.optimizer)
            state.step += 1
            if times > 1:
                raise RuntimeError("Connection closed by peer")  # a lost peer's text: outside the driver it propagates
            return state.step

        assert train(state, 1) == 1 and state.last is not None and state.commits == 1
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            train(state, 2)
        assert calls == [1, 2]
        with pytest.raises(OwnLoopError, match=r"^elastic_run: the first argument must be the elastic_state"):
            train(3, 1)
        with pytest.raises(OwnLoopError, match=r"^elastic state: model cannot be set"):
            state.model = model
        dist.backend.membership = object()  # what an elastic worker's backend holds
        try:
            with pytest.raises(OwnLoopError, match=r"^backend: 'local' cannot recover in place under polytrain's "
                                                   r"elastic driver yet; use ddp or horovod"):
                dist.elastic_state(step=0)
        finally:
            dist.backend.membership = None
