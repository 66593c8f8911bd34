"""`Distributed.save` / `Distributed.load`: a hand-written PyTorch loop's checkpoints, which are the Trainer's
(`polytrain.loop.checkpoints` says what goes where and what ``step`` and ``epoch`` mean).

What a state given to ``save`` may hold, by value:
- the model `setup` returned → ``model.safetensors`` (full tensors by portable name, gathered from FSDP/ZeRO/tensor
  parallel shards: a collective);
- the optimizer `setup` returned → ``optimizer.safetensors`` (``<parameter>/<slot>``), and each group's plain
  settings (``lr``, ``momentum``, ...) in the manifest, so a schedule that changed them resumes where it was;
- ``step`` and ``epoch`` (counts) → the manifest's ``global_step`` and ``epoch``;
- tensors → ``loop.safetensors``; an object with ``state_dict``/``load_state_dict`` whose state is plain (an LR
  scheduler) and plain values (numbers, strings, lists, dicts) → the manifest's ``loop_state``.
Anything else is a one-line error: nothing is pickled. Plain values and states come back as they were, also
``inf`` (ReduceLROnPlateau's), tuples and dicts keyed by numbers (MultiStepLR's milestones): every scheduler of
``torch.optim.lr_scheduler`` can be saved (tests/test_own_loop_schedulers.py). The fp16 loss scaler's state and every
rank's RNG state (the CPU generator's, and its CUDA device's: `polytrain.adapters.torch.framework.rng_state`) are
saved too. ``load`` puts them all back into the objects given (the model and optimizer `setup` returned) and
returns the plain values, ``step`` and ``epoch`` among them; the loaders `setup_dataloaders` made go on at the
checkpoint's epoch (the same order of samples as a run that did not stop, when it saved at an epoch's end).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from polytrain.adapters.torch.framework import rng_state, set_rng_state
from polytrain.checkpoint import record
from polytrain.checkpoint import store as ckpt
from polytrain.loop import checkpoints as lc
from polytrain.observe import jsonfiles as jsonfiles
from polytrain.torch.errors import OwnLoopError

GROUP_KEY = "optimizer_groups"
OBJECTS_KEY = "loop_objects"


def save(loop: lc.LoopState, root: str | Path, state: Mapping[str, Any], keep_last: int | None = None) -> Path:
    """Write ``state`` as the checkpoint of its ``step`` under ``root``; see the module. ``loop``: what the
    `Distributed` set up (its model and optimizer among them)."""
    model, optimizer = loop.model, loop.optimizer
    assert model is not None and optimizer is not None
    roles = _roles(loop, state, "save")
    step, epoch = lc.counter(state, "step"), lc.counter(state, "epoch")
    objects = {key: _plain_state(key, value) for key, value in state.items() if roles[key] == "object"}
    values = lc.loop_values({k: v for k, v in state.items() if roles[k] == "value"}, ("step", "epoch"))
    tensors: dict[str, dict[str, np.ndarray]] = {"model": {}, "optimizer": {}, "loop": {}}
    if "model" in roles.values():
        tensors["model"] = {k: _array(v) for k, v in loop.backend.full_state(model).items()}
    if "optimizer" in roles.values():
        tensors["optimizer"] = {k: _array(v) for k, v in loop.backend.full_optimizer_state(model, optimizer).items()}
    tensors["loop"] = {key: _array(value) for key, value in state.items() if roles[key] == "tensor"}
    rng = loop.backend.all_gather_object(rng_state(loop.backend.device))
    scaler = None if loop.scaler is None else {k: float(v) for k, v in loop.scaler.state_dict().items()}
    described = lc.manifest(loop, epoch=epoch, rng_states=rng, loop_state=values, loss_scaler=scaler)
    described[GROUP_KEY] = [lc.plain({k: v for k, v in group.items() if k != "params" and lc.is_json(v)}, "group")
                            for group in optimizer.param_groups] if "optimizer" in roles.values() else None
    described[OBJECTS_KEY] = objects
    described[lc.ENCODED_KEY] += [GROUP_KEY, OBJECTS_KEY]  # `lc.read` turns them back
    return lc.write(loop, Path(root), step, tensors, described, keep_last)


def load(loop: lc.LoopState, path: str | Path, state: Mapping[str, Any]) -> lc.Loaded:
    """Put the checkpoint ``path`` names (a step directory, or a root: its newest) into ``state``'s objects;
    returns its plain values with ``step`` and ``epoch``, and the run and tracker runs the loop goes on in."""
    model, optimizer = loop.model, loop.optimizer
    assert model is not None and optimizer is not None
    roles = _roles(loop, state, "load")
    found, manifest, tensors = lc.read(loop, path)
    if manifest.get("framework", "torch") != "torch":
        raise ckpt.CheckpointError(f"load: {found} holds a {manifest['framework']} model's optimizer and RNG; "
                                   "polytrain.torch loads torch checkpoints (the weights alone: polytrain checkpoint "
                                   "convert)")
    if "model" in roles.values():
        record.check_names(found, tensors.get("model", {}), expected_shapes(loop, model), "model")
        loop.backend.load_full_state(model, {k: torch.from_numpy(np.array(v)) for k, v in tensors["model"].items()})
    if "optimizer" in roles.values():
        stored = tensors.get("optimizer", {})
        params = expected_shapes(loop, model)
        unknown = sorted({key.rpartition("/")[0] for key in stored} - set(params))
        if unknown:
            raise ckpt.CheckpointError(f"load: {found} holds optimizer state for {', '.join(unknown[:3])}, which the "
                                       "model does not have")
        loop.backend.load_full_optimizer_state(model, optimizer,
                                               {k: torch.from_numpy(np.array(v)) for k, v in stored.items()})
        groups = manifest.get(GROUP_KEY)
        if isinstance(groups, list) and len(groups) == len(optimizer.param_groups):
            for group, saved in zip(optimizer.param_groups, groups):
                group.update({k: v for k, v in saved.items() if k in group and k != "params"})
    loop_tensors = tensors.get("loop", {})
    objects = manifest.get(OBJECTS_KEY) or {}
    for key, role in roles.items():
        if role == "tensor":
            if key not in loop_tensors:
                raise ckpt.CheckpointError(f"load: {found} holds no tensor {key!r}")
            state[key].copy_(torch.from_numpy(np.array(loop_tensors[key])))
        elif role == "object":
            if key not in objects:
                raise ckpt.CheckpointError(f"load: {found} holds no state of {key!r}")
            state[key].load_state_dict(objects[key])
    if loop.scaler is not None and manifest.get("loss_scaler"):
        loop.scaler.load_state_dict({k: (int(v) if k in ("growth_interval", "_growth_tracker") else v)
                                      for k, v in manifest["loss_scaler"].items()})
    rng = manifest.get("rng_states") or []
    if manifest.get("world_size") == loop.world.size and len(rng) == loop.world.size:
        try:
            set_rng_state(rng[loop.world.rank], loop.backend.device)
        except ValueError as exc:
            raise ckpt.CheckpointError(f"load: {found}/manifest.json: rank {loop.world.rank}'s {exc}") from None
    resumed = lc.loaded(manifest)  # the run (and its tracker runs) goes on: `Distributed` takes them up
    for loader in loop.loading.loaders:
        loader.epoch = resumed.values["epoch"]
    return resumed


def expected_shapes(loop: lc.LoopState, model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The whole model's state names with their full (unsharded) shapes, as its portable state has them."""
    plain = loop.backend.unwrap(model)
    full = loop.backend.parameter_shapes(model)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in plain.named_parameters(remove_duplicate=False):  # tied weights under each name
        shapes[name] = tuple(full.get(name) or getattr(param, "ds_shape", None) or param.shape)
    keys = set(plain.state_dict().keys())
    for name, buffer in plain.named_buffers():
        if name in keys:
            shapes[name] = tuple(buffer.shape)
    return {name: shapes[name] for name in plain.state_dict().keys() if name in shapes}


def _roles(loop: lc.LoopState, state: Mapping[str, Any], verb: str) -> dict[str, str]:
    """What each value of ``state`` is: the model, the optimizer, a tensor, an object with a state, a value."""
    if not isinstance(state, Mapping):
        raise OwnLoopError(f"{verb}: expected a dict of what to {verb} (model, optimizer, step, ...), got "
                           f"{type(state).__name__}")
    roles = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            if value is not loop.model and value is not loop.backend.unwrap(loop.model):
                raise OwnLoopError(f"{verb}: {key!r} is not the model setup() returned; pass that one")
            roles[key] = "model"
        elif isinstance(value, torch.optim.Optimizer) or getattr(type(value), "wraps_optimizer", False):
            if getattr(value, "optimizer", value) is not loop.optimizer:  # setup's, or the one inside it
                raise OwnLoopError(f"{verb}: {key!r} is not the optimizer setup() returned; pass that one")
            roles[key] = "optimizer"
        elif torch.is_tensor(value):
            roles[key] = "tensor"
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            roles[key] = "object"
        else:
            roles[key] = "value"
    for role in ("model", "optimizer"):
        if list(roles.values()).count(role) > 1:
            raise OwnLoopError(f"{verb}: the state names the {role} twice ({', '.join(k for k, r in roles.items() if r == role)})")
    return roles


def _plain_state(key: str, value: Any) -> Any:
    """``value.state_dict()`` in `jsonfiles.exact`'s form; one line naming what in it is not plain data."""
    try:
        return jsonfiles.exact(value.state_dict(), f"{key!r}.state_dict()")
    except jsonfiles.NotPlain as exc:
        raise ckpt.CheckpointError(f"save: {exc.where} is a {exc.kind}: the state_dict() of {key!r} "
                                   f"({type(value).__name__}) must be {lc.PLAIN}; nothing is pickled: save its "
                                   "tensors instead") from None


def _array(value: torch.Tensor) -> np.ndarray:
    return value.detach().cpu().numpy().copy()
