"""What every TensorFlow backend shares: device choice, the default (single-process) hooks.

A TensorFlow backend owns gradient averaging. The framework adapter sums each micro-step's
gradients into accumulator variables; after the last micro-step it calls
``average_gradients(accumulators)`` and the backend replaces them, in place, by their mean
over all ranks. Then the adapter clips and applies the update itself. After building the
model the adapter calls ``broadcast_variables`` so every rank starts from rank 0's weights.

A backend subclasses `TFBackend` and overrides the hooks it owns and the Trainer's
collectives (``all_reduce``, ``broadcast_object``, ``all_gather_object``, ``barrier``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from polytrain.observe.timeline import COLLECTIVES, NULL, Timeline
from polytrain.observe.watchdog import Activity, PeerBoard
from polytrain.protocols import DataShard, ready
from polytrain.spec.tables import TrainSpec
from polytrain.world import World


def choose_device(num_gpus: int, local_rank: int) -> tuple[int | None, str]:
    """(the GPU index this rank makes visible, the device to place the model on).

    One GPU per process, picked by local rank (made visible as ``/GPU:0``); CPU without GPUs.
    """
    if num_gpus == 0:
        return None, "/CPU:0"
    return local_rank % num_gpus, "/GPU:0"


class TFBackend:
    """The base of every TensorFlow backend; implements `polytrain.protocols.Backend`."""

    name = "base"
    #: where TensorFlow's rendezvous listens, when a backend starts one (tf-multiworker)
    listen_address: str | None = None

    def __init__(self, spec: TrainSpec, world: World, *, timeline: Timeline = NULL,
                 activity: Activity | None = None) -> None:
        self.spec = spec
        self.world = world
        self.timeline = timeline
        self.activity = activity
        self.data_shard = DataShard(world.size, world.rank)  # one shard per rank (no model-parallel layouts here)
        self.device = "/CPU:0"

    @property
    def label(self) -> str:
        return self.name

    # ---------------------------------------------------------------- lifecycle
    def setup(self) -> None:
        """Pin this rank's GPU (must run before TensorFlow creates its context)."""
        gpus = tf.config.list_physical_devices("GPU")
        index, self.device = choose_device(len(gpus), self.world.local_rank)
        if index is not None:
            tf.config.set_visible_devices(gpus[index], "GPU")
            tf.config.experimental.set_memory_growth(gpus[index], True)

    def teardown(self) -> None:
        pass

    # ---------------------------------------------------------------- training hooks
    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        """Make every rank's ``variables`` equal to rank 0's."""

    def average_gradients(self, grads: Sequence[tf.Variable]) -> None:
        """Replace each accumulated gradient by its mean over ranks, in place (after the last micro-step)."""

    # ---------------------------------------------------------------- collectives for the Trainer
    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        return np.asarray(values)

    def start_all_reduce(self, values: np.ndarray, op: str = "sum") -> Callable[[], np.ndarray]:
        return ready(self.all_reduce(values, op))  # at once: TensorFlow's collectives are ops run in order

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def progress_board(self) -> PeerBoard | None:
        """The stall watchdog's side channel: TensorFlow's collectives cannot say who is missing."""
        if self.world.size == 1:
            return None
        from polytrain.observe.watchdog import hosted_store_board

        return hosted_store_board(self.world, self.broadcast_object)


class GraphCollectiveBackend(TFBackend):
    """A backend whose collectives are TensorFlow ops (tf-multiworker's strategy, Horovod's TF ops).

    The gradients are averaged after the compiled micro-step rather than inside it: one compiled
    call per bucket of at most the fusion threshold (``POLYTRAIN_MPI_FUSION_BYTES``, default
    64 MiB). Inside one compiled step every rank would look "in forward/backward" to the stall
    watchdog whether it computes or waits in the allreduce; from here the adapter marks the
    "gradient allreduce" phase first, so a stall names the ranks still computing, and a timeline
    records each bucket's allreduce (start, end, bytes). The price is one function call per
    bucket and step (``bench/tf_backends.py``).
    """

    _bucket_source: Sequence[tf.Variable] | None = None
    _bucket_calls: list[tuple[Any, int]]

    def average_in_graph(self, grads: Sequence[tf.Variable]) -> None:
        """Average ``grads`` in place with the backend's collective ops (traced into a ``tf.function``)."""
        raise NotImplementedError

    def average_gradients(self, grads: Sequence[tf.Variable]) -> None:
        if self.world.size == 1:
            return
        if self._bucket_source is not grads:
            self._bucket_source, self._bucket_calls = grads, self._plan(list(grads))
        for index, (call, nbytes) in enumerate(self._bucket_calls):
            started = self.timeline.now()
            call()
            self.timeline.complete(f"gradient bucket {index}", "collective", started, self.timeline.now(),
                                   track=COLLECTIVES, op="allreduce", bytes=nbytes)

    def _plan(self, grads: list[tf.Variable]) -> list[tuple[Any, int]]:
        from polytrain.comm.mpi_transport import fusion_threshold, plan_buckets

        # shape-only stand-ins (no memory): plan_buckets reads dtype and nbytes
        shapes = [np.broadcast_to(np.zeros((), g.dtype.as_numpy_dtype), g.shape) for g in grads]
        calls = []
        for bucket in plan_buckets(shapes, fusion_threshold()):
            members = [grads[i] for i in bucket]
            calls.append((tf.function(lambda members=members: self.average_in_graph(members)),
                          sum(shapes[i].nbytes for i in bucket)))
        return calls


class FlatGradients:
    """Moves a list of variables to and from one flat float32 numpy buffer in two compiled calls.

    Host-side collectives (MPI) then see one contiguous array per step instead of one
    small array per variable.
    """

    def __init__(self, variables: Sequence[tf.Variable]) -> None:
        self.variables = list(variables)
        self.sizes = [int(np.prod(v.shape)) for v in self.variables]
        self._read = tf.function(lambda: tf.concat([tf.reshape(v, [-1]) for v in self.variables], axis=0))
        self._write = tf.function(self._assign, input_signature=[tf.TensorSpec([sum(self.sizes)], tf.float32)])

    def _assign(self, flat: tf.Tensor) -> None:
        for var, part in zip(self.variables, tf.split(flat, self.sizes)):
            var.assign(tf.reshape(part, var.shape))

    def read(self) -> np.ndarray:
        """A fresh, writeable copy of all variables, concatenated."""
        return self._read().numpy()

    def write(self, flat: np.ndarray) -> None:
        self._write(flat)
