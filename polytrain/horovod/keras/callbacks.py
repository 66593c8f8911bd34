"""Horovod's Keras callbacks for Keras 3 (``horovod/_keras/callbacks.py`` semantics).

Keras 3 optimizers keep the learning rate in a variable (read through
``optimizer.learning_rate``) and ``momentum`` as a Python float baked into the traced train
step. Momentum correction therefore scales the optimizer's velocity buffers by
``new_lr / old_lr`` before the batch — the same update Horovod gets by multiplying
``momentum`` by that ratio for one batch.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from polytrain.horovod.common import Average
from polytrain.horovod.tensorflow import _impl, collectives, functions
from polytrain.horovod.tensorflow.variables import VariableSet, as_list


def _device(device: str):
    return tf.device(device) if device else contextlib.nullcontext()


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's weights and the optimizer's variables from ``root_rank`` when training
    starts, so every process begins from the same state (after the first batch if the model is
    only built then).

    ``local_variables`` (or `register_local_var`) stay as each process has them: Keras 3 variables
    or the ``tf.Variable``s inside them, either form (`polytrain.horovod.tensorflow.variables`).
    The weights are ``model.weights`` — trainable and non-trainable, e.g. batch-norm statistics;
    the random-number states Keras 3 also lists in ``model.variables`` (``SeedGenerator``, used by
    Dropout) stay per process, as tf.keras 2's dropout (which had no state variable) did under Horovod.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables=None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars = VariableSet(as_list(local_variables))

    def register_local_var(self, var) -> None:
        """Leave ``var`` out of the broadcast."""
        self._local_vars.add(var)

    def _broadcast(self) -> None:
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables = [v for v in model.weights if v not in self._local_vars]
        if optimizer is not None:
            variables += [v for v in optimizer.variables if v not in self._local_vars]
        with _device(self.device):
            functions.broadcast_variables(variables, root_rank=self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch-end metrics (``logs``) over all processes, in place, so callbacks after it
    (History, ReduceLROnPlateau, checkpoints) see the global values. Put it before them."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number))
        with _device(self.device):
            averaged = collectives.grouped_allreduce([tf.constant(float(logs[k]), tf.float64) for k in names],
                                                     op=Average)
        for name, value in zip(names, averaged):
            logs[name] = float(value.numpy())


def _learning_rate(optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``
    (exclusive): at each epoch's first batch (``staircase``) or every batch with a fractional epoch.

    A constant ``multiplier`` means ``multiplier ** (epoch - start_epoch)``.
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else lambda epoch: multiplier ** (epoch - start_epoch)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch  # the epochs [start, end) it adjusts
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self._restore_momentum = None

    def _autodetect_steps_per_epoch(self) -> int:
        if self.params.get("steps"):
            return self.params["steps"]
        if self.params.get("samples") and self.params.get("batch_size"):
            return self.params["samples"] // self.params["batch_size"]
        raise ValueError(f"Could not autodetect the number of steps per epoch; pass steps_per_epoch to "
                         f"{type(self).__name__}()")

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = _learning_rate(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and hasattr(optimizer, "momentum") and old_lr > 0 and new_lr != old_lr:
            self._correct_momentum(optimizer, new_lr / old_lr)

    def _correct_momentum(self, optimizer, ratio: float) -> None:
        momentum = optimizer.momentum
        if isinstance(momentum, (tf.Variable, keras.Variable)):  # a settable hyper-parameter: Horovod's way
            self._restore_momentum = (momentum, float(keras.ops.convert_to_numpy(momentum)))
            momentum.assign(self._restore_momentum[1] * ratio)
            return
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        if not momentum or not inner.built:
            return
        for buffer in getattr(inner, "momentums", None) or getattr(inner, "_momentums", None) or []:
            if buffer is not None:
                buffer.assign(buffer * ratio)

    def on_train_begin(self, logs=None):
        if self.initial_lr is None:
            self.initial_lr = _learning_rate(self.model.optimizer)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None
                                                      and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            variable, value = self._restore_momentum
            variable.assign(value)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warm-up (Goyal et al. 2017): ``lr = initial_lr / size`` → ``initial_lr`` over ``warmup_epochs``.

    ``lr'(epoch) = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)``, with
    ``epoch = full_epochs + (batch + 1) / steps_per_epoch``, adjusted every batch.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None,
                 verbose=0) -> None:
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / _impl.size() * (epoch * (_impl.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _impl.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_learning_rate(self.model.optimizer):g}.")
