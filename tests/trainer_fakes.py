"""In-process stand-ins for a `polytrain.protocols.Backend` and `Framework`, to drive the Trainer in unit tests.

`FakeBackend` is a single process that can pretend to have peers: with ``World(rank=0, size=2)`` its
``all_reduce`` returns ``size ×`` the input (every simulated peer holds the same numbers) and its
``all_gather_object`` repeats this rank's object unless a test passes ``gather`` to say what the others
send. That simulates the Trainer's *view* of a job; it tests no collective.

`FakeFramework` is a real model on numpy: softmax regression (classification) or linear regression,
trained by SGD with momentum on exact gradients, so the loss decreases and the exported state is real
arrays. It records every call the Trainer makes, and can be told to produce a NaN gradient at chosen
optimizer steps (numbered from 1 as the Trainer names them; read from the `Activity` the Trainer
gives the backend).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polytrain.data.source import DatasetInfo
from polytrain.observe.timeline import NULL, Timeline
from polytrain.observe.watchdog import Activity, PeerBoard
from polytrain.protocols import DataShard
from polytrain.spec.tables import TrainSpec
from polytrain.world import World

WEIGHT, BIAS = "linear.weight", "linear.bias"


class FakeBackend:
    """A backend of one process; ``size > 1`` worlds see identical simulated peers."""

    name = "fake"

    def __init__(self, spec: TrainSpec, world: World, *, timeline: Timeline | None = None,
                 activity: Activity | None = None, gather: Callable[[Any], list[Any]] | None = None,
                 fail_reduce_at: int | None = None, failure: BaseException | None = None,
                 board: PeerBoard | None = None, listen: str | None = None,
                 data_shard: DataShard | None = None) -> None:
        self.spec, self.world = spec, world
        self.data_shard = data_shard if data_shard is not None else DataShard(world.size, world.rank)
        self.timeline = timeline if timeline is not None else NULL
        self.activity = activity
        self._gather = gather
        self._fail_reduce_at, self._failure = fail_reduce_at, failure
        self._board, self._listen = board, listen
        self.setup_calls = self.teardown_calls = self.barrier_calls = 0
        self.reduced: list[np.ndarray] = []  # every all_reduce input, copied
        self.gathered: list[Any] = []  # every all_gather_object input
        self.broadcast: list[Any] = []

    @property
    def label(self) -> str:
        return "fake-label"

    @property
    def listen_address(self) -> str | None:
        return self._listen

    def setup(self) -> None:
        self.setup_calls += 1

    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        self.reduced.append(np.array(values, copy=True))
        if self._fail_reduce_at is not None and len(self.reduced) == self._fail_reduce_at:
            raise self._failure or RuntimeError("[gloo] Connection reset by peer")
        out = np.array(values, dtype=np.asarray(values).dtype, copy=True)
        return out * self.world.size if op == "sum" else out

    def start_all_reduce(self, values: np.ndarray, op: str = "sum") -> Callable[[], np.ndarray]:
        """Reduced when finished, as an asynchronous collective's failure shows when it is waited for."""
        given = np.array(values, copy=True)
        return lambda: self.all_reduce(given, op)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self.broadcast.append(obj)
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.gathered.append(obj)
        return self._gather(obj) if self._gather is not None else [obj] * self.world.size

    def barrier(self) -> None:
        self.barrier_calls += 1

    def progress_board(self) -> PeerBoard | None:
        return self._board

    def teardown(self) -> None:
        self.teardown_calls += 1


class FrozenPeerBoard:
    """A `PeerBoard` on which this rank's heartbeat moves and every other rank's stopped in ``last_seen``."""

    def __init__(self, last_seen: str) -> None:
        self.last_seen = last_seen
        self.posted: dict[int, tuple[int, str, int]] = {}

    def publish(self, rank: int, seq: int, text: str, beat: int = 0) -> None:
        self.posted[rank] = (seq, text, beat)

    def read(self, ranks: range) -> dict[int, tuple[int, str]]:
        return {r: (self.posted[r][:2] if r in self.posted else (1, self.last_seen)) for r in ranks}

    def beats(self, ranks: range) -> dict[int, int]:
        return {r: (self.posted[r][2] if r in self.posted else 7) for r in ranks}


@dataclass
class MicroCall:
    """One ``train_micro_step``: the optimizer step it belongs to (1-based), its samples and arguments."""

    step: int
    x: np.ndarray
    loss_sum: float
    loss_scale: float
    sync: bool

    @property
    def count(self) -> int:
        return len(self.x)


@dataclass
class Calls:
    micro: list[MicroCall] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)  # one per optimizer_step, in order
    lr_steps: list[int] = field(default_factory=list)  # the step number of each optimizer_step
    clip_norms: list[float | None] = field(default_factory=list)
    evaluated: list[int] = field(default_factory=list)  # the batch size of every evaluate call
    discarded: int = 0
    grads_finite: int = 0
    exported: int = 0
    loaded: int = 0
    optimizer_loaded: int = 0
    rng_set: list[list[int]] = field(default_factory=list)


class FakeFramework:
    """Softmax (or linear) regression on numpy with SGD + momentum, recording every call."""

    def __init__(self, spec: TrainSpec, world: World, backend: Any, *, nonfinite_steps: Collection[int] = (),
                 noise: float = 0.0, stats: Mapping[str, float] | None = None,
                 build_error: BaseException | None = None) -> None:
        self.spec, self.world, self.backend = spec, world, backend
        self.nonfinite_steps = set(nonfinite_steps)
        self.noise = noise  # gradient noise from a counter-based RNG: resuming needs set_rng_state
        self.stats = dict(stats or {})
        self.build_error = build_error
        self.calls = Calls()
        self.built = False
        self.syncs = 0  # sync micro-steps seen = optimizer steps begun
        self.rng = [spec.seed, 0]  # (seed, draws): the whole RNG state
        self.params: dict[str, np.ndarray] = {}
        self.momentum: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ model
    def build(self, info: DatasetInfo) -> None:
        if self.build_error is not None:
            raise self.build_error
        self.task = info.task
        features = int(np.prod(info.input_shape))
        init = np.random.default_rng(self.spec.seed)
        self.params = {WEIGHT: (0.01 * init.standard_normal((info.num_outputs, features))).astype(np.float32),
                       BIAS: np.zeros(info.num_outputs, dtype=np.float32)}
        self.momentum = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.grads = {k: np.zeros_like(v) for k, v in self.params.items()}
        self.built = True

    def _forward(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-sample losses, d(loss sum)/d(outputs), and the predictions."""
        out = x.reshape(len(x), -1) @ self.params[WEIGHT].T + self.params[BIAS]
        if self.task == "regression":
            err = out[:, 0] - y
            return 0.5 * err**2, err[:, None].astype(np.float32), out[:, 0]
        shifted = out - out.max(axis=1, keepdims=True)
        prob = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
        losses = -np.log(prob[np.arange(len(y)), y] + 1e-12)
        dout = prob.copy()
        dout[np.arange(len(y)), y] -= 1.0
        return losses, dout.astype(np.float32), out.argmax(axis=1)

    def _step(self) -> int:
        """The Trainer's 1-based number of the step in progress (from the activity it reports)."""
        activity = getattr(self.backend, "activity", None)
        return activity.step if activity is not None and activity.step is not None else self.syncs + 1

    def train_micro_step(self, x: np.ndarray, y: np.ndarray, loss_scale: float, sync: bool) -> float:
        step = self._step()
        losses, dout, _ = self._forward(x, y)
        dout = dout * np.float32(loss_scale)
        self.grads[WEIGHT] += dout.T @ x.reshape(len(x), -1)
        self.grads[BIAS] += dout.sum(axis=0)
        if self.noise:
            draw = np.random.default_rng(self.rng).standard_normal(self.grads[WEIGHT].shape)
            self.grads[WEIGHT] += (self.noise * draw).astype(np.float32)
            self.rng = [self.rng[0], self.rng[1] + 1]
        if sync:
            self.syncs += 1
            flat = np.concatenate([g.ravel() for g in self.grads.values()])
            flat = self.backend.all_reduce(flat) / np.float32(self.world.size)  # the average over ranks
            offset = 0
            for g in self.grads.values():
                g[...] = flat[offset:offset + g.size].reshape(g.shape)
                offset += g.size
            if step in self.nonfinite_steps:
                self.grads[WEIGHT][0, 0] = np.nan
        loss_sum = float(losses.sum())
        self.calls.micro.append(MicroCall(step, np.array(x, copy=True), loss_sum, loss_scale, sync))
        return loss_sum

    def optimizer_step(self, lr: float, clip_norm: float | None) -> float | None:
        self.calls.lrs.append(lr)
        self.calls.lr_steps.append(self._step())
        self.calls.clip_norms.append(clip_norm)
        norm = float(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in self.grads.values())))
        factor = min(1.0, clip_norm / (norm + 1e-6)) if clip_norm is not None else 1.0
        beta = np.float32(self.spec.optimizer.momentum)
        for name, p in self.params.items():
            self.momentum[name] = beta * self.momentum[name] + self.grads[name] * np.float32(factor)
            p -= np.float32(lr) * self.momentum[name]
            self.grads[name][...] = 0
        return norm if clip_norm is not None else None

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, float]]:
        self.calls.evaluated.append(len(x))
        if len(x) == 0:
            return {"loss": (0.0, 0.0)} if self.task == "regression" else {"loss": (0.0, 0.0), "accuracy": (0.0, 0.0)}
        losses, _, pred = self._forward(x, y)
        if self.task == "regression":
            return {"loss": (float(losses.sum()), float(len(x)))}
        return {"loss": (float(losses.sum()), float(len(x))), "accuracy": (float((pred == y).sum()), float(len(x)))}

    # ------------------------------------------------------------------ state
    def export_state(self, into: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        self.calls.exported += 1
        return {k: v.copy() for k, v in self.params.items()}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.calls.loaded += 1
        self.params = {k: np.array(state[k], dtype=np.float32) for k in self.params}

    def export_optimizer_state(self, into: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        return {f"{k}/momentum_buffer": v.copy() for k, v in self.momentum.items()}

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.calls.optimizer_loaded += 1
        self.momentum = {k: np.array(state[f"{k}/momentum_buffer"], dtype=np.float32) for k in self.params}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.params.items()}

    def grads_finite(self) -> bool:
        self.calls.grads_finite += 1
        return all(bool(np.isfinite(g).all()) for g in self.grads.values())

    def discard_gradients(self) -> None:
        self.calls.discarded += 1
        for g in self.grads.values():
            g[...] = 0

    def loss_scaler_state(self) -> dict[str, float] | None:
        return None

    def load_loss_scaler_state(self, state: Mapping[str, float]) -> None:
        raise AssertionError("no loss scaler state was saved, so none may be loaded")

    def step_stats(self) -> dict[str, float]:
        return dict(self.stats)

    def rng_state(self) -> list[int]:
        return list(self.rng)

    def set_rng_state(self, state: list[int]) -> None:
        self.calls.rng_set.append(list(state))
        self.rng = list(state)

    def release(self, state: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray] | None:
        """The trained weights, once (a fake holds nothing bound to a job); records when the backend was
        already torn down at that moment (it must not be)."""
        self.released_after_teardown = self.backend.teardown_calls > 0
        model, self.released = (None if getattr(self, "released", False) or not self.built
                                else {k: v.copy() for k, v in self.params.items()}), True
        return model


class FakeJob:
    """Factories for `polytrain.train.trainer.Trainer` that keep the fakes they made (``backend``, ``framework``)."""

    def __init__(self, backend_options: Mapping[str, Any] | None = None,
                 framework_options: Mapping[str, Any] | None = None) -> None:
        self.backend_options = dict(backend_options or {})
        self.framework_options = dict(framework_options or {})
        self.backend: FakeBackend | None = None
        self.framework: FakeFramework | None = None

    def backend_factory(self, spec: TrainSpec, world: World, *, timeline: Timeline | None = None,
                        activity: Activity | None = None) -> FakeBackend:
        self.backend = FakeBackend(spec, world, timeline=timeline, activity=activity, **self.backend_options)
        return self.backend

    def framework_factory(self, spec: TrainSpec, world: World, backend: Any) -> FakeFramework:
        assert backend is self.backend, "the framework must be built on the backend the Trainer made"
        self.framework = FakeFramework(spec, world, backend, **self.framework_options)
        return self.framework

    @property
    def fw(self) -> FakeFramework:
        assert self.framework is not None
        return self.framework

    @property
    def be(self) -> FakeBackend:
        assert self.backend is not None
        return self.backend
