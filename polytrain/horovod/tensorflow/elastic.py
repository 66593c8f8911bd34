"""``hvd.elastic`` for TensorFlow 2 / Keras 3: ``run``, ``ObjectState``, ``TensorFlowKerasState``, ``TensorFlowState``.

Horovod's commit/restore/sync semantics (``horovod/common/elastic.py``,
``horovod/tensorflow/elastic.py``): ``state.commit()`` keeps a copy that a failed collective
(``HorovodInternalError``) rolls back to before ``run`` re-runs the function on a re-initialised
job; ``state.sync()`` gives every rank rank 0's values. Horovod 0.28.1's own versions call
``optimizer.variables()``, which Keras 3 turned into a property; these work with Keras 3.

What a state holds:

* a model's variables — all of them (``model.variables``) are copied on commit and restored; a
  sync broadcasts ``model.weights`` (trainable and non-trainable), while the random-number
  states of Keras 3's ``SeedGenerator``s (Dropout) stay per rank;
* the optimizer's variables, built first if Keras has not built them yet, and a
  ``DistributedOptimizer``'s gradient sums and pass count (``backward_passes_per_step``), so a
  rolled-back or synced job resumes aggregation at the same pass on every rank;
* plain values given as keyword arguments (``batch=0, epoch=0``), exposed as attributes.

No pickle anywhere (`polytrain.horovod.common.elastic_files`): a sync sends rank 0's plain values
as safetensors bytes with JSON, so they must be numbers, strings, None, numpy arrays or
lists/tuples/dicts of them. Rank 0 also writes every commit to
``$POLYTRAIN_HOROVOD_ELASTIC_DIR/state.safetensors`` (a private 0700 directory), and ``run`` in a
job its launcher restarted (``polytrain launch --max-restarts``, torchrun) restores that commit
before the first sync; a first start ignores the file. Adding or removing workers without a
restart (horovodrun's host discovery) is not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from polytrain.horovod.common import HorovodArgumentError, HorovodInternalError, Sum
from polytrain.horovod.common.elastic_files import (
    STATE_DIR_VARIABLE,
    ElasticStateError,
    decode_state,
    encode_state,
    read_state,
    state_dir,
    write_state,
)
from polytrain.horovod.common.elastic_state import ObjectStateBase, retrying
from polytrain.horovod.tensorflow import _impl
from polytrain.horovod.tensorflow.functions import broadcast_variables


def broadcast_state(value: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s ``value`` (plain values and arrays, see the module) on every rank; no pickle.

    A value the root cannot encode raises on every rank (the root sends a length of -1), so no
    rank is left waiting for the data.
    """
    mine = _impl.rank() == root_rank
    data, error = np.zeros(0, np.uint8), None
    if mine:
        try:
            data = np.frombuffer(encode_state(value), np.uint8)
        except TypeError as exc:
            error = exc
    length = int(_impl.broadcast(tf.constant([-1 if error else data.size], tf.int64), root_rank).numpy()[0])
    if length < 0:
        raise error or TypeError(f"hvd.elastic: rank {root_rank} could not send its state (see its error)")
    if not mine:
        data = np.zeros(length, np.uint8)
    received = _impl.broadcast(tf.constant(data), root_rank).numpy()
    return value if mine else decode_state(received.tobytes())


def _agree_on_rank0(action: Callable[[], Any], what: str) -> None:
    """Run ``action`` on rank 0 only, then raise on every rank if it failed there (a collective:
    the other ranks wait for rank 0's outcome instead of running ahead or hanging)."""
    error = None
    if _impl.rank() == 0:
        try:
            action()
        except Exception as exc:  # reported to every rank, then re-raised here
            error = exc
    failure = broadcast_state("" if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failure:
        raise ElasticStateError(f"hvd.elastic: rank 0 failed to {what} ({failure})")


class ObjectState(ObjectStateBase):
    """Plain values kept in step across ranks and restored on failure; each one is an attribute."""

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_state,
                 get_rank: Callable[[], int] = _impl.rank, **kwargs: Any) -> None:
        super().__init__(bcast_object, get_rank, **kwargs)

    def _barrier(self) -> None:
        _impl.barrier()

    def _sum(self, value: float) -> float:
        return float(_impl.allreduce(tf.constant([value], tf.float64), op=Sum, name="elastic.preempted")[0])

    def _read_state(self, directory: Path) -> Any | None:
        return read_state(directory)

    def commit(self) -> None:
        """Keep the current values as the point to roll back (and restart) to.

        Ends with a collective, as Horovod's does (its ``check_host_updates``): no rank leaves a
        commit before rank 0 has written it, so a job restarted after any rank's failure resumes
        from it, and a commit rank 0 cannot write raises on every rank.
        """
        self.save()
        _agree_on_rank0(self.persist, "write the commit")
        if self._stop.spec is not None:  # preemption signals handled: the ranks agree here (one all-reduce)
            self.check_host_updates()

    def persist(self) -> None:
        """Write the last commit to `state_dir` (what rank 0 does on every commit)."""
        write_state(state_dir(), self.snapshot())


def _values(variables: list) -> list[np.ndarray]:
    return [np.array(tf.convert_to_tensor(v)) for v in variables]  # copies, on the host


def _assign(variables: list, values: list, what: str) -> None:
    if len(variables) != len(values) or any(tuple(v.shape) != np.shape(x) for v, x in zip(variables, values)):
        raise ElasticStateError(f"{STATE_DIR_VARIABLE}: the commit's {what} ({len(values)} variables) does not fit "
                                f"this job's ({len(variables)} variables, or other shapes); point "
                                f"{STATE_DIR_VARIABLE} at this model's commits")
    for var, value in zip(variables, values):
        var.assign(value)


class _VariablesState(ObjectState):
    """An `ObjectState` that also keeps groups of variables: ``{group: (all, shared)}`` lists from `_groups`."""

    def _groups(self) -> dict[str, tuple[list, list]]:
        raise NotImplementedError

    def _save_model(self) -> None:
        self._saved_variables = {name: _values(every) for name, (every, _) in self._groups().items()}

    def _load_model(self) -> None:
        for name, (every, _) in self._groups().items():
            _assign(every, self._saved_variables[name], name)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        shared = [v for _, group in self._groups().values() for v in group]
        if shared:
            broadcast_variables(shared, root_rank=0)
        self._save_model()
        super().sync()

    def snapshot(self) -> dict[str, Any]:
        return {**super().snapshot(), "variables": self._saved_variables}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        super().load_snapshot(snapshot)
        self._saved_variables = dict(snapshot["variables"])
        self._load_model()


def optimizer_variables(optimizer: Any) -> list:
    """A Keras optimizer's variables, built first if need be, and a DistributedOptimizer's gradient sums."""
    return [*optimizer.variables, *getattr(optimizer, "aggregation_variables", [])]


class TensorFlowKerasState(_VariablesState):
    """A Keras model, its optimizer (``model.optimizer`` by default) and plain values."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        self.model = model
        if not getattr(model, "built", True):
            raise HorovodArgumentError("Model must be built first. Run `model.build(input_shape)`.")
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if self.optimizer is not None and not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)  # Keras builds lazily; the list must not change
        self.backend = backend
        self._save_model()
        super().__init__(bcast_object=broadcast_state, get_rank=_impl.rank, **kwargs)

    def _groups(self) -> dict[str, tuple[list, list]]:
        groups = {"model": (list(self.model.variables), list(self.model.weights))}
        if self.optimizer is not None:
            variables = optimizer_variables(self.optimizer)
            groups["optimizer"] = (variables, variables)
        return groups


class TensorFlowState(_VariablesState):
    """A list of variables (``tf.Variable`` or Keras 3 variables) and plain values."""

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        if not variables:
            raise HorovodArgumentError("TensorFlowState(variables=...) needs the variables to keep: TensorFlow 2 "
                                       "has no global variable collection to default to")
        self.variables = list(variables)
        self.session = session
        self._save_model()
        super().__init__(bcast_object=broadcast_state, get_rank=_impl.rank, **kwargs)

    def _groups(self) -> dict[str, tuple[list, list]]:
        return {"variables": (self.variables, self.variables)}


def _is_collective_failure(error: tf.errors.OpError) -> bool:
    return any(word in error.message for word in ("HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast",
                                                  "HorovodInternalError"))


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)``; on HorovodInternalError roll back to the last commit, re-initialise and retry.

    A restarted job first restores rank 0's last commit from disk; every attempt starts with
    ``state.sync()``. A ``tf.errors.UnknownError`` raised by a Horovod op counts as a failed
    collective, as in Horovod.
    """

    return retrying(func, begin=lambda state: _agree_on_rank0(state.load_persisted, "restore its last commit"),
                    failed=_failed, restart=_restart)


def _failed(error: BaseException) -> bool:
    return isinstance(error, HorovodInternalError) or (
        isinstance(error, tf.errors.UnknownError) and _is_collective_failure(error))


def _restart() -> None:
    _impl.shutdown()
    _impl.init()


__all__ = ["ObjectState", "STATE_DIR_VARIABLE", "TensorFlowKerasState", "TensorFlowState", "broadcast_state",
           "optimizer_variables", "run", "state_dir"]
