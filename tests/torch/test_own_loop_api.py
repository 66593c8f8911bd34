"""`polytrain.torch.Distributed` in one process: accumulation equals one large batch, the returned optimizer
steps once per window, and misuse is one clear error (multi-process parity: tests/multiproc/test_own_loop.py)."""

from __future__ import annotations

import pytest

from polytrain.errors import UserError

torch = pytest.importorskip("torch")
from polytrain.torch import Distributed, OwnLoopError  # noqa: E402


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def trained(accum: int, steps: int = 3) -> dict[str, torch.Tensor]:
    """``steps`` updates on the same 16 samples, cut into ``accum`` micro-batches."""
    x, y = batch()
    with Distributed("local", grad_accum_steps=accum) as dist:
        model = net()
        model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        for _ in range(steps):
            for part in range(accum):
                rows = slice(part * 16 // accum, (part + 1) * 16 // accum)
                with dist.accumulate(model):
                    dist.backward(torch.nn.functional.cross_entropy(model(x[rows]), y[rows]))
                optimizer.step()
                optimizer.zero_grad()
        return {k: v.clone() for k, v in dist.get_state_dict(model).items()}


def test_accumulation_over_micro_batches_equals_one_large_batch() -> None:
    whole, in_four = trained(1), trained(4)
    for name, value in whole.items():
        torch.testing.assert_close(in_four[name], value, rtol=1e-5, atol=1e-6)
    assert not torch.equal(whole["0.weight"], net().state_dict()["0.weight"])  # it trained


def test_the_optimizer_steps_once_per_window() -> None:
    x, y = batch()
    with Distributed("local", grad_accum_steps=2) as dist:
        model = net()
        model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
        before = model[0].weight.detach().clone()
        with dist.accumulate(model):
            dist.backward(torch.nn.functional.cross_entropy(model(x), y))
        assert not dist.sync_gradients and dist.clip_grad_norm_(model, 1.0) is None
        optimizer.step()
        optimizer.zero_grad()
        assert torch.equal(model[0].weight, before) and model[0].weight.grad is not None  # kept for the window
        with dist.accumulate(model):
            dist.backward(torch.nn.functional.cross_entropy(model(x), y))
        assert dist.sync_gradients and dist.clip_grad_norm_(model, 1e6) > 0
        optimizer.step()
        assert not torch.equal(model[0].weight, before)


def test_misuse_is_one_line() -> None:
    model = net()
    with Distributed("local") as dist:
        with pytest.raises(OwnLoopError, match=r"^backward: called before setup\(model, optimizer\)$"):
            dist.backward(torch.zeros((), requires_grad=True))
        with pytest.raises(OwnLoopError, match=r"^setup: the optimizer was not built from this model's parameters"):
            dist.setup(model, torch.optim.SGD(net().parameters(), lr=0.1))
        dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(OwnLoopError, match=r"^setup: called twice"):
            dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(OwnLoopError, match=r"^all_reduce: op 'avg' is not one of sum, mean, max, min$"):
            dist.all_reduce(torch.ones(2), "avg")
    with pytest.raises(OwnLoopError, match=r"^setup: this Distributed has ended$"):
        dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UserError, match=r"^backend: 'tf-multiworker' is not available for framework 'torch'"):
        Distributed("tf-multiworker")  # a backend the framework lacks
    for asked in ({"parallel": {"pipeline": 2}}, {"spec": {"parallel": {"pipeline": 2, "tensor": 2}}}):
        with pytest.raises(OwnLoopError, match=r"^parallel.pipeline: pipeline parallel needs a schedule .* stays with "
                                               r"the Trainer; use polytrain.fit or a spec"):
            Distributed("ddp", **asked)
    with pytest.raises(UserError, match=r"^parallel.tensor: combines with backend ddp or fsdp .*, not 'horovod'$"):
        Distributed("horovod", parallel={"tensor": 2})
    with pytest.raises(UserError, match=r"^parallel: tensor 2 × pipeline 1 = 2 does not divide the world size 1"):
        Distributed("ddp", parallel={"tensor": 2})
    with pytest.raises(UserError, match=r"^precision: "):
        Distributed("local", precision="fp8")


def test_tensor_parallel_fields_become_the_specs() -> None:
    """``parallel=`` merges into the spec's table; a plan given as a function is kept aside and the spec names
    it ``fit:<name>``, as the model (the one setup will get); an import path stays a spec field."""
    from polytrain import validation
    from polytrain.torch.layouts import loop_fields

    def my_plan(model: torch.nn.Module, mesh: object) -> dict:
        return {}

    raw, live = loop_fields({"backend": "fsdp", "parallel": {"data": "auto"}}, {"tensor": 2, "tensor_plan": my_plan})
    assert live is my_plan
    assert raw["parallel"] == {"data": "auto", "tensor": 2, "tensor_plan": "fit:my_plan"}
    assert raw["model"] == {"name": "fit:setup"}
    assert validation.from_dict(raw).parallel.tensor_plan == "fit:my_plan"  # the zoo-model checks do not apply
    raw, live = loop_fields({"parallel": {"tensor": 2, "tensor_plan": "pkg.mod:plan"}, "model": {"name": "mlp"}}, None)
    assert live is None and raw["parallel"]["tensor_plan"] == "pkg.mod:plan" and raw["model"] == {"name": "mlp"}
    assert loop_fields({"backend": "ddp"}, None) == ({"backend": "ddp"}, None)  # nothing asked, nothing added


def test_setup_dataloaders_reads_each_sample_once_per_epoch_in_a_new_order_each_epoch() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(10))
    with Distributed("local", seed=3) as dist:
        loader = dist.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
        epochs = [[int(i) for (batch,) in loader for i in batch] for _ in range(3)]
    assert [sorted(e) for e in epochs] == [list(range(10))] * 3
    assert len({tuple(e) for e in epochs}) == 3  # set_epoch moved on at each pass
    with Distributed("local", seed=3) as again:
        assert [int(i) for (batch,) in again.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
                for i in batch] == epochs[0]  # the job's seed decides the order


def test_the_shards_of_two_ranks_split_the_set() -> None:
    """The sampler's shard is the backend's ``data_shard`` (two ranks' loaders in one process)."""
    from torch.utils.data import DataLoader, TensorDataset

    from polytrain.protocols import DataShard
    from polytrain.torch.loaders import Loading, sharded

    data = TensorDataset(torch.arange(10))
    seen = []
    for rank in (0, 1):
        loader = sharded(DataLoader(data, batch_size=2, shuffle=True), DataShard(2, rank), 0, Loading())
        seen.append([int(i) for (batch,) in loader for i in batch])
    assert len(seen[0]) == len(seen[1]) == 5 and sorted(seen[0] + seen[1]) == list(range(10))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_gathered_batches_hold_each_sample_once_in_the_loaders_order(shuffle: bool, drop_last: bool) -> None:
    """Property over set sizes 1-13, batch sizes 1-4 and world sizes 1-4: the rows `gather_for_metrics` keeps
    from the ranks' sharded batches (`kept_rows`, on each rank's real `DistributedSampler` shard) are every
    sample exactly once, in one process's order (its permutation when shuffled); with drop_last, the samples
    the sampler drops are the only ones missing. The copies that even out the shares are what is dropped."""
    from torch.utils.data import DataLoader, TensorDataset

    from polytrain.protocols import DataShard
    from polytrain.torch.loaders import Loading, kept_rows, sharded

    for total in range(1, 14):
        data = TensorDataset(torch.arange(total))
        for batch_size in range(1, 5):
            for world in range(1, 5):
                loadings = [Loading() for _ in range(world)]
                loaders = [sharded(DataLoader(data, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last),
                                   DataShard(world, rank), 7, loadings[rank]) for rank in range(world)]
                gathered: list[int] = []
                for batches in zip(*loaders):  # the ranks' i-th batches, as a collective would see them
                    counts = [len(b[0]) for b in batches]
                    places = {loading.place for loading in loadings}
                    assert len(places) == 1
                    gathered += [int(batches[r][0][i]) for r, i in kept_rows(places.pop(), counts)]
                shards = [list(loader.sampler) for loader in loaders]
                padded = [shards[p % world][p // world] for p in range(sum(map(len, shards)))]
                expected = padded[:total] if not drop_last else padded
                if drop_last and batch_size > 1:  # DataLoader(drop_last) also drops each rank's short last batch
                    full = len(shards[0]) // batch_size * batch_size
                    expected = padded[:full * world]
                assert gathered == expected, (total, batch_size, world)
                if not drop_last:
                    assert sorted(gathered) == list(range(total))  # each sample exactly once
def test_with_accumulation_backward_must_run_inside_accumulate() -> None:
    """Outside `accumulate` the loss would be divided by the window yet the optimizer would step every time."""
    x, y = batch()
    with Distributed("local", grad_accum_steps=2) as dist:
        model = net()
        model, _ = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(OwnLoopError, match=r"^backward: grad_accum_steps is 2; run each micro-step inside "):
            dist.backward(torch.nn.functional.cross_entropy(model(x), y))
        with dist.accumulate(model):
            dist.backward(torch.nn.functional.cross_entropy(model(x), y))  # inside: taken


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_precision_runs_the_forward_under_autocast_and_returns_fp32(precision: str) -> None:
    """bf16: the set-up model's layers compute in bf16 (as Fabric's and Accelerate's do), its output comes back
    as fp32; ``dist.autocast()`` gives the same context for work outside the model; fp32 changes nothing."""
    x, _ = batch()
    seen: list[torch.dtype] = []
    with Distributed("local", precision=precision) as dist:
        model = net()
        model[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
        plain = model(x)
        model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        out = model(x)
        with dist.autocast():
            inside = torch.nn.functional.linear(x, torch.ones(2, 6))
    low = precision == "bf16"
    assert seen == [torch.float32, torch.bfloat16 if low else torch.float32]
    assert out.dtype == torch.float32 and inside.dtype == (torch.bfloat16 if low else torch.float32)
    assert torch.equal(out, plain) != low  # bf16 rounding changed the numbers; fp32 is the same computation


def test_save_and_load_carry_every_kind_of_state(tmp_path) -> None:
    """One process: the model, the optimizer (momentum, and the lr a scheduler set), the scheduler, a tensor and
    plain values go into a checkpoint and come back into new objects; loaders go on at the saved epoch."""
    from torch.utils.data import DataLoader, TensorDataset

    x, y = batch()
    with Distributed("local") as dist:
        model = net()
        model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5)
        for _ in range(2):
            dist.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        saved = dist.save(tmp_path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2,
                                     "epoch": 3, "ema": torch.arange(4.0), "note": {"best": 0.25, "tags": ["a"]}})
        weights = {k: v.clone() for k, v in dist.get_state_dict(model).items()}
        momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    assert saved == tmp_path / "step-00000002" and (tmp_path / "latest").read_text().strip() == "step-00000002"
    with Distributed("local") as dist:
        fresh = net()
        fresh, opt = dist.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9))
        sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
        ema = torch.zeros(4)
        loader = dist.setup_dataloaders(DataLoader(TensorDataset(torch.arange(10)), batch_size=5, shuffle=True))
        values = dist.load(tmp_path, {"model": fresh, "optimizer": opt, "scheduler": sched, "ema": ema})
        assert values == {"note": {"best": 0.25, "tags": ["a"]}, "step": 2, "epoch": 3, "step_in_epoch": 0}
        for name, value in dist.get_state_dict(fresh).items():
            assert torch.equal(value, weights[name]), name
        assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(fresh.parameters(), momentum))
        assert opt.param_groups[0]["lr"] == 0.125 and sched.last_epoch == 2 and torch.equal(ema, torch.arange(4.0))
        assert loader.epoch == 3


def test_save_and_load_misuse_is_one_line(tmp_path) -> None:
    from polytrain.checkpoint.store import CheckpointError

    with Distributed("local") as dist:
        model = net()
        model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(OwnLoopError, match=r"^save: 'model' is not the model setup\(\) returned; pass that one$"):
            dist.save(tmp_path, {"model": net()})
        with pytest.raises(CheckpointError, match=r"^save: 'fn' is a function; a checkpoint holds the model, "):
            dist.save(tmp_path, {"model": model, "fn": lambda: 0})
        with pytest.raises(CheckpointError, match=r"^save: 'step' must be a whole number ≥ 0 \(the optimizer steps "):
            dist.save(tmp_path, {"model": model, "step": 1.5})
        with pytest.raises(CheckpointError, match=r"^load: .*missing is not a directory; give a checkpoint"):
            dist.load(tmp_path / "missing", {"model": model})
        with pytest.raises(CheckpointError, match=r"^load: no complete checkpoint in "):
            dist.load(tmp_path, {"model": model})
        dist.save(tmp_path, {"model": model, "optimizer": optimizer, "step": 1})
    with Distributed("local") as dist:
        other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        other, opt = dist.setup(other, torch.optim.SGD(other.parameters(), lr=0.1))
        with pytest.raises(CheckpointError, match=r"^load: .*step-00000001 holds 2.weight of shape \(3, 8\); the "
                                                  r"model's is \(4, 8\)$"):
            dist.load(tmp_path, {"model": other})


def test_preempted_agrees_every_n_steps_and_exit_preempted_ends_with_75(capsys: pytest.CaptureFixture) -> None:
    """One process: a signal is a flag until the next agreement call, which says True (and every call after);
    `exit_preempted` ends the object, prints rank 0's line and exits 75. Misuse is one line."""
    import signal

    before = signal.getsignal(signal.SIGUSR2)
    try:
        with Distributed("local") as plain:
            assert plain.preempted() is False  # no preemption table: never
        dist = Distributed("local", spec={"preemption": {"signals": ["SIGUSR2"]}})
        with pytest.raises(OwnLoopError, match="every_n_steps must be a whole number >= 1, got 0"):
            dist.preempted(1, every_n_steps=0)
        with pytest.raises(OwnLoopError, match="exit_preempted: preempted\\(\\) has not said True on this rank"):
            dist.exit_preempted()
        assert [dist.preempted(step, every_n_steps=3) for step in (1, 2, 3)] == [False] * 3
        signal.raise_signal(signal.SIGUSR2)
        assert [dist.preempted(step, every_n_steps=3) for step in (4, 5, 6)] == [False, False, True]
        with pytest.raises(SystemExit) as ended:
            dist.exit_preempted(6)
        assert ended.value.code == 75
        assert capsys.readouterr().err.splitlines()[-1] == (
            "polytrain: preempted by SIGUSR2: every rank stopped after step 6, its checkpoint written at step 6; "
            "load the loop's last save to go on (Distributed.load)")
        with pytest.raises(OwnLoopError, match="preempted: this Distributed has ended"):
            dist.preempted(7)
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_signal_during_the_set_up_counts_and_a_failed_set_up_puts_the_handlers_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    from polytrain import registry

    before = signal.getsignal(signal.SIGUSR2)
    spec = {"preemption": {"signals": ["SIGUSR2"]}}
    real = registry.create_backend

    def backend_whose_setup(action):  # noqa: ANN001, ANN202
        def create(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            backend = real(*args, **kwargs)
            setup = backend.setup
            backend.setup = lambda: (action(), setup())
            return backend
        return create

    try:
        monkeypatch.setattr(registry, "create_backend", backend_whose_setup(lambda: signal.raise_signal(signal.SIGUSR2)))
        dist = Distributed("local", spec=spec)  # the signal came during the rendezvous
        assert dist.preempted(1, every_n_steps=1) is True
        dist.end()  # stopped: the signal stays ignored until this process exits
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
        signal.signal(signal.SIGUSR2, before)

        def fails() -> None:
            raise RuntimeError("rendezvous failed")

        monkeypatch.setattr(registry, "create_backend", backend_whose_setup(fails))
        with pytest.raises(RuntimeError, match="rendezvous failed"):
            Distributed("local", spec=spec)
        assert signal.getsignal(signal.SIGUSR2) is before
    finally:
        signal.signal(signal.SIGUSR2, before)
