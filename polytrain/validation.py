"""Loading a spec whole: parsed by `polytrain.spec.tables`, then held to the rules across its fields and to the
registry's tables.

`polytrain.spec.tables` says what a spec is (its tables, types and ranges); this module says whether one holds
together and names what exists: a data source and the ``data.*`` fields it reads, a backend and its option
table, a framework, a precision the backend takes, a zoo model and its parameters, losses and metrics, a
layout the model can take. It sits above `polytrain.spec.tables` and `polytrain.registry`, so neither imports the
other. Every spec a run uses comes through `load` or `from_dict` (the CLI, `polytrain.fit`, ``polytrain
launch``'s check, the checkpoint tools); every error is one line naming the field.
"""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polytrain import registry
from polytrain.errors import SpecError
from polytrain.spec import layout as layout
from polytrain.spec import objectives as objectives
from polytrain.spec import schema as schema
from polytrain.spec import zoo as zoo
from polytrain.spec.elastic import check_elastic
from polytrain.spec.files import apply_overrides, load_raw
from polytrain.spec.preemption import check_preemption
from polytrain.spec.sinks import check_profile
from polytrain.spec.tables import MAX_IMAGE_SIDE, DataSpec, TrainSpec, parse


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainSpec:
    """Load a spec file (or the defaults when ``path`` is None), apply ``--set`` overrides and validate it."""
    raw = load_raw(path) if path is not None else {}
    return from_dict(apply_overrides(raw, overrides))


def from_dict(raw: Mapping[str, Any], *, validate_components: bool = True) -> TrainSpec:
    """Build and validate a TrainSpec from plain data. ``validate_components=False`` leaves out the names
    checked against what exists (zoo model and parameters, losses and metrics, framework, backend, precision)."""
    spec = parse(raw, data_sources=registry.source_names())
    check(spec, validate_components=validate_components)
    return spec


def check(spec: TrainSpec, *, validate_components: bool = True) -> None:
    """The rules that involve more than one field, then the names against what exists; the first broken one
    raises."""
    _check_data(spec.data)
    if spec.optimizer.nesterov and (spec.optimizer.name != "sgd" or spec.optimizer.momentum <= 0):
        raise SpecError("optimizer.nesterov: needs optimizer.name 'sgd' and optimizer.momentum > 0")
    for i, beta in enumerate(spec.optimizer.betas):
        if not 0.0 <= beta < 1.0:
            raise SpecError(f"optimizer.betas[{i}]: {beta!r} is out of range (must be in [0, 1))")
    if spec.schedule.min_lr >= spec.optimizer.lr:
        raise SpecError(f"schedule.min_lr: {spec.schedule.min_lr!r} must be below optimizer.lr {spec.optimizer.lr!r}")
    if spec.schedule.warmup_epochs > spec.loop.epochs:
        raise SpecError(f"schedule.warmup_epochs: {spec.schedule.warmup_epochs!r} exceeds loop.epochs {spec.loop.epochs}")
    _check_tokens(spec)
    if spec.profile is not None:
        check_profile(spec.profile)
    if spec.elastic is not None:
        check_elastic(spec.elastic, spec.framework, spec.backend)
    if spec.preemption is not None:
        check_preemption(spec.preemption)
    _check_backend_options(spec)
    _check_torch_only(spec)
    layout.check_spec(spec.parallel, framework=spec.framework, backend=spec.backend,
                      data_backends=registry.layout_backends(spec.framework),
                      batch_size=None if spec.data.global_batch_size else spec.data.batch_size)
    if spec.compile.enabled and spec.parallel.pipeline > 1 and spec.parallel.schedule in layout.ZERO_BUBBLE:
        raise SpecError(f"compile.enabled: schedule {spec.parallel.schedule} splits each backward into its input and "
                        "weight halves, which torch.compile cannot run; use schedule interleaved_1f1b or compile off")
    if spec.parallel.model_parallel:
        layout.check_model(spec.parallel, spec.model.name, spec.model.params)
    if validate_components:
        _check_components(spec)
        for name in spec.logging.trackers():
            reason = registry.tracker(name).unusable_reason()
            if reason:
                raise SpecError(f"logging.{name}: {reason}")


def _check_data(data: DataSpec) -> None:
    """The data.* fields the source reads (a registry row's ``uses``/``required``), and that named files exist."""
    entry, default = registry.source(data.name), DataSpec(name=data.name)
    for name in sorted({f for row in registry.SOURCES for f in row.uses}):
        if name not in entry.uses and getattr(data, name) != getattr(default, name):
            users = ", ".join(row.name for row in registry.SOURCES if name in row.uses)
            raise SpecError(f"data.{name}: only used with data.name {users}, not {data.name!r}")
    if data.worker_kind == "processes" and (data.name != "images" or data.workers == 0):
        raise SpecError("data.worker_kind: processes decode images (data.name images, data.workers 1 or more); "
                        f"data.name {data.name!r} with data.workers {data.workers} reads in threads (auto or threads)")
    for i, side in enumerate(data.image_size or ()):
        if not 1 <= side <= MAX_IMAGE_SIDE:
            raise SpecError(f"data.image_size[{i}]: {side} is out of range (must be 1..{MAX_IMAGE_SIDE} pixels)")
    if data.label is not None and data.label in (data.features or ()):
        raise SpecError(f"data.features: {data.label!r} is also data.label; the model would be given its own target "
                        "(leave it out of data.features)")
    for name in entry.required:
        if getattr(data, name) is None:
            raise SpecError(f"data.{name}: required when data.name is {data.name!r}")
    for name in ("path", "val_path"):
        value = getattr(data, name)
        if value is not None and not (glob.has_magic(value) or _exists(value)):
            raise SpecError(f"data.{name}: file not found: {schema.shown(value)}")
    if data.name == "npz" and data.path and not Path(data.path).is_file():
        raise SpecError(f"data.path: file not found: {schema.shown(data.path)}")


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except OSError:  # a name longer than the file system allows, say: no such file either
        return False


def _check_tokens(spec: TrainSpec) -> None:
    """Token data and the transformer LM go together (a custom factory may take token data too)."""
    token_data = spec.data.name in ("tokens", "token_file")
    if spec.model.name == "transformer" and not token_data:
        raise SpecError(f"model.name: 'transformer' needs data.name 'tokens' or 'token_file', not {spec.data.name!r}")
    if token_data and spec.model.name in ("mlp", "convnet"):
        raise SpecError(f"data.name: {spec.data.name!r} needs model.name 'transformer' or a factory, "
                        f"not {spec.model.name!r}")


def _check_torch_only(spec: TrainSpec) -> None:
    """Activation checkpointing and compile: PyTorch's, on blocks the model declares."""
    if spec.compile.mode != "default" and not spec.compile.enabled:
        raise SpecError(f"compile.mode: only used with compile.enabled: true (got mode {spec.compile.mode!r})")
    if spec.framework == "tensorflow":
        if spec.activation_checkpointing:
            raise SpecError("activation_checkpointing: PyTorch-only; framework 'tensorflow' has no equivalent here "
                            "(remove it, or use framework 'torch')")
        if spec.compile.enabled:
            raise SpecError("compile.enabled: torch.compile is PyTorch-only; framework 'tensorflow' already runs "
                            "its step as a compiled tf.function (remove it, or use framework 'torch')")
    checkpointing = spec.activation_checkpointing or spec.fsdp.activation_checkpointing
    if checkpointing and spec.model.name in ("mlp", "convnet") and spec.fsdp.units is None:
        which = "activation_checkpointing" if spec.activation_checkpointing else "fsdp.activation_checkpointing"
        raise SpecError(f"{which}: model {spec.model.name!r} declares no blocks to checkpoint; use model "
                        "'transformer', a factory whose model has block_classes, or name classes in fsdp.units "
                        "(backend fsdp)")


def _check_backend_options(spec: TrainSpec) -> None:
    """Each backend's option table (a registry row's ``options``): only with its backend, then its own rules."""
    for table, options in registry.option_tables().items():
        value = getattr(spec, table)
        if value != options() and spec.backend != table:
            raise SpecError(f"{table}: only used with backend {table!r}, not {spec.backend!r}")
        value.check(spec)


def _check_components(spec: TrainSpec) -> None:
    """The names in a spec against what exists (not against what is installed)."""
    zoo.model_params(spec.model.name, spec.model.params)
    objectives.check_names(spec.loss, spec.metrics)
    if spec.framework not in registry.AUTO_RULES:
        raise SpecError(f"framework: {spec.framework!r} has no backend in this version "
                        f"(allowed: {', '.join(registry.AUTO_RULES)})")
    known = registry.backends_for(spec.framework)
    if spec.backend != "auto" and spec.backend not in known:
        others = [b.framework for b in registry.BACKENDS if b.name == spec.backend]
        why = f" (it exists for {', '.join(others)})" if others else ""
        raise SpecError(
            f"backend: {spec.backend!r} is not available for framework {spec.framework!r}{why}; "
            f"allowed: auto, {', '.join(known)}")
    if spec.backend != "auto":
        registry.check_precision(spec.backend, known[spec.backend], spec.precision)
