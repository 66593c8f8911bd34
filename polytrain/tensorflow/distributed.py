"""`Distributed`: the own-loop API over the Trainer's TensorFlow backends (local, mpi, horovod, tf-multiworker).

The backend is made, set up and torn down exactly as the Trainer does it (`registry.create_backend`, its
``setup``/``teardown``). A ``tf.GradientTape`` loop gets its gradients averaged over the ranks by the backend
(`gradient`; `polytrain.tensorflow.averaging` says how, eagerly and inside a ``tf.function``), rank 0's weights
on every rank (`broadcast_variables`, `setup`), its ``tf.data`` share (`shard_dataset`), collectives and the
Trainer's checkpoints. ``model.fit`` trains data-parallel through the optimizer `setup` returns, which averages
the gradients of Keras' compiled train step; the strategy's own ``fit`` is not used (Keras 3's ``fit`` fails
under ``MultiWorkerMirroredStrategy``), so the model stays an ordinary Keras model on every backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from polytrain import registry, validation
from polytrain.checkpoint import store as checkpoint
from polytrain.environments import detect_world
from polytrain.errors import BackendUnavailableError, OwnLoopError
from polytrain.loop.checkpoints import LoopState
from polytrain.loop.session import LoopSession
from polytrain.loop.watch import LoopWatch
from polytrain.tensorflow.averaging import Averager, DistributedOptimizer
from polytrain.tensorflow.data import shard
from polytrain.world import World

#: the TensorFlow backends a hand-written loop runs on (all of the Trainer's)
SUPPORTED = ("local", "mpi", "horovod", "tf-multiworker")
FLOATS = ("float16", "bfloat16", "float32", "float64")


class Distributed(LoopSession):
    """One process's place in a distributed TensorFlow job, for a loop (or a ``model.fit``) the user writes.

    ``backend``: a TensorFlow backend name or ``"auto"``; ``precision``: ``fp32`` or ``bf16`` (Keras'
    ``mixed_bfloat16`` policy for the layers built after this); ``seed``: the shuffle of `shard_dataset`;
    ``spec``: other spec fields as a dict (``reliability``, ``horovod``, ...); ``world``: the World (default:
    what the launcher says). Make it before anything else runs on TensorFlow (``tf-multiworker`` must set up
    TensorFlow's collectives first).
    """

    def __init__(self, backend: str = "auto", *, precision: str = "fp32", seed: int = 0,
                 spec: Mapping[str, Any] | None = None, world: World | None = None) -> None:
        raw = {**dict(spec or {}), "framework": "tensorflow", "backend": backend, "precision": precision,
               "seed": seed}
        self.spec = validation.from_dict(raw)
        self._start(world)

    @classmethod
    def from_spec(cls, path: str | Path, world: World | None = None) -> Distributed:
        """The backend, precision, seed and options of a spec file (the fields the Trainer reads)."""
        self = cls.__new__(cls)
        self.spec = validation.load(path)
        if self.spec.framework != "tensorflow":
            raise OwnLoopError(f"framework: {self.spec.framework!r} in {path}; polytrain.tensorflow runs "
                               "tensorflow specs")
        self._start(world)
        return self

    def _start(self, world: World | None) -> None:
        self.world = world or detect_world()
        name = registry.resolve_backend_name(self.spec, self.world)
        if name not in SUPPORTED:
            raise OwnLoopError(f"backend: {name!r} is not in polytrain.tensorflow (it takes {', '.join(SUPPORTED)})")
        self.backend = registry.create_backend(self.spec, self.world)
        self._watch = LoopWatch(self.world.rank, self.world.size, between="the script's own code")
        self._averager = Averager(self.backend, self.world.size)
        self._model: keras.Model | None = None
        self._optimizer: DistributedOptimizer | None = None
        self._ended = False
        self._owner = checkpoint.Owner(checkpoint.new_run_id())  # whose checkpoints `save` may replace and prune
        with self._setting_up():
            try:
                self.backend.setup()
            except BackendUnavailableError as exc:
                if "must set up TensorFlow's collectives" not in str(exc):
                    raise
                raise OwnLoopError("backend: 'tf-multiworker' must set up TensorFlow's collectives before anything "
                                   "else runs on TensorFlow; make Distributed first, before building the model or "
                                   "dataset (or use backend 'mpi')") from None
        self._policy = keras.config.dtype_policy()  # put back by `end`
        if self.spec.precision == "bf16":
            keras.config.set_dtype_policy("mixed_bfloat16")
        self._hold()
        reliability = self.spec.reliability  # warnings and failures named in save and load only (see LoopWatch)
        self._watch.start(self.backend, reliability.stall_warning_s, reliability.collective_timeout_s)

    # ------------------------------------------------------------------ who and where
    @property
    def device(self) -> str:
        """Where this rank computes (``/GPU:0``, its one visible GPU, or ``/CPU:0``), for ``tf.device``."""
        return self.backend.device

    # ------------------------------------------------------------------ model and optimizer
    def setup(self, model: keras.Model, optimizer: keras.optimizers.Optimizer) -> tuple[keras.Model,
                                                                                        DistributedOptimizer]:
        """Rank 0's weights in ``model`` on every rank, and ``optimizer`` wrapped to step with gradients averaged
        over the ranks: compile the model with it for ``model.fit``, or apply a tape's own gradients with it
        (gradients from `gradient` would be averaged twice: the same numbers, twice the traffic). Build the model
        first (call it on a batch), so it has its weights."""
        self._check_open("setup")
        if self._model is not None:
            raise OwnLoopError("setup: called twice; set up one model and its optimizer per Distributed")
        if not isinstance(model, keras.Model):
            raise OwnLoopError(f"setup: expected a keras.Model, got {type(model).__name__}")
        if not isinstance(optimizer, keras.optimizers.Optimizer) or isinstance(optimizer, DistributedOptimizer):
            raise OwnLoopError(f"setup: expected the model's Keras optimizer (keras.optimizers.Optimizer, not yet "
                               f"wrapped), got {type(optimizer).__name__}")
        if not model.built or not model.variables:
            raise OwnLoopError("setup: the model has no weights yet; build it first (call it on a batch, or give it "
                               "an Input) so that rank 0's weights can be sent to every rank")
        self.broadcast_variables(model.variables)
        if optimizer.built:
            self.broadcast_variables(optimizer.variables)
        if self.world.size > 1 and hasattr(model, "_resolve_auto_jit_compile"):
            # compile's jit_compile="auto" means XLA on a GPU, where no backend's collective runs; Keras itself
            # leaves XLA off under a tf.distribute strategy, and so does this (jit_compile=True stays an error)
            model._resolve_auto_jit_compile = lambda: False
        self._model, self._optimizer = model, DistributedOptimizer(optimizer, self._averager)
        return model, self._optimizer

    def gradient(self, tape: tf.GradientTape, loss: Any, variables: Sequence[Any]) -> list[Any]:
        """``tape.gradient(loss, variables)`` averaged over the ranks (each rank's loss being the mean over its
        share of the global batch, the result is the gradient of the global batch's mean). Eagerly or inside a
        ``tf.function``; every rank calls it with the same variables."""
        self._check_open("gradient")
        if not isinstance(tape, tf.GradientTape):
            raise OwnLoopError(f"gradient: expected a tf.GradientTape, got {type(tape).__name__}")
        variables = list(variables)
        return self._averager.average(tape.gradient(loss, variables), "gradient")

    def average_gradients(self, grads: Sequence[Any]) -> list[Any]:
        """Gradients computed some other way (summed over micro-steps, say) averaged over the ranks, as `gradient`
        does. Every rank calls it with gradients of the same shapes, in the same order."""
        self._check_open("average_gradients")
        return self._averager.average(grads, "average_gradients")

    def broadcast_variables(self, variables: Sequence[Any] | keras.Model | keras.optimizers.Optimizer) -> None:
        """Rank 0's values in ``variables`` (or a model's or an optimizer's variables) on every rank; integer
        variables (random-number state) stay each rank's own. Run it eagerly, on every rank."""
        self._check_open("broadcast_variables")
        self._eager("broadcast_variables")
        if isinstance(variables, (keras.Model, keras.optimizers.Optimizer)):
            variables = variables.variables
        floats = [v for v in variables if tf.as_dtype(v.dtype).name in FLOATS]
        if floats and self.world.size > 1:
            self.backend.broadcast_variables(floats)

    # ------------------------------------------------------------------ data
    def shard_dataset(self, dataset: tf.data.Dataset, global_batch_size: int, *, shuffle_buffer: int | None = None,
                      drop_remainder: bool = False) -> tf.data.Dataset:
        """This rank's batches of ``dataset`` (single samples): each global batch of ``global_batch_size`` — what
        one process would take — split row by row over the ranks, so every rank takes the same number of steps
        and one step of all ranks sees exactly that global batch. ``shuffle_buffer``: shuffle first, with the
        job's seed (the same order on every rank, a new one each pass; TensorFlow's global seed, when set, must
        be the same on every rank too). See `polytrain.tensorflow.data`."""
        self._check_open("shard_dataset")
        return shard(dataset, self.world.rank, self.world.size, global_batch_size, seed=self.spec.seed,
                     shuffle_buffer=shuffle_buffer, drop_remainder=drop_remainder)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, value: Any, op: str = "mean") -> tf.Tensor:
        """``value`` (a tensor, array or number) reduced over the ranks (sum, mean, max, min): a new tensor of its
        dtype. Eagerly, on every rank."""
        self._check_open("all_reduce")
        self._eager("all_reduce")
        tensor = tf.convert_to_tensor(value)
        reduced = self._reduce(np.asarray(tensor.numpy(), dtype=np.float64), op)
        return tf.constant(reduced.reshape(tensor.shape).astype(tensor.dtype.as_numpy_dtype))

    def barrier(self) -> None:
        """Wait until every rank is here."""
        self._check_open("barrier")
        self.backend.barrier()

    # ------------------------------------------------------------------ checkpoints (the Trainer's)
    def save(self, path: str | Path, state: Mapping[str, Any], *, keep_last: int | None = None) -> Path:
        """Write ``state`` (the model, its optimizer, ``step``, ``epoch``, variables, plain values) as a checkpoint
        under the root ``path``, in the Trainer's portable format (`polytrain.tensorflow.checkpoints`); every rank
        calls it, rank 0 writes. Returns the checkpoint's directory."""
        self._check_open("save")
        self._eager("save")
        from polytrain.tensorflow.checkpoints import save

        with self._watch.during("the checkpoint save"):
            return save(self._loop_state(), path, state, keep_last)

    def load(self, path: str | Path, state: Mapping[str, Any]) -> dict[str, Any]:
        """Put a checkpoint (a loop's or the Trainer's; a step directory or the root holding them) into
        ``state``'s objects; returns its plain values with ``step`` and ``epoch``. Every rank calls it."""
        self._check_open("load")
        self._eager("load")
        from polytrain.tensorflow.checkpoints import load

        with self._watch.during("the checkpoint load"):
            return self._resumed(load(self._loop_state(), path, state))

    def _loop_state(self) -> LoopState:
        """What `save` and `load` work on (`polytrain.loop.checkpoints.LoopState`; the model and optimizer saved
        are those the state given names)."""
        return LoopState(self.backend, self.world, self.spec, self._model, self._optimizer, self._owner,
                         self.tracker_ids())

    # ------------------------------------------------------------------ lifetime
    def _release(self) -> None:
        self._model = self._optimizer = None
        keras.config.set_dtype_policy(self._policy)
        self._watch.close()

    def _eager(self, verb: str) -> None:
        if not tf.executing_eagerly():
            raise OwnLoopError(f"{verb}: runs eagerly; call it outside tf.function (gradient and the optimizer "
                               "setup returned also run inside one)")
