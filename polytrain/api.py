"""``polytrain.fit``: train from a script, launched like ``horovodrun -np 8 python train.py``.

The script's live objects — a model, data, a loss, metrics, callbacks — take the place of what the
spec names; everything else (backend, launcher detection, schedule, checkpoints, the exact-averaging
rule) is the same as ``polytrain train``, and the spec is validated the same way, with the same
one-line errors (raised as `polytrain.errors.SpecError`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from polytrain import registry, validation
from polytrain.errors import SpecError
from polytrain.protocols import UserCode
from polytrain.spec.files import load_raw
from polytrain.spec.tables import TrainSpec
from polytrain.spec.user_code import LIVE_PREFIX
from polytrain.train.trainer import Trainer, TrainResult
from polytrain.world import World


def _raw(spec: str | Path | Mapping[str, Any] | TrainSpec) -> dict[str, Any]:
    if isinstance(spec, TrainSpec):
        return spec.to_dict(redact=False)  # built again here: the real values (a tracking URI's password)
    if isinstance(spec, (str, Path)):
        return load_raw(spec)
    if isinstance(spec, Mapping):
        return dict(spec)
    raise SpecError(f"spec: expected a path, a dict or a TrainSpec, got {type(spec).__name__}")


def _name(obj: Any) -> str:
    return getattr(obj, "__name__", None) or type(obj).__name__


def _metrics(metrics: Sequence[str | Callable[..., Any]]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Metric names for the spec, and the live callables under their ``fit:`` names."""
    names, live = [], {}
    for i, metric in enumerate(metrics):
        if isinstance(metric, str):
            names.append(metric)
        elif callable(metric):
            key = f"{LIVE_PREFIX}{_name(metric)}"
            if key in live:
                raise SpecError(f"metrics[{i}]: two metrics are named {_name(metric)!r}; give each function its own name")
            names.append(key)
            live[key] = metric
        else:
            raise SpecError(f"metrics[{i}]: expected a metric name or a function, got {type(metric).__name__}")
    return tuple(names), live


def fit(spec: str | Path | Mapping[str, Any] | TrainSpec, *, model: Any = None, train_data: Any = None,
        val_data: Any = None, loss: Callable[..., Any] | str | None = None,
        metrics: Sequence[str | Callable[..., Any]] | None = None, callbacks: Sequence[Any] | None = None,
        world: World | None = None, resume: str | None = None, show_progress: bool = True,
        accept_changed_data: bool = False, overwrite_checkpoints: bool = False) -> TrainResult:
    """Train ``spec`` (a YAML/TOML/JSON path, a dict or a `TrainSpec`) with live objects in place of its names.

    ``model``: a ``torch.nn.Module`` (framework torch) or ``keras.Model`` (tensorflow), built the same way
    on every rank (rank 0's weights are used), or a function with no arguments that builds one — called
    after the backend is set up, which TensorFlow's multi-worker strategy needs; ``train_data``/``val_data``: ``(x, y)`` numpy arrays or a
    map-style dataset (``__len__``, ``__getitem__`` → ``(x, y)``; a torch ``Dataset`` of tensors and an HF
    ``datasets.Dataset`` work); without ``val_data`` the training data is split by ``data.val_fraction``;
    ``loss``: a built-in name or a callable ``(outputs, targets)`` → one loss per sample; ``metrics``: names
    or such callables; ``callbacks``: objects with the hooks of `polytrain.train.callbacks`; ``resume``: ``"auto"`` or
    a checkpoint (as ``--resume``), refused when the data changed since it unless ``accept_changed_data`` (the
    epoch then starts over); ``overwrite_checkpoints``: move another run's checkpoints in ``checkpoint.dir``
    aside (into ``superseded-…/``) instead of refusing to start. Every rank calls it.

    When it returns or raises, everything it started has ended (process groups, stores, threads). The result's
    ``model`` is the trained model, plain and on the CPU (no hook or tensor bound to the finished job): the
    ``model`` given, trained — backends that remake a module (fsdp, deepspeed, horovod, tensor/pipeline
    parallel) train a copy and load the outcome into it — or the one built. An exception raised in the
    caller's loss, metric, callback or factory comes back as `polytrain.spec.user_code.UserCodeError` naming the
    hook, with the original as its ``__cause__``.
    """
    raw = _raw(spec)
    if val_data is not None and train_data is None:
        raise SpecError("val_data: given without train_data; pass both, or neither to use the spec's data")
    user = UserCode()
    if model is not None:
        built_later = inspect.isfunction(model) or inspect.ismethod(model) or isinstance(model, functools.partial)
        raw["model"] = {"name": f"{LIVE_PREFIX}{_name(model) if built_later else type(model).__name__}"}
        user = dataclasses.replace(user, model=model)
    if loss is not None:
        if not (isinstance(loss, str) or callable(loss)):
            raise SpecError(f"loss: expected a loss name or a function, got {type(loss).__name__}")
        raw["loss"] = loss if isinstance(loss, str) else f"{LIVE_PREFIX}{_name(loss)}"
        if not isinstance(loss, str):
            user = dataclasses.replace(user, loss=loss)
    if metrics is not None:
        raw["metrics"], live = _metrics(metrics)
        user = dataclasses.replace(user, metrics=live)
    final = validation.from_dict(raw)  # validated as a spec file is, with the live names in place
    data = None
    if train_data is not None:
        from polytrain.data.live import data_from_objects

        data = data_from_objects(train_data, val_data, final.data, final.seed)
    trainer = Trainer(final, world, resume=resume, show_progress=show_progress, data=data,
                      callbacks=callbacks or (), accept_changed_data=accept_changed_data,
                      overwrite_checkpoints=overwrite_checkpoints,
                      framework_factory=lambda s, w, b: registry.create_framework(s, w, b, user=user))
    return trainer.fit()
