"""``polytrain.horovod.tensorflow.keras.elastic``: the module `polytrain.horovod.keras.elastic` (Horovod's layout)."""

from polytrain.horovod.keras.elastic import (
    CommitStateCallback,
    KerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)

__all__ = ["CommitStateCallback", "KerasState", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
