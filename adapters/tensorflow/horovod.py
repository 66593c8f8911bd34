"""``horovod`` for TensorFlow: real Horovod's TensorFlow ops on the gradients of polytrain's own step.

Horovod 0.28's ``DistributedGradientTape`` and Keras optimizer wrapper do not work with
Keras 3, but its ops do: the adapter's compiled step sums each micro-step's gradients
into accumulator variables, and after the last micro-step this backend averages them with
one ``hvd.grouped_allreduce`` per bucket, each in its own ``tf.function`` (see
`GraphCollectiveBackend`; Horovod fuses each group into buffers of ``HOROVOD_FUSION_THRESHOLD``).
Initial weights come from rank 0 through ``hvd.broadcast``; the Trainer's collectives are
``hvd.allreduce`` and Horovod's object functions.

Runs where Horovod can form its job: under horovodrun (gloo or MPI controller) and the
MPI launchers. Without Horovod's TensorFlow ops the error says why and names ``mpi``,
which needs only mpi4py and averages the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from polytrain.adapters.tensorflow.backend import GraphCollectiveBackend
from polytrain.errors import BackendUnavailableError
from polytrain.horovod.common import HOROVOD_CAPABLE_LAUNCHERS, _import_error


def horovod_unusable_reason(launcher: str) -> str | None:
    """Why real Horovod's TensorFlow ops cannot run this job, or None when they can."""
    if launcher not in HOROVOD_CAPABLE_LAUNCHERS:
        return (f"Horovod forms its job only under horovodrun or an MPI launcher, not {launcher}; "
                "use backend 'mpi' or 'tf-multiworker'")
    error = _import_error("horovod.tensorflow")
    if error is not None:
        return (f"horovod.tensorflow does not import ({error}); build it with scripts/build_horovod.sh, "
                "or use backend 'mpi' (mpi4py, the same averaging)")
    return None


class HorovodBackend(GraphCollectiveBackend):
    name = "horovod"

    def setup(self) -> None:
        reason = horovod_unusable_reason(self.world.launcher)
        if reason is not None:
            raise BackendUnavailableError(f"backend: 'horovod' cannot run here: {reason}")
        super().setup()
        from polytrain.comm.mpi_singleton import keep_singletons_off_shared_memory

        keep_singletons_off_shared_memory()  # before Horovod starts MPI
        import horovod.tensorflow as hvd

        self.hvd = hvd
        hvd.init()
        if (hvd.rank(), hvd.size()) != (self.world.rank, self.world.size):
            raise BackendUnavailableError(
                f"backend: 'horovod' sees rank {hvd.rank()} of {hvd.size()}, but the launcher "
                f"({self.world.launcher}) says rank {self.world.rank} of {self.world.size}")
        fp16 = self.spec.horovod.compression == "fp16"
        self.compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none

    # ---------------------------------------------------------------- training hooks
    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        if self.world.size == 1:
            return
        for i, var in enumerate(variables):
            var.assign(self.hvd.broadcast(tf.convert_to_tensor(var), root_rank=0, name=f"polytrain.init.{i}"))

    def average_in_graph(self, grads: Sequence[tf.Variable]) -> None:
        if self.world.size == 1:
            return
        reduced = self.hvd.grouped_allreduce([g.read_value() for g in grads], op=self.hvd.Average,
                                             compression=self.compression)
        for grad, value in zip(grads, reduced):
            grad.assign(value)

    # ---------------------------------------------------------------- collectives for the Trainer
    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if self.world.size == 1:
            return values
        reduce_op = {"sum": self.hvd.Sum, "max": self.hvd.Max, "min": self.hvd.Min}[op]
        return self.hvd.allreduce(tf.constant(values), op=reduce_op, name=f"polytrain.train.trainer.{op}").numpy()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.hvd.broadcast_object(obj, root_rank=src) if self.world.size > 1 else obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return list(self.hvd.allgather_object(obj)) if self.world.size > 1 else [obj]

    def barrier(self) -> None:
        self.all_reduce(np.zeros(1))
