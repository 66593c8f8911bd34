"""``polytrain.horovod.tensorflow.keras.callbacks``: the callbacks of `polytrain.horovod.keras.callbacks`."""

from polytrain.horovod.keras.callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback", "LearningRateWarmupCallback",
           "MetricAverageCallback"]
