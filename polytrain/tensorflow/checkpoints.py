"""`Distributed.save` / `Distributed.load` for a TensorFlow loop: the Trainer's checkpoints
(`polytrain.loop.checkpoints` says what goes where and what ``step`` and ``epoch`` mean).

What a state given to ``save`` may hold, by value:
- a Keras model → ``model.safetensors`` by portable name, as the Trainer names it (`polytrain.adapters.tensorflow.
  models`): a zoo model (``MLP``, ``ConvNet``, ``TransformerLM``) under PyTorch's names and layouts, any other model
  under its variables' Keras paths in Keras' layout (random-number state left out);
- a Keras optimizer (or the one `Distributed.setup` returned) → ``keras_optimizer.safetensors``: each slot as
  ``<the model variable's name>/<slot>`` (``hidden.0.weight/momentum``), the optimizer's own variables by name
  (``iterations``). Not ``optimizer.safetensors``: that file holds the Trainer's optimizer, which follows PyTorch's
  update rules, so its state does not mean the same. The Trainer resuming a loop's checkpoint takes the weights and
  starts its optimizer afresh; a loop loading a Trainer's checkpoint can take the model, not the optimizer;
- ``step`` and ``epoch`` (counts) → the manifest's ``global_step`` and ``epoch``;
- ``tf.Variable``s and numpy arrays → ``loop.safetensors`` (loaded back in place); plain values (numbers, strings,
  lists, dicts) → the manifest's ``loop_state``. Anything else is a one-line error: nothing is pickled.
Every rank's Keras seed-generator state (what layers without a seed of their own draw from) is saved and put back
when the world size is the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.random.seed_generator import global_seed_generator  # Keras exports no public accessor

from polytrain.adapters.tensorflow.models import (
    MLP,
    ConvNet,
    PortableVariable,
    TransformerLM,
    from_portable,
    to_portable,
    user_portable_variables,
)
from polytrain.checkpoint import record
from polytrain.checkpoint import store as ckpt
from polytrain.checkpoint.manifest import restore_rng
from polytrain.errors import OwnLoopError
from polytrain.loop import checkpoints as lc

OPTIMIZER = "keras_optimizer"  # the file stem of a Keras optimizer's state (see the module)


def save(loop: lc.LoopState, root: str | Path, state: Mapping[str, Any], keep_last: int | None = None) -> Path:
    """Write ``state`` as the checkpoint of its ``step`` under ``root``; see the module. ``loop``: the
    `Distributed`'s backend, world, spec and run (the model and optimizer saved are those in ``state``)."""
    roles = _roles(state, "save")
    model, optimizer = _model_and_optimizer(state, roles, "save")
    step, epoch = lc.counter(state, "step"), lc.counter(state, "epoch")
    values = lc.loop_values({k: v for k, v in state.items() if roles[k] == "value"}, ("step", "epoch"))
    tensors: dict[str, dict[str, np.ndarray]] = {"model": {}}
    if model is not None:
        tensors["model"] = {e.name: to_portable(np.asarray(e.variable.numpy()), e.layout) for e in entries(model)}
    if optimizer is not None:
        tensors[OPTIMIZER] = {name: np.array(var.numpy()) for name, var in optimizer_entries(optimizer, model).items()}
    tensors["loop"] = {k: np.array(v.numpy() if isinstance(v, tf.Variable) else v) for k, v in state.items()
                       if roles[k] == "tensor"}
    described = lc.manifest(loop, epoch=epoch, rng_states=_rng_states(loop), loop_state=values)
    return lc.write(loop, Path(root), step, tensors, described, keep_last)


def load(loop: lc.LoopState, path: str | Path, state: Mapping[str, Any]) -> lc.Loaded:
    """Put the checkpoint ``path`` names (a step directory, or a root: its newest) into ``state``'s objects;
    returns its plain values with ``step``, ``epoch`` and ``step_in_epoch``, and the run and tracker runs the loop
    goes on in."""
    roles = _roles(state, "load")
    model, optimizer = _model_and_optimizer(state, roles, "load")
    found, manifest, tensors = lc.read(loop, path)
    if model is not None:
        named = entries(model, "load")
        stored = tensors.get("model", {})
        record.check_names(found, stored, {e.name: to_portable(np.empty(e.variable.shape, np.uint8), e.layout).shape
                                       for e in named}, "model")
        for e in named:
            e.variable.assign(from_portable(np.asarray(stored[e.name]), e.layout).astype(e.variable.dtype))
    if optimizer is not None:
        if OPTIMIZER not in tensors:
            raise ckpt.CheckpointError(f"load: {found} holds no Keras optimizer state (a Trainer's checkpoint holds "
                                       "its own optimizer, which follows PyTorch's update rules); load the model "
                                       "alone: leave the optimizer out of the state")
        if not optimizer.built:  # its slots are made when it is built: load before the first step, too
            optimizer.build(model.trainable_variables)
        slots = optimizer_entries(optimizer, model)
        record.check_names(found, tensors[OPTIMIZER], {k: tuple(v.shape) for k, v in slots.items()}, "Keras optimizer")
        for name, var in slots.items():
            var.assign(np.asarray(tensors[OPTIMIZER][name]).astype(var.dtype))
    loop_tensors = tensors.get("loop", {})
    for key, role in roles.items():
        if role != "tensor":
            continue
        if key not in loop_tensors or np.shape(loop_tensors[key]) != tuple(state[key].shape):
            raise ckpt.CheckpointError(f"load: {found} holds no tensor {key!r} of shape {tuple(state[key].shape)}")
        if isinstance(state[key], np.ndarray):
            state[key][...] = loop_tensors[key]
        else:
            state[key].assign(loop_tensors[key])
    if manifest.get("framework") == "tensorflow":  # at the same world size; a state Keras refuses is one line
        restore_rng(lambda state: global_seed_generator().state.assign(np.asarray(state, dtype=np.int64)),
                    manifest, found, loop.world)
    return lc.loaded(manifest)  # the run (and its tracker runs) goes on: `Distributed` takes them up


def entries(model: keras.Model, verb: str = "save") -> list[PortableVariable]:
    """The model's variables under their portable names (a zoo model's, or Keras paths), each variable once."""
    if not model.built or not model.variables:
        raise OwnLoopError(f"{verb}: the model has no weights yet; build it first (call it on a batch)")
    named = model.portable_variables() if isinstance(model, (MLP, ConvNet, TransformerLM)) \
        else user_portable_variables(model)
    seen: set[int] = set()
    unique = []
    for e in named:  # a tied weight (the transformer's head) is saved under its first name, as the Trainer does
        if id(e.variable) not in seen:
            seen.add(id(e.variable))
            unique.append(e)
    return unique


def optimizer_entries(optimizer: keras.optimizers.Optimizer, model: keras.Model | None) -> dict[str, Any]:
    """The optimizer's variables by checkpoint name: a slot made for a model variable (Keras names it
    ``<the variable's path with _>_<slot>``) as ``<portable name>/<slot>``, the others by their own name."""
    prefixes = {} if model is None else {e.variable.path.replace("/", "_") + "_": e.name for e in entries(model)}
    out: dict[str, Any] = {}
    for var in optimizer.variables:
        owner = max((p for p in prefixes if var.name.startswith(p)), key=len, default=None)
        name = var.name if owner is None else f"{prefixes[owner]}/{var.name[len(owner):]}"
        if name in out:
            raise OwnLoopError(f"save: the optimizer has two variables named {name!r}; give each layer its own name")
        out[name] = var
    return out


def _rng_states(loop: lc.LoopState) -> list[list[int]]:
    """Every rank's Keras seed-generator state, gathered as numbers (each rank fills its own row)."""
    mine = np.asarray(global_seed_generator().state.numpy(), dtype=np.float64)  # small counts: exact in float64
    rows = np.zeros((loop.world.size, mine.size))
    rows[loop.world.rank] = mine
    return np.asarray(loop.backend.all_reduce(rows, "sum")).astype(np.int64).tolist()


def _roles(state: Mapping[str, Any], verb: str) -> dict[str, str]:
    """What each value of ``state`` is: the model, the optimizer, a tensor, a plain value."""
    if not isinstance(state, Mapping):
        raise OwnLoopError(f"{verb}: expected a dict of what to {verb} (model, optimizer, step, ...), got "
                           f"{type(state).__name__}")
    roles = {}
    for key, value in state.items():
        if isinstance(value, keras.Model):
            roles[key] = "model"
        elif isinstance(value, keras.optimizers.Optimizer):
            roles[key] = "optimizer"
        elif isinstance(value, (tf.Variable, np.ndarray)):
            roles[key] = "tensor"
        elif isinstance(value, tf.Tensor):
            raise OwnLoopError(f"{verb}: {key!r} is a tf.Tensor, which cannot be loaded back in place; keep it in a "
                               "tf.Variable")
        else:
            roles[key] = "value"
    for role in ("model", "optimizer"):
        keys = [k for k, r in roles.items() if r == role]
        if len(keys) > 1:
            raise OwnLoopError(f"{verb}: the state names a {role} twice ({', '.join(keys)}); a checkpoint holds one")
    return roles


def _model_and_optimizer(state: Mapping[str, Any], roles: Mapping[str, str], verb: str) -> tuple[Any, Any]:
    model = next((state[k] for k, r in roles.items() if r == "model"), None)
    optimizer = next((state[k] for k, r in roles.items() if r == "optimizer"), None)
    if optimizer is not None and model is None:
        raise OwnLoopError(f"{verb}: the optimizer's state is named after the model's variables; put the model in "
                           "the state too")
    return model, optimizer
