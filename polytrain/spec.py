"""TrainSpec: one training specification, frozen, validated, framework- and backend-neutral.

A spec is loaded from YAML, TOML, JSON or a dict. Every invalid input raises a
`SpecError` whose one-line message names the field (``optimizer.lr``) and what is
allowed. Validation is driven by the dataclass fields themselves: their type hints
plus a small ``metadata`` rule (``choices``, ``min``, ``max``) per field (`polytrain.schema`).
Backends' option tables live in `polytrain.backend_options`, named by their registry rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytrain import schema
from polytrain.backend_options import DeepSpeedSpec, FSDPSpec, HorovodSpec
from polytrain.errors import SpecError
from polytrain.schema import rule

FRAMEWORKS = ("torch", "tensorflow")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class ModelSpec:
    name: str = rule("mlp")  # a zoo name, or an import path "package.module:factory"
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SyntheticSpec:
    task: str = rule("classification", choices=("classification", "regression"))
    samples: int = rule(2048, min=8)
    features: int = rule(32, min=1)
    classes: int = rule(4, min=2)
    noise: float = rule(0.1, min=0.0)
    seed: int = rule(0, min=0)


@dataclass(frozen=True)
class TokenSpec:
    """A deterministic token corpus for next-token prediction (see `polytrain.data`)."""

    samples: int = rule(1024, min=8)  # sequences
    seq_len: int = rule(32, min=2)  # tokens per input sequence
    vocab: int = rule(32, min=2)
    noise: float = rule(0.1, min=0.0, max=1.0)  # share of tokens drawn at random instead of by the rule
    seed: int = rule(0, min=0)


@dataclass(frozen=True)
class DataSpec:
    name: str = rule("digits", choices=("digits", "synthetic", "npz", "tokens"))
    path: str | None = None
    batch_size: int = rule(32, min=1)  # per worker, per micro-step
    # When set, a step takes this many samples whatever the world size (split across ranks and
    # micro-steps), so runs at different world sizes see the same batches; batch_size is then unused.
    global_batch_size: int | None = rule(None, min=1)
    val_fraction: float = rule(0.2, min=0.0, max=0.9)
    synthetic: SyntheticSpec = field(default_factory=SyntheticSpec)
    tokens: TokenSpec = field(default_factory=TokenSpec)


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = rule("sgd", choices=("sgd", "adam", "adamw"))
    lr: float = rule(0.05, min=0.0, min_exclusive=True)
    momentum: float = rule(0.0, min=0.0, max=1.0)
    nesterov: bool = False
    weight_decay: float = rule(0.0, min=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = rule(1e-8, min=0.0, min_exclusive=True)


@dataclass(frozen=True)
class ScheduleSpec:
    lr_scaling: str = rule("none", choices=("linear", "sqrt", "none"))
    warmup_epochs: float = rule(0.0, min=0.0)
    decay: str = rule("none", choices=("none", "cosine", "step"))
    step_epochs: int = rule(1, min=1)  # step decay: multiply by gamma every step_epochs
    gamma: float = rule(0.1, min=0.0, max=1.0)
    min_lr: float = rule(0.0, min=0.0)


@dataclass(frozen=True)
class LoopSpec:
    epochs: int = rule(10, min=1)
    max_steps: int | None = rule(None, min=1)
    grad_accum_steps: int = rule(1, min=1)
    grad_clip_norm: float | None = rule(None, min=0.0, min_exclusive=True)
    log_every_n_steps: int = rule(10, min=1)


@dataclass(frozen=True)
class CheckpointSpec:
    dir: str | None = None  # default: <output>/checkpoints
    every_n_steps: int | None = rule(None, min=1)
    every_n_epochs: int | None = rule(None, min=1)
    keep_last: int = rule(3, min=1)


@dataclass(frozen=True)
class ReliabilitySpec:
    """What to do when training goes wrong, and how long to wait before calling it a failure."""

    on_nonfinite: str = rule("stop", choices=("stop", "skip"))  # a NaN/Inf loss or gradient
    verify_every_n_steps: int | None = rule(None, min=1)  # checksum the replicas across ranks
    collective_timeout_s: float = rule(300.0, min=1.0)  # a collective not done by then fails the job
    stall_warning_s: float = rule(60.0, min=0.1)  # warn (naming the ranks behind) when stuck this long
    startup_timeout_s: float = rule(120.0, min=1.0)  # every rank must have met the others by then
    startup_check: bool = True  # compare spec digest, parameters and library versions across ranks


@dataclass(frozen=True)
class TrainSpec:
    framework: str = rule("torch", choices=FRAMEWORKS)
    backend: str = "auto"
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    loop: LoopSpec = field(default_factory=LoopSpec)
    precision: str = rule("fp32", choices=PRECISIONS)
    seed: int = rule(0, min=0)
    output: str = "runs/polytrain"
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    reliability: ReliabilitySpec = field(default_factory=ReliabilitySpec)
    fsdp: FSDPSpec = field(default_factory=FSDPSpec)
    deepspeed: DeepSpeedSpec = field(default_factory=DeepSpeedSpec)
    horovod: HorovodSpec = field(default_factory=HorovodSpec)

    def to_dict(self) -> dict[str, Any]:
        return schema.plain(self)

    def digest(self) -> str:
        """A short hash of everything that defines the training (not where it writes)."""
        payload = self.to_dict()
        for key in ("output", "checkpoint", "reliability"):
            payload.pop(key, None)
        return schema.digest(payload)

    def model_digest(self) -> str:
        """A hash of what a checkpoint's tensors depend on: model, data and seed.

        Two specs with the same model digest can resume each other's checkpoints, on any
        backend and world size."""
        payload = self.to_dict()
        data = {k: v for k, v in payload["data"].items() if k not in ("batch_size", "global_batch_size")}
        return schema.digest({"model": payload["model"], "data": data, "seed": payload["seed"]})

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.output) / "checkpoints"


def field_paths() -> list[str]:
    """Every field of a spec as a dotted path (``loop.epochs``), tables included, for suggestions."""
    return schema.field_paths(TrainSpec)


def _check_combinations(spec: TrainSpec) -> None:
    """Rules that involve more than one field."""
    data = spec.data
    if data.name == "npz" and not data.path:
        raise SpecError("data.path: required when data.name is 'npz' (a .npz file with arrays x and y)")
    if data.name != "npz" and data.path:
        raise SpecError(f"data.path: only used with data.name 'npz', not {data.name!r}")
    if data.path and not Path(data.path).is_file():
        raise SpecError(f"data.path: file not found: {data.path}")
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
    _check_backend_options(spec)


def _check_tokens(spec: TrainSpec) -> None:
    """Token data and the transformer LM go together (a custom factory may take token data too)."""
    if spec.model.name == "transformer" and spec.data.name != "tokens":
        raise SpecError(f"model.name: 'transformer' needs data.name 'tokens', not {spec.data.name!r}")
    if spec.data.name == "tokens" and spec.model.name in ("mlp", "convnet"):
        raise SpecError(f"data.name: 'tokens' needs model.name 'transformer' or a factory, not {spec.model.name!r}")


def _check_backend_options(spec: TrainSpec) -> None:
    """Each backend's option table (a registry row's ``options``): only with its backend, then its own rules."""
    from polytrain.registry import option_tables

    for table, options in option_tables().items():
        value = getattr(spec, table)
        if value != options() and spec.backend != table:
            raise SpecError(f"{table}: only used with backend {table!r}, not {spec.backend!r}")
        value.check(spec)


def from_dict(raw: Mapping[str, Any], *, validate_components: bool = True) -> TrainSpec:
    """Build and validate a TrainSpec from plain data."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"spec: expected a table at the top level, got {type(raw).__name__}")
    spec = schema.build(TrainSpec, raw, "")
    _check_combinations(spec)
    if validate_components:
        from polytrain import registry

        registry.validate(spec)
    return spec


class _DuplicateKey(ValueError):
    """A key given twice in one table (YAML and JSON parsers keep the last one silently)."""

    def __init__(self, key: Any, line: int | None = None) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line = key, line


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


_YAML_LOADER: Any = None


def _yaml_loader() -> Any:
    """yaml.SafeLoader, except that a key given twice in one table is an error (YAML requires unique keys)."""
    global _YAML_LOADER
    if _YAML_LOADER is None:
        import yaml

        class UniqueKeyLoader(yaml.SafeLoader):
            def construct_mapping(self, node: Any, deep: bool = False) -> Any:
                seen: set[Any] = set()
                for key_node, _ in node.value:
                    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=deep)
                    if key in seen:
                        raise _DuplicateKey(key, key_node.start_mark.line + 1)
                    seen.add(key)
                return super().construct_mapping(node, deep)

        _YAML_LOADER = UniqueKeyLoader
    return _YAML_LOADER


def _yaml_problem(exc: Exception) -> str:
    """PyYAML's multi-line error as one line: where, what, and in which construct."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return ": " + " ".join(str(exc).split())
    text = f" at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        text += f" ({context} started at line {context_mark.line + 1}, column {context_mark.column + 1})"
    if "'\\t'" in problem:
        text += "; indent with spaces, not tabs"
    return text


def parse_text(text: str, suffix: str, source: str = "spec") -> dict[str, Any]:
    """Parse YAML/TOML/JSON text into plain data, with a one-line error on bad syntax."""
    kind = suffix.lstrip(".").upper() or "YAML"
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib
            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(text, object_pairs_hook=_json_pairs)
        import yaml

        try:
            data = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass: plain data only
        except yaml.YAMLError as exc:
            raise SpecError(f"{source}: cannot parse YAML{_yaml_problem(exc)}") from exc
        return {} if data is None else data
    except _DuplicateKey as exc:
        where = f" at line {exc.line}" if exc.line else ""
        raise SpecError(f"{source}: duplicate key {exc.key!r}{where} (each key may appear once in a table)") from exc
    except SpecError:
        raise
    except Exception as exc:  # each parser has its own error class; all mean "bad syntax"
        detail = " ".join(str(exc).split())
        raise SpecError(f"{source}: cannot parse {kind}: {detail}") from exc


def load_raw(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise SpecError(f"spec: {path}: unknown file type (allowed: .yaml, .yml, .toml, .json)")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"spec: cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"spec: {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                        f"{exc.start}); save it as UTF-8") from exc
    data = parse_text(text, path.suffix, str(path))
    if not isinstance(data, Mapping):
        raise SpecError(f"spec: expected a table at the top level, got {type(data).__name__} ({path} must hold "
                        f"fields such as 'framework: torch')")
    return data


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML scalars/lists)."""
    import copy

    import yaml

    if not isinstance(raw, Mapping):
        raise SpecError(f"spec: expected a table at the top level, got {type(raw).__name__}")
    out = copy.deepcopy(dict(raw))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optimizer.lr=0.1")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecError(f"--set {key}: cannot parse value {text!r} as YAML (e.g. 3, 0.1, true, text, "
                            f"[64, 32] or {{name: adam}}; quote text that has brackets or colons)") from exc
        node = out
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                table = ".".join(parts[: i + 1])
                raise SpecError(f"--set {key}: {table!r} is {child!r}, not a table, so it has no {parts[i + 1]!r}")
            node = child
        node[parts[-1]] = value
    return out


def load(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainSpec:
    """Load a spec file (or the defaults when ``path`` is None) and apply ``--set`` overrides."""
    raw = load_raw(path) if path is not None else {}
    return from_dict(apply_overrides(raw, overrides))
