"""The two seams the Trainer talks through: everything it calls or reads on a backend and a framework
adapter is declared here. The Trainer sees numpy arrays and floats only.

The registry creates both (`polytrain.registry.create_backend` / `create_framework`); the backend
gets the Trainer's timeline and activity when it is created, before ``setup``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from polytrain.data.source import DatasetInfo
    from polytrain.observe.timeline import Timeline
    from polytrain.observe.watchdog import Activity, PeerBoard
    from polytrain.spec.tables import TrainSpec
    from polytrain.world import World


@dataclass(frozen=True)
class UserCode:
    """Live objects given to `polytrain.fit` that take the place of what the spec names: a framework model
    (``torch.nn.Module`` / ``keras.Model``, or a function with no arguments building one), a loss and metrics, each a callable ``(outputs, targets)`` →
    one value per sample. The spec then names them ``fit:<name>`` (in logs and checkpoints)."""

    model: Any = None
    loss: Callable[[Any, Any], Any] | None = None
    metrics: Mapping[str, Callable[[Any, Any], Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class DataShard:
    """Which part of the data a rank reads. Data-parallel backends: one shard per rank. Model-parallel
    layouts (`polytrain.spec.layout`): the ranks of one tensor/pipeline group read the same shard, and only one
    of them (``reports``) adds its loss and metric sums to the job's totals."""

    count: int  # the number of different shards (the data-parallel degree)
    index: int  # this rank's
    reports: bool = True


def ready(values: np.ndarray) -> Callable[[], np.ndarray]:
    """What `Backend.start_all_reduce` returns where the values were reduced at once."""
    return lambda: values


class Backend(Protocol):
    """A distribution strategy. Framework-specific backends add their own hooks
    (e.g. a torch backend wraps modules); these are what the Trainer itself calls."""

    #: the registry name (``ddp``, ``mpi``, ...), written into checkpoints
    name: str
    #: where the backend records its collectives (`polytrain.observe.timeline.NULL` when off); set at creation
    timeline: Timeline
    #: what the Trainer is doing now, for the stall watchdog (None outside a Trainer); set at creation
    activity: Activity | None
    #: which part of the data this rank reads: one shard per rank (the base classes' default), or a model-parallel
    #: layout's data dimension; set at creation
    data_shard: DataShard

    @property
    def label(self) -> str:
        """The name as the start-up line shows it (e.g. which Horovod implementation runs)."""
        ...

    @property
    def listen_address(self) -> str | None:
        """Where this job's rendezvous listens, for the start-up line; None when nothing listens."""
        ...

    def setup(self) -> None:
        """Join the job: start the process group (or the library's world) where there is more than one rank."""
        ...

    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        """``values`` reduced over every rank (``op``: sum, max, min), the same result on each."""
        ...

    def start_all_reduce(self, values: np.ndarray, op: str = "sum") -> Callable[[], np.ndarray]:
        """`all_reduce`, started now and finished by calling what it returns (which gives the reduced values),
        so the collective runs while the caller works on; a backend that cannot overlap it reduces at once.
        Every rank starts it at the same point among its other collectives."""
        ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (picklable, from within the job) on every rank."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called it."""
        ...

    def progress_board(self) -> PeerBoard | None:
        """The stall watchdog's side channel shared by the ranks (None: warn without naming ranks).
        May raise RuntimeError/OSError when the channel cannot be reached."""
        ...

    def teardown(self) -> None:
        """Leave the job: end what `setup` started (process groups, stores, the library's world)."""
        ...


class Framework(Protocol):
    """Builds the model and runs steps on it, through a backend."""

    def build(self, info: DatasetInfo) -> None: ...

    def train_micro_step(self, x: np.ndarray, y: np.ndarray, loss_scale: float, sync: bool) -> float:
        """Forward + backward of one micro-batch; returns the summed (unscaled) loss of its samples.

        The backward pass uses ``loss_sum * loss_scale``; gradients are synchronised
        across ranks only when ``sync`` is true (the last micro-step of a step).
        """
        ...

    def optimizer_step(self, lr: float, clip_norm: float | None) -> float | None:
        """Apply accumulated gradients with learning rate ``lr``; returns the gradient norm if clipped."""
        ...

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, float]]:
        """(sum, count) over the given samples of the loss (key ``loss``) and of every metric the spec names
        that is computed per sample (`polytrain.spec.objectives.computed`), by metric name."""
        ...

    def export_state(self, into: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The full model as portable name → array, arrays of its own (collective: every rank calls it). ``into``:
        an earlier export's arrays the caller gives up, which may be filled instead of new ones where name, shape
        and dtype match (a background checkpoint save reuses its memory so)."""
        ...

    def load_state(self, state: Mapping[str, np.ndarray]) -> None: ...

    def export_optimizer_state(self, into: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Optimizer state as ``<parameter name>/<slot>`` → array, portable (collective); ``into`` as in
        `export_state`."""
        ...

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None: ...

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of every parameter by portable name (for the cross-rank start-up check)."""
        ...

    def grads_finite(self) -> bool:
        """No NaN/Inf in the synchronised gradients; the same answer on every rank."""
        ...

    def discard_gradients(self) -> None:
        """Drop the accumulated gradients without an update (a skipped step)."""
        ...

    def loss_scaler_state(self) -> dict[str, float] | None:
        """fp16's dynamic loss scaler state for checkpoints; None without one."""
        ...

    def load_loss_scaler_state(self, state: Mapping[str, float]) -> None: ...

    def step_stats(self) -> dict[str, float]:
        """Extra numbers for the step log (e.g. fp16 loss scale and skipped updates); may be empty."""
        ...

    def rng_state(self) -> Any:
        """This rank's framework RNG state, plain JSON data (stored per rank in checkpoints' ``rng_states``)."""
        ...

    def set_rng_state(self, state: Any) -> None: ...

    def release(self, state: Mapping[str, np.ndarray] | None = None) -> Any:
        """Let go of everything bound to the job (wrapped model, optimizer); return the trained model as a plain
        object that outlives the job, filled from ``state`` (`export_state`) where needed, or None. Called when
        `fit` ends, before the backend's teardown; a second call returns None."""
        ...


class BackendFactory(Protocol):
    """Makes the backend of a run (`polytrain.registry.create_backend`, or a test's fake)."""

    def __call__(self, spec: TrainSpec, world: World, *, timeline: Timeline | None = None,
                 activity: Activity | None = None) -> Backend: ...


FrameworkFactory = Callable[["TrainSpec", "World", Backend], Framework]
