"""``mpi`` for TensorFlow: gradients averaged with ``MPI_Allreduce`` through mpi4py, small tensors fused.

For jobs started by an MPI launcher (mpirun/mpiexec of Open MPI, MPICH, Intel MPI,
MVAPICH; srun with PMI; horovodrun in MPI mode). The accumulated gradients are read
into one host buffer (already packed, so each fusion bucket is a slice of it, reduced in
place — see ``polytrain.comm.mpi_transport``) and written back; initial weights are broadcast from
rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from polytrain.adapters.tensorflow.backend import FlatGradients, TFBackend
from polytrain.comm.mpi_transport import MpiCollectives, TrainerCollectivesOverMpi


class MpiBackend(TrainerCollectivesOverMpi, TFBackend):
    name = "mpi"

    def setup(self) -> None:
        self.mpi = MpiCollectives(self.world.rank, self.world.size, self.world.launcher)
        self.mpi.timeline = self.timeline
        super().setup()
        self._flat: FlatGradients | None = None
        self._flat_source: Sequence[tf.Variable] | None = None

    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        for var in variables:
            value = np.array(var.numpy(), copy=True, order="C")  # Keras may hand out a read-only view
            self.mpi.broadcast_([value])
            var.assign(value)

    def average_gradients(self, grads: Sequence[tf.Variable]) -> None:
        if self.mpi.size == 1:
            return
        if self._flat is None or self._flat_source is not grads:
            self._flat, self._flat_source = FlatGradients(grads), grads
        flat = self._flat.read()
        self.mpi.average_flat_(flat, self._flat.sizes)
        self._flat.write(flat)
