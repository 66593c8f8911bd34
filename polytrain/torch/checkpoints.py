"""`Distributed.save` / `Distributed.load`: a hand-written PyTorch loop's checkpoints, which are the Trainer's
(`polytrain.loop_checkpoints` says what goes where and what ``step`` and ``epoch`` mean).

What a state given to ``save`` may hold, by value:
- the model `setup` returned → ``model.safetensors`` (full tensors by portable name, gathered from FSDP/ZeRO/tensor
  parallel shards: a collective);
- the optimizer `setup` returned → ``optimizer.safetensors`` (``<parameter>/<slot>``), and each group's plain
  settings (``lr``, ``momentum``, ...) in the manifest, so a schedule that changed them resumes where it was;
- ``step`` and ``epoch`` (counts) → the manifest's ``global_step`` and ``epoch``;
- tensors → ``loop.safetensors``; an object with ``state_dict``/``load_state_dict`` whose state is plain (an LR
  scheduler) and plain values (numbers, strings, lists, dicts) → the manifest's ``loop_state``.
Anything else is a one-line error: nothing is pickled. The fp16 loss scaler's state and every rank's RNG state are
saved too. ``load`` puts them all back into the objects given (the model and optimizer `setup` returned) and
returns the plain values, ``step`` and ``epoch`` among them; the loaders `setup_dataloaders` made go on at the
checkpoint's epoch (the same order of samples as a run that did not stop, when it saved at an epoch's end).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from polytrain import checkpoint as ckpt
from polytrain import loop_checkpoints as lc
from polytrain.torch.errors import OwnLoopError

if TYPE_CHECKING:
    from polytrain.torch.distributed import Distributed

GROUP_KEY = "optimizer_groups"
OBJECTS_KEY = "loop_objects"


def save(dist: Distributed, root: str | Path, state: Mapping[str, Any], keep_last: int | None = None) -> Path:
    """Write ``state`` as the checkpoint of its ``step`` under ``root``; see the module."""
    model, optimizer = dist._model, dist._optimizer
    assert model is not None and optimizer is not None
    roles = _roles(dist, state, "save")
    step, epoch = lc.counter(state, "step"), lc.counter(state, "epoch")
    objects = {key: _plain_state(key, value) for key, value in state.items() if roles[key] == "object"}
    values = lc.loop_values({k: v for k, v in state.items() if roles[k] == "value"}, ("step", "epoch"))
    tensors: dict[str, dict[str, np.ndarray]] = {"model": {}, "optimizer": {}, "loop": {}}
    if "model" in roles.values():
        tensors["model"] = {k: _array(v) for k, v in dist.backend.full_state(model).items()}
    if "optimizer" in roles.values():
        tensors["optimizer"] = {k: _array(v) for k, v in dist.backend.full_optimizer_state(model, optimizer).items()}
    tensors["loop"] = {key: _array(value) for key, value in state.items() if roles[key] == "tensor"}
    rng = dist.backend.all_gather_object(torch.get_rng_state().tolist())
    scaler = None if dist._scaler is None else {k: float(v) for k, v in dist._scaler.state_dict().items()}
    described = lc.manifest(framework="torch", backend=dist.backend.name, world_size=dist.world.size, epoch=epoch,
                            run_id=dist._owner.run_id or ckpt.new_run_id(), rng_states=rng, loss_scaler=scaler,
                            loop_state=values, precision=dist.spec.precision, trackers=dist.tracker_ids())
    described[GROUP_KEY] = [{k: v for k, v in group.items() if k != "params" and lc.is_json(v)}
                            for group in optimizer.param_groups] if "optimizer" in roles.values() else None
    described[OBJECTS_KEY] = objects
    return lc.write(dist.backend, dist.world.rank, dist.world.size, Path(root), step, tensors, described, keep_last,
                    dist._owner)


def load(dist: Distributed, path: str | Path, state: Mapping[str, Any]) -> dict[str, Any]:
    """Put the checkpoint ``path`` names (a step directory, or a root: its newest) into ``state``'s objects;
    returns its plain values with ``step`` and ``epoch``."""
    model, optimizer = dist._model, dist._optimizer
    assert model is not None and optimizer is not None
    roles = _roles(dist, state, "load")
    found, manifest, tensors = lc.read(dist.backend, dist.world.size, path)
    if manifest.get("framework", "torch") != "torch":
        raise ckpt.CheckpointError(f"load: {found} holds a {manifest['framework']} model's optimizer and RNG; "
                                   "polytrain.torch loads torch checkpoints (the weights alone: polytrain checkpoint "
                                   "convert)")
    if "model" in roles.values():
        lc.check_names(found, tensors.get("model", {}), expected_shapes(dist, model), "model")
        dist.backend.load_full_state(model, {k: torch.from_numpy(np.array(v)) for k, v in tensors["model"].items()})
    if "optimizer" in roles.values():
        stored = tensors.get("optimizer", {})
        params = expected_shapes(dist, model)
        unknown = sorted({key.rpartition("/")[0] for key in stored} - set(params))
        if unknown:
            raise ckpt.CheckpointError(f"load: {found} holds optimizer state for {', '.join(unknown[:3])}, which the "
                                       "model does not have")
        dist.backend.load_full_optimizer_state(model, optimizer,
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
    if dist._scaler is not None and manifest.get("loss_scaler"):
        dist._scaler.load_state_dict({k: (int(v) if k in ("growth_interval", "_growth_tracker") else v)
                                      for k, v in manifest["loss_scaler"].items()})
    rng = manifest.get("rng_states") or []
    if manifest.get("world_size") == dist.world.size and len(rng) == dist.world.size:
        torch.set_rng_state(torch.tensor(rng[dist.world.rank], dtype=torch.uint8))
    if manifest.get(ckpt.RUN_KEY):  # the run goes on: its later saves may replace and prune its checkpoints
        dist._owner = ckpt.Owner(manifest[ckpt.RUN_KEY])
    dist._resumed_trackers = dict(manifest.get("trackers") or {})  # and its tracker runs
    epoch = int(manifest.get("epoch", 0))
    for loader in dist._loading.loaders:
        loader.epoch = epoch
    values = dict(manifest.get("loop_state") or {})
    values.update(step=int(manifest.get("global_step", 0)), epoch=epoch,
                  step_in_epoch=int(manifest.get("step_in_epoch", 0)))
    return values


def expected_shapes(dist: Distributed, model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The whole model's state names with their full (unsharded) shapes, as its portable state has them."""
    plain = dist.backend.unwrap(model)
    full = dist.backend.parameter_shapes(model)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in plain.named_parameters(remove_duplicate=False):  # tied weights under each name
        shapes[name] = tuple(full.get(name) or getattr(param, "ds_shape", None) or param.shape)
    keys = set(plain.state_dict().keys())
    for name, buffer in plain.named_buffers():
        if name in keys:
            shapes[name] = tuple(buffer.shape)
    return {name: shapes[name] for name in plain.state_dict().keys() if name in shapes}


def _roles(dist: Distributed, state: Mapping[str, Any], verb: str) -> dict[str, str]:
    """What each value of ``state`` is: the model, the optimizer, a tensor, an object with a state, a value."""
    if not isinstance(state, Mapping):
        raise OwnLoopError(f"{verb}: expected a dict of what to {verb} (model, optimizer, step, ...), got "
                           f"{type(state).__name__}")
    roles = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            if value is not dist._model and value is not dist.backend.unwrap(dist._model):
                raise OwnLoopError(f"{verb}: {key!r} is not the model setup() returned; pass that one")
            roles[key] = "model"
        elif isinstance(value, torch.optim.Optimizer) or getattr(type(value), "wraps_optimizer", False):
            if getattr(value, "optimizer", value) is not dist._optimizer:  # setup's, or the one inside it
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
    state = value.state_dict()
    if not lc.is_json(state):
        raise ckpt.CheckpointError(f"save: the state_dict() of {key!r} ({type(value).__name__}) is not plain data "
                                   "(numbers, strings, lists, dicts); nothing is pickled: save its tensors instead")
    return state


def _array(value: torch.Tensor) -> np.ndarray:
    return value.detach().cpu().numpy().copy()
