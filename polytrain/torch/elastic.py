"""Training in place for a hand-written PyTorch loop (issue 51, item 4): `Distributed.elastic_state` and
`Distributed.elastic_run`, shaped after ``hvd.elastic``'s ``TorchState`` and ``run``.

A script under polytrain's elastic driver (``polytrain launch --launcher local|horovodrun --elastic``) keeps a
state over the model and optimizer `setup` returned and its own values (``epoch``, ``step``, a scheduler, ...),
calls ``state.commit()`` after the steps it wants to keep, and runs its loop body through ``elastic_run``. When a
rank is lost, the survivors' collective fails; ``elastic_run`` drops the failed call's frames, re-forms the group
at the driver's next membership version in the same processes (`polytrain.adapters.torch.elastic_group`), wraps
the same module and optimizer again, puts the last commit back and calls the body again with the state. The
loaders `setup_dataloaders` made go on from the committed position at the new world size with the same global
batch (`polytrain.torch.loaders.EpochLoader`): every sample of the epoch is used once, and at most the steps since
the commit are trained again.

A commit is what a checkpoint would hold, in host memory, no file: the model's and the optimizer's portable state
(`full_state`, `full_optimizer_state`: new CPU tensors), the optimizer's group settings, the fp16 loss scaler, the
RNG state, each loader's position, the count of optimizer steps, and the state's values (tensors copied to the CPU,
objects with ``state_dict``/``load_state_dict`` by their state, anything else deep-copied). It is built whole before
it replaces the last one. Each rank's commit is the whole state: on ddp and horovod (polytrain's implementation)
each rank holds it; on fsdp a commit gathers it (a collective), and a re-form wraps a fresh module of the
same classes (`ElasticLoop._fresh_module`; the optimizer the body uses is then a new one of the same class and
settings: a scheduler the script made over the old one must be made again). Outside the elastic driver
``elastic_run`` calls the body once and a failure propagates.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from polytrain.adapters.torch.framework import rng_state, set_rng_state
from polytrain.loop.checkpoints import LoopState
from polytrain.torch.errors import OwnLoopError

#: the state's own attributes, which no value may be named
RESERVED = ("model", "optimizer", "commit", "values", "last", "commits")


@dataclasses.dataclass
class LoopCommit:
    """One rank's copy of a hand-written loop's state, as `ElasticState.commit` took it."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    groups: list[dict[str, Any]]
    scaler: dict[str, float] | None
    rng: Any
    loaders: list[tuple[int, int]]
    updates: int
    values: dict[str, tuple[str, Any]]


def take(loop: LoopState, updates: int, values: Mapping[str, Any]) -> LoopCommit:
    """The commit of ``loop`` (a `Distributed`'s set-up objects) after ``updates`` optimizer steps, with ``values``."""
    backend, model, optimizer = loop.backend, loop.model, loop.optimizer
    return LoopCommit(
        model=_host(backend.full_state(model)),
        optimizer=_host(backend.full_optimizer_state(model, optimizer)),
        groups=[copy.deepcopy({k: v for k, v in group.items() if k != "params"}) for group in optimizer.param_groups],
        scaler=None if loop.scaler is None else copy.deepcopy(dict(loop.scaler.state_dict())),
        rng=rng_state(backend.device),
        loaders=[loader.position() for loader in loop.loading.loaders],
        updates=updates,
        values={name: _keep(name, value) for name, value in values.items()})


def put(loop: LoopState, commit: LoopCommit, values: dict[str, Any]) -> None:
    """Put ``commit`` back into ``loop``'s objects and ``values`` (its copies stay as they were: the same commit can
    be put back again)."""
    backend, model, optimizer = loop.backend, loop.model, loop.optimizer
    backend.load_full_state(model, {k: v.clone() for k, v in commit.model.items()})
    backend.load_full_optimizer_state(model, optimizer, {k: v.clone() for k, v in commit.optimizer.items()})
    for group, saved in zip(optimizer.param_groups, commit.groups):
        group.update(copy.deepcopy(saved))
    if loop.scaler is not None and commit.scaler:
        loop.scaler.load_state_dict(copy.deepcopy(commit.scaler))
    set_rng_state(commit.rng, backend.device)
    for loader, (epoch, covered) in zip(loop.loading.loaders, commit.loaders):
        loader.go_on(epoch, covered)
    for name, (kind, kept) in commit.values.items():
        if kind == "object":
            values[name].load_state_dict(copy.deepcopy(kept))
        elif kind == "tensor":
            stored, device = kept
            values[name] = stored.clone().to(device)
        else:
            values[name] = copy.deepcopy(kept)


def _host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in tensors.items()}


def _keep(name: str, value: Any) -> tuple[str, Any]:
    if torch.is_tensor(value):
        return "tensor", (value.detach().to("cpu", copy=True), value.device)
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return "object", copy.deepcopy(value.state_dict())
    try:
        return "value", copy.deepcopy(value)
    except Exception as exc:
        raise OwnLoopError(f"commit: cannot copy the state's {name!r} ({type(value).__name__}: {exc}); keep "
                           "numbers, strings, tensors, containers of them, or objects with state_dict") from None


class ElasticState:
    """The state `Distributed.elastic_state` makes: ``state.model`` and ``state.optimizer`` (what `setup` returned;
    after a recovery the model is a new wrapper over the same module, so a loop body uses ``state.model``), and the
    values given, read and set as attributes. ``commit()`` keeps all of it (see the module); `elastic_run` puts the
    last commit back after a lost rank."""

    def __init__(self, values: Mapping[str, Any], *, commit: Callable[[dict[str, Any]], LoopCommit],
                 model: Callable[[], nn.Module], optimizer: Any) -> None:
        taken = sorted(set(values) & set(RESERVED))
        if taken:
            raise OwnLoopError(f"elastic_state: {', '.join(taken)} is the state's own; name the value otherwise")
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_take", commit)
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "last", None)  # the last commit (`LoopCommit`)
        object.__setattr__(self, "commits", 0)

    @property
    def model(self) -> nn.Module:
        return self._model()

    def commit(self) -> None:
        """Keep the state as it is now: after a lost rank, the loop goes on from here. Call it after an optimizer
        step (the batch the loop holds counts as used)."""
        object.__setattr__(self, "last", self._take(self._values))
        object.__setattr__(self, "commits", self.commits + 1)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"the elastic state has no value {name!r} (give it to elastic_state)")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in RESERVED:
            raise OwnLoopError(f"elastic state: {name} cannot be set")
        self._values[name] = value

    def values(self) -> dict[str, Any]:
        """The values, by name (the live dict: `elastic_run` puts a commit's back into it)."""
        return self._values


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc``, or what it was raised from, is a collective's failure because a peer is gone."""
    from polytrain.adapters.torch import reform

    seen: set[int] = set()
    for cause in _chain(exc):
        if id(cause) in seen:
            break
        seen.add(id(cause))
        if reform.is_peer_loss(cause):
            return True
    return False


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def run(body: Callable[..., Any], state: ElasticState, args: tuple[Any, ...], kwargs: dict[str, Any], *,
        elastic: bool, recover: Callable[[str], None]) -> Any:
    """``body(state, ...)``; under the elastic driver, after a lost peer ``recover`` (re-form, put the last commit
    back) and ``body`` again, until it returns."""
    if state.last is None:
        state.commit()
    while True:
        try:
            return body(state, *args, **kwargs)
        except Exception as exc:
            if not elastic or not peer_lost(exc):
                raise
            text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        # here the exception, its traceback and the frames they hold (losses, Work handles) are gone
        recover(text)


def _stale_forward(*args: Any, **kwargs: Any) -> Any:
    raise OwnLoopError("model: this is the model of a process group an elastic recovery replaced; inside "
                       "elastic_run use state.model")


class ElasticLoop:
    """`Distributed`'s training in place: `elastic_state`, `elastic_run` and the recovery (a part of the class,
    kept here with the commits it works on)."""

    def elastic_state(self: Any, **values: Any) -> ElasticState:
        """A state over the model and optimizer `setup` returned and ``values`` (``epoch=0, step=0``, a scheduler,
        ...): ``state.commit()`` keeps it in host memory; `elastic_run` goes on from the last commit after a lost
        rank. Under polytrain's elastic driver the backend must be one that recovers in place (ddp, fsdp,
        horovod)."""
        self._needs_setup("elastic_state")
        if self._elastic and self.backend.in_place_refusal:  # sharded layouts, real Horovod (the contract says)
            raise OwnLoopError(self.backend.in_place_refusal)
        return ElasticState(values, commit=lambda kept: take(self._loop_state(), self._updates, kept),
                            model=lambda: self._model, optimizer=self._returned)

    def elastic_run(self: Any, body: Callable[..., Any]) -> Callable[..., Any]:
        """``body(state, ...)`` made to go on in place (a decorator, as ``hvd.elastic.run``): when a rank is lost it
        is called again with ``state`` at its last commit, on the group re-formed at the new world size."""

        @functools.wraps(body)
        def wrapped(state: ElasticState, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(state, ElasticState):
                raise OwnLoopError(f"elastic_run: the first argument must be the elastic_state, got "
                                   f"{type(state).__name__}")
            return run(body, state, args, kwargs, elastic=self._elastic,
                       recover=lambda cause: self._recover(state, cause))
        return wrapped

    @property
    def _elastic(self: Any) -> bool:
        """Whether this rank's group is an elastic driver's (re-formed in place after a lost rank)."""
        return getattr(self.backend, "membership", None) is not None

    def _fresh_module(self: Any, old: nn.Module, optimizer: torch.optim.Optimizer
                      ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A new module of ``old``'s classes (from the outline `setup` kept, its tensors uninitialised: the commit
        fills them) and the same optimizer's class and settings over it, for a backend that bound the module to
        the old group (``binds_module_to_group``)."""
        from polytrain.adapters.torch.backend import rebuilt_optimizer

        module = copy.deepcopy(self._outline).to_empty(device=self.device)
        names = {id(p): n for n, p in old.named_parameters()}
        return module, rebuilt_optimizer(optimizer, names, module)

    def _recover(self: Any, state: ElasticState, cause: str) -> None:
        """Re-form the group at the driver's next version, wrap the module and optimizer again (fresh ones where
        the backend remade them), re-shard the loaders, put the last commit back."""
        from polytrain.adapters.torch import elastic_group

        before, old, optimizer = self.world.size, self._model, self._optimizer
        held = SimpleNamespace(model=old, optimizer=optimizer, world=self.world,
                               fresh_module=lambda: self._fresh_module(old, optimizer))
        self._model = self._optimizer = self._returned.optimizer = None
        self._watch.activity.set("re-forming the group after a lost peer")
        version = elastic_group.regroup(held, self.backend).version
        if held.model is not old:  # a new wrapper or module: the script's old one must not run on a group gone
            old.forward = _stale_forward
            if self._precision.dtype is not None:
                held.model.forward = self._precision.forward(held.model.forward)
        if self._precision.scaler is not None and self.backend.binds_module_to_group:  # its scaler holds the group
            self._precision.scaler = self.backend.grad_scaler()
        self._model, self._optimizer = held.model, held.optimizer
        self._returned.optimizer = held.optimizer
        self.world = self.backend.world
        self._watch.rank, self._watch.size = self.world.rank, self.world.size
        for loader in self._loading.loaders:
            loader.reshard(self.backend.data_shard)
        self._micro, self._sync = 0, True
        put(self._loop_state(), state.last, state.values())
        self._updates = state.last.updates
        self.print(f"polytrain: elastic: a peer was lost ({cause}); re-formed from {before} to {self.world.size} "
                   f"ranks (membership version {version}), going on from the commit after step {self._updates}",
                   file=sys.stderr)
