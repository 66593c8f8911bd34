"""The TensorFlow framework adapter: a Keras 3 model trained by a compiled custom step (not ``model.fit``).

Per micro-step a ``tf.function`` runs forward and backward of ``summed loss × loss_scale``
and adds the gradients into accumulator variables; on the last micro-step the backend
averages those across ranks (inside the same compiled call when its collectives are
TensorFlow ops, as with ``tf-multiworker``; after it otherwise). ``optimizer_step`` then
clips by global norm (PyTorch's ``clip_grad_norm_`` rule), applies PyTorch's update rule
(see ``optimizers``) with the step's learning rate and zeroes the accumulators. ``bf16``
computes in bfloat16 with float32 variables (Keras' ``mixed_bfloat16`` policy); losses
are always float32.

Tasks as in the PyTorch adapter: classification (int labels, summed cross-entropy),
regression (float targets, summed squared error) and next-token prediction (int token
ids in and out, logits (batch, length, vocab); a sample's loss is the mean cross-entropy
over its tokens, summed over samples; evaluation sums and counts per token).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.random.seed_generator import global_seed_generator  # Keras exports no public accessor

from polytrain.adapters.tensorflow.backend import TFBackend
from polytrain.adapters.tensorflow.models import (
    PortableVariable,
    build_model,
    from_portable,
    input_dtype,
    to_portable,
)
from polytrain.adapters.tensorflow.objectives import evaluation, loss_fn, metric_fns
from polytrain.adapters.tensorflow.optimizers import make_optimizer
from polytrain.data.source import DatasetInfo
from polytrain.errors import SpecError, UserError
from polytrain.protocols import UserCode
from polytrain.spec import objectives as objectives
from polytrain.spec.tables import TrainSpec
from polytrain.spec.user_code import UserCodeError
from polytrain.world import World

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: coefficient = max_norm / (norm + 1e-6), at most 1


class StateMismatchError(UserError):
    """A state to load does not have this model's names or shapes."""


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """A SpecError raised while TensorFlow traces a step (a user loss of the wrong shape) comes back with
    TensorFlow's traceback folded into its text: keep the one line it was raised with. An exception in the user's
    loss or metric comes back as another exception raised over it: the `UserCodeError` it was is raised again."""
    try:
        yield
    except SpecError as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise SpecError(lines[-1].removeprefix("SpecError: ") if lines else str(exc)) from None
    except Exception as exc:
        inner: BaseException | None = exc
        while inner is not None and not isinstance(inner, UserCodeError):
            inner = inner.__cause__ or inner.__context__
        if inner is None:
            raise
        raise inner from inner.__cause__


class TensorFlowFramework:
    def __init__(self, spec: TrainSpec, world: World, backend: TFBackend, user: UserCode | None = None) -> None:
        self.spec = spec
        self.world = world
        self.backend = backend
        self.user = user or UserCode()

    def build(self, info: DatasetInfo) -> None:
        if info.task not in ("classification", "regression", "next_token"):
            raise SpecError(f"data.name: {self.spec.data.name!r} is a {info.task} task, which framework 'tensorflow' "
                            "does not train (allowed: classification, regression or next_token data)")
        self.info = info
        self.regression = info.task == "regression"
        self.sequence = info.task == "next_token"  # logits (batch, length, vocab)
        self.loss_name = objectives.loss_name(self.spec.loss, info.task)
        self.loss = loss_fn(self.loss_name, self.user.loss)  # one value per sample
        self.metric_fns = metric_fns(objectives.metric_names(self.spec.metrics, info.task), self.user.metrics)
        keras.utils.set_random_seed(self.spec.seed)  # a user's factory draws alike on every rank
        with tf.device(self.backend.device):
            self.model, self.entries = build_model(self.spec.model.name, self.spec.model.params, info,
                                                   seed=self.spec.seed, precision=self.spec.precision,
                                                   live=self.user.model)
            self.trainable = list(self.model.trainable_variables)
            self.accumulators = [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False, name=f"grad_{i}")
                                 for i, v in enumerate(self.trainable)]
            self.optimizer = make_optimizer(self.spec.optimizer, self.trainable)
        self.backend.broadcast_variables([v for v in self.model.variables if v.dtype in ("float32", "float64")])
        keras.utils.set_random_seed(self.spec.seed + self.world.rank)  # per-rank randomness from here on
        global_seed_generator()  # dropout draws from it: create its state now, not inside a compiled step
        self.x_dtype = input_dtype(info)
        self.y_dtype = np.float32 if self.regression else np.int64
        x_spec = tf.TensorSpec((None, *info.input_shape), tf.as_dtype(self.x_dtype))
        y_spec = tf.TensorSpec((None, *info.input_shape) if self.sequence else (None,), tf.as_dtype(self.y_dtype))
        scalar = tf.TensorSpec((), tf.float32)
        self._micro_fn = tf.function(self._micro, input_signature=[x_spec, y_spec, scalar])
        self._eval_fn = tf.function(self._eval, input_signature=[x_spec, y_spec])
        self._apply_fn = tf.function(self._apply)
        self._finite_fn = tf.function(
            lambda: tf.reduce_all([tf.reduce_all(tf.math.is_finite(a)) for a in self.accumulators]))
        self._zero_fn = tf.function(self._zero_accumulators)

    def release(self, state: Mapping[str, np.ndarray] | None = None) -> Any:
        """Let go of the compiled steps, accumulators and optimizer, and return the trained Keras model (a second
        call returns None). Its variables are this process's own on every TensorFlow backend (the strategies mirror
        them locally), so it predicts after the job's collectives are gone."""
        model = getattr(self, "model", None)
        self.model = self.optimizer = None
        self.accumulators, self.trainable = [], []
        self._micro_fn = self._eval_fn = self._apply_fn = self._finite_fn = self._zero_fn = None
        return model

    # ---------------------------------------------------------------- compiled pieces
    def _loss_sum(self, out: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(self.loss(tf.cast(out, tf.float32), y))

    def _forward_backward(self, x: tf.Tensor, y: tf.Tensor, loss_scale: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = self._loss_sum(self.model(x, training=True), y)
            scaled = loss * loss_scale
        grads = tape.gradient(scaled, self.trainable)
        for acc, grad in zip(self.accumulators, grads):
            if grad is not None:
                acc.assign_add(tf.cast(grad, tf.float32))
        return loss

    def _micro(self, x: tf.Tensor, y: tf.Tensor, loss_scale: tf.Tensor) -> tf.Tensor:
        """One micro-step: gradients summed into the accumulators.

        An empty micro-batch (ranks short of samples at the end of an epoch) adds nothing, but
        still takes part in the collective; TF's convolution kernels reject empty batches.
        """
        loss = tf.cond(tf.shape(x)[0] > 0, lambda: self._forward_backward(x, y, loss_scale),
                       lambda: tf.constant(0.0))
        return loss

    def _apply(self, scalars: tf.Tensor, clip_norm: tf.Tensor, clip: bool) -> tf.Tensor:
        grads = [acc.read_value() for acc in self.accumulators]
        norm = tf.constant(0.0)
        if clip:
            norm = tf.norm(tf.stack([tf.norm(g) for g in grads]))
            coef = tf.minimum(clip_norm / (norm + CLIP_EPS), 1.0)
            grads = [g * coef for g in grads]
        self.optimizer.apply(self.trainable, grads, scalars)
        self._zero_accumulators()
        return norm

    def _zero_accumulators(self) -> None:
        for acc in self.accumulators:
            acc.assign(tf.zeros_like(acc))

    def _eval(self, x: tf.Tensor, y: tf.Tensor) -> dict[str, tuple[tf.Tensor, tf.Tensor]]:
        return evaluation(self.loss_name, self.loss, self.metric_fns, self.model(x, training=False), y)

    def _inputs(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(x, self.x_dtype), np.asarray(y, self.y_dtype)

    def train_micro_step(self, x: np.ndarray, y: np.ndarray, loss_scale: float, sync: bool) -> float:
        with tf.device(self.backend.device), _user_errors():
            loss = float(self._micro_fn(*self._inputs(x, y), tf.constant(loss_scale, tf.float32)))
        if sync:
            activity = self.backend.activity
            if activity is not None:  # a stall then tells the ranks in the allreduce from those still computing
                activity.phase("gradient allreduce")
            # a named event in TensorFlow's profiler (spec profile): the mpi and horovod backends' collectives
            # (mpi4py, Horovod's ops run eagerly) are no TensorFlow op it would show by itself
            with tf.profiler.experimental.Trace(f"polytrain::{self.backend.name} gradient sync"):
                self.backend.average_gradients(self.accumulators)
        return loss

    def optimizer_step(self, lr: float, clip_norm: float | None) -> float | None:
        scalars = tf.constant(self.optimizer.scalars(lr), tf.float32)
        with tf.device(self.backend.device):
            norm = self._apply_fn(scalars, tf.constant(clip_norm or 0.0, tf.float32), clip_norm is not None)
        return float(norm) if clip_norm is not None else None

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[float, float]]:
        if not len(x):
            return {name: (0.0, 0.0) for name in ("loss", *self.metric_fns)}
        with tf.device(self.backend.device), _user_errors():
            totals = self._eval_fn(*self._inputs(x, y))
        return {name: (float(total), float(count)) for name, (total, count) in totals.items()}

    def export_state(self, into: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        return {e.name: to_portable(np.asarray(e.variable.numpy()), e.layout) for e in self.entries}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        names = {e.name for e in self.entries}
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        if missing or unexpected:
            raise StateMismatchError(f"state: names do not match the model (missing: {', '.join(missing) or '-'}; "
                                     f"unexpected: {', '.join(unexpected) or '-'})")
        for e in self.entries:
            value = from_portable(np.asarray(state[e.name]), e.layout)
            if tuple(value.shape) != tuple(e.variable.shape):
                raise StateMismatchError(f"state: {e.name} has shape {tuple(np.shape(state[e.name]))}, the model "
                                         f"needs {to_portable(np.zeros(e.variable.shape), e.layout).shape}")
            e.variable.assign(value.astype(e.variable.dtype))

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Like PyTorch's ``named_parameters()``: a variable under two names (a tied head) counts once, first name."""
        return {e.name: to_portable(np.empty(e.variable.shape, np.uint8), e.layout).shape
                for e in self._unique_entries()}

    def grads_finite(self) -> bool:
        """Checked on the averaged gradients: a NaN/Inf on any rank reaches every rank, so all answer alike."""
        return bool(self._finite_fn())

    def discard_gradients(self) -> None:
        self._zero_fn()

    def _unique_entries(self) -> list[PortableVariable]:
        """One entry per variable, under its first portable name (``tok_emb.weight``, not a tied ``head.weight``)."""
        seen: set[int] = set()
        out = []
        for e in self.entries:
            if id(e.variable) not in seen:
                seen.add(id(e.variable))
                out.append(e)
        return out

    def _trainable_entries(self) -> list[PortableVariable]:
        by_id = {id(e.variable): e for e in self._unique_entries()}
        return [by_id[id(v)] for v in self.trainable]

    def export_optimizer_state(self, into: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """``<portable name>/<torch.optim state key>`` → array, moments in the portable layout."""
        out = {}
        for i, entry in enumerate(self._trainable_entries()):
            for slot, value in self.optimizer.slots(i).items():
                out[f"{entry.name}/{slot}"] = to_portable(value, entry.layout) if value.ndim else value
        return out

    def load_optimizer_state(self, state: Mapping[str, np.ndarray]) -> None:
        entries = self._trainable_entries()
        index = {e.name: i for i, e in enumerate(entries)}
        grouped: dict[int, dict[str, np.ndarray]] = {}
        for key, value in state.items():
            name, _, slot = key.rpartition("/")
            if name not in index:
                raise StateMismatchError(f"state: optimizer state for unknown parameter {name!r}")
            value = np.asarray(value)
            layout = entries[index[name]].layout
            scalar = value.ndim == 0 or (slot == "step" and value.size == 1)  # older checkpoints: step as (1,)
            grouped.setdefault(index[name], {})[slot] = value.reshape(()) if scalar else from_portable(value, layout)
        for i, slots in grouped.items():
            self.optimizer.load_slots(i, slots)

    def loss_scaler_state(self) -> dict[str, float] | None:
        """None: TensorFlow runs fp32 and bf16 only, with no loss scaling."""
        return None

    def load_loss_scaler_state(self, state: Mapping[str, float]) -> None:
        pass

    def step_stats(self) -> dict[str, float]:
        return {}  # no loss scaling on TensorFlow yet: nothing beyond the loss to report

    def rng_state(self) -> list[int]:
        """Keras' global seed generator (what layers without their own seed draw from)."""
        return [int(v) for v in global_seed_generator().state.numpy()]

    def set_rng_state(self, state: list[int]) -> None:
        global_seed_generator().state.assign(np.asarray(state, dtype=np.int64))
