"""TrainSpec: one training specification, frozen, framework- and backend-neutral.

What a spec is: its tables as dataclasses, each field's type hint and ``metadata`` rule (``choices``,
``min``, ``max``; `polytrain.spec.schema`), and `parse`, which builds a spec from plain data checking each field
on its own. A spec is loaded from YAML, TOML, JSON or a dict by `polytrain.validation`, which adds the rules
across fields and the names checked against the registry; every invalid input raises a `SpecError` whose
one-line message names the field (``optimizer.lr``) and what is allowed. Backends' option tables live in
`polytrain.spec.backend_options`, named by their registry rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polytrain.errors import SpecError
from polytrain.observe.redact import redacted
from polytrain.spec import schema as schema
from polytrain.spec.backend_options import DeepSpeedSpec, FSDPSpec, HorovodSpec
from polytrain.spec.elastic import ElasticSpec
from polytrain.spec.layout import ParallelSpec
from polytrain.spec.preemption import PreemptionSpec
from polytrain.spec.schema import rule
from polytrain.spec.sinks import LoggingSpec, ProfileSpec

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
class AugmentSpec:
    """Seeded image augmentation of training batches (``data.name: images``); a function of (seed, epoch, sample)."""

    crop_padding: int = rule(0, min=0)  # random crop of image_size from the image padded by this many pixels
    horizontal_flip: bool = False  # flip half the images left-right


#: the largest data.image_size side (an image of 16384² RGB pixels is 3 GiB as float32)
MAX_IMAGE_SIDE = 16384
#: data fields that say how samples are read, not which: never part of the model digest
READING_FIELDS = ("batch_size", "global_batch_size", "workers", "prefetch", "worker_kind")
#: data fields added after checkpoints existed: in the model digest only when set, so older checkpoints resume
LATER_DATA_FIELDS = ("val_path", "features", "label", "classes", "shuffle_window", "image_size", "channels", "mean",
                     "std", "augment", "dtype", "seq_len", "vocab", "factory", "transform")


@dataclass(frozen=True)
class DataSpec:
    name: str = "digits"  # a data source: one of `polytrain.registry.SOURCES` (given to `parse`)
    # npz: the file; parquet/csv/images/token_file: a file, directory or glob (split by val_fraction
    # unless val_path names the validation data)
    path: str | None = None
    val_path: str | None = None
    batch_size: int = rule(32, min=1)  # per worker, per micro-step
    # When set, a step takes this many samples whatever the world size (split across ranks and
    # micro-steps), so runs at different world sizes see the same batches; batch_size is then unused.
    global_batch_size: int | None = rule(None, min=1)
    val_fraction: float = rule(0.2, min=0.0, max=0.9)
    synthetic: SyntheticSpec = field(default_factory=SyntheticSpec)
    tokens: TokenSpec = field(default_factory=TokenSpec)
    # parquet / csv: feature columns (several scalar columns, or one column of fixed-size arrays) and the label
    features: tuple[str, ...] | None = None
    label: str | None = None
    # classification: number of classes (default: the image folders, or the largest label + 1, below 2**20)
    classes: int | None = rule(None, min=2)
    # parquet: row groups whose rows are shuffled together (the epoch's order permutes row groups, then rows
    # within each window of this many)
    shuffle_window: int = rule(4, min=1)
    # images: every image is resized to [height, width] (1..MAX_IMAGE_SIDE); channels 1 (grey) or 3 (RGB);
    # per-channel mean/std
    image_size: tuple[int, int] | None = None
    channels: int = rule(3, choices=(1, 3))
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    augment: AugmentSpec = field(default_factory=AugmentSpec)
    # token_file: the ids' type, tokens per sample (windows of seq_len + 1), vocabulary (default: largest id + 1)
    dtype: str = rule("uint16", choices=("uint16", "uint32"))
    seq_len: int | None = rule(None, min=1)
    vocab: int | None = rule(None, min=2)
    # dataset: package.module:function returning a map-style dataset (__len__, __getitem__ -> (x, y))
    factory: str | None = None
    # package.module:function (x, y) -> (x, y) on numpy batches in the data workers. Randomness is per sample,
    # seeded by (seed, epoch, sample index): one taking ``rng`` is called once per sample (a batch of one, that
    # sample's Generator); one taking ``rngs`` gets the whole batch and a Generator per sample
    transform: str | None = None
    workers: int = rule(2, min=0)  # background reader threads (0: read in the training loop)
    # images: decode in `workers` processes (auto: whenever workers > 0) or in the reader threads
    worker_kind: str = rule("auto", choices=("auto", "threads", "processes"))
    prefetch: int = rule(2, min=1)  # steps read ahead


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


MODES = ("min", "max")


@dataclass(frozen=True)
class EarlyStoppingSpec:
    """Stop when ``monitor`` (val_loss, train_loss or val_<metric>) has not improved by ``min_delta`` for
    ``patience`` validations (Lightning's EarlyStopping); decided identically on every rank."""

    monitor: str | None = None  # null: off
    mode: str = rule("min", choices=MODES)
    patience: int = rule(3, min=1)
    min_delta: float = rule(0.0, min=0.0)


@dataclass(frozen=True)
class LoopSpec:
    epochs: int = rule(10, min=1)
    max_steps: int | None = rule(None, min=1)
    grad_accum_steps: int = rule(1, min=1)
    grad_clip_norm: float | None = rule(None, min=0.0, min_exclusive=True)
    log_every_n_steps: int = rule(10, min=1)
    early_stopping: EarlyStoppingSpec = field(default_factory=EarlyStoppingSpec)


@dataclass(frozen=True)
class CheckpointSpec:
    dir: str | None = None  # default: <output>/checkpoints
    every_n_steps: int | None = rule(None, min=1)
    every_n_epochs: int | None = rule(None, min=1)
    keep_last: int = rule(3, min=1)
    # best checkpoints (Lightning's ModelCheckpoint): after each validation, keep the save_top_k best by
    # monitor (val_loss, train_loss or val_<metric>) under <checkpoint dir>/best; save_last: also save the
    # state after every validation as a regular (resumable) checkpoint
    monitor: str | None = None
    mode: str = rule("min", choices=MODES)
    save_top_k: int = rule(1, min=1)
    save_last: bool = False
    # write regular checkpoints on a background thread while training goes on (the state is copied first; one
    # write at a time; a failed write ends the run on every rank at the next save or at the end)
    async_save: bool = False


@dataclass(frozen=True)
class ReliabilitySpec:
    """What to do when training goes wrong, and how long to wait before calling it a failure."""

    on_nonfinite: str = rule("stop", choices=("stop", "skip"))  # a NaN/Inf loss or gradient
    verify_every_n_steps: int | None = rule(None, min=1)  # checksum the replicas across ranks
    collective_timeout_s: float = rule(300.0, min=1.0)  # a collective not done by then fails the job
    stall_warning_s: float = rule(60.0, min=0.1)  # warn (naming the ranks behind) when stuck this long
    startup_timeout_s: float = rule(120.0, min=1.0)  # every rank must have met the others by then
    startup_check: bool = True  # compare spec digest, parameters and library versions across ranks


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


@dataclass(frozen=True)
class CompileSpec:
    """``torch.compile`` of the model (PyTorch only), applied where each backend needs it."""

    enabled: bool = False
    mode: str = rule("default", choices=COMPILE_MODES)  # torch.compile's mode (reduce-overhead: CUDA graphs)


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
    # PyTorch: recompute each declared block's activations in the backward pass (the model's block_classes;
    # under fsdp its units), on every backend; fsdp.activation_checkpointing is an alias
    activation_checkpointing: bool = False
    compile: CompileSpec = field(default_factory=CompileSpec)
    # tensor / pipeline / data parallel degrees (PyTorch; see polytrain.spec.layout)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    # a built-in loss (cross_entropy, mse, bce, next_token) or package.module:function(outputs, targets) -> one
    # loss per sample; null: the task's (cross_entropy, mse, next_token)
    loss: str | None = None
    # built-in (accuracy, top5_accuracy, mse, mae, perplexity) or package.module:function(outputs, targets) -> one
    # value per sample; null: the task's (accuracy for classification and next-token data)
    metrics: tuple[str, ...] | None = None
    # package.module:Class, each made with no arguments, its hooks (on_train_start, on_step_end,
    # on_validation_end, on_checkpoint, on_train_end) called on every rank (see polytrain.train.callbacks)
    callbacks: tuple[str, ...] | None = None
    seed: int = rule(0, min=0)
    output: str = "runs/polytrain"
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    reliability: ReliabilitySpec = field(default_factory=ReliabilitySpec)
    fsdp: FSDPSpec = field(default_factory=FSDPSpec)
    deepspeed: DeepSpeedSpec = field(default_factory=DeepSpeedSpec)
    horovod: HorovodSpec = field(default_factory=HorovodSpec)
    # rank 0's records beside metrics.jsonl (csv, tensorboard, wandb, mlflow) and the profiler's steps
    # (polytrain.spec.sinks); neither is part of the digest
    logging: LoggingSpec = field(default_factory=LoggingSpec)
    profile: ProfileSpec | None = None
    elastic: ElasticSpec | None = None  # in-place recovery from a lost rank (polytrain.spec.elastic)
    preemption: PreemptionSpec | None = None  # a signal stops the run at a step boundary (polytrain.spec.preemption)
    preflight: bool = False  # `polytrain launch` runs `polytrain doctor` on the job's ranks first

    def to_dict(self, redact: bool = True) -> dict[str, Any]:
        """The spec as plain data, as it is written (manifests, ``model.json``), logged (trackers) and hashed
        (`digest`): every credential in a URI masked (`polytrain.observe.redact`). ``redact=False``: the values as given,
        only for building a spec again in this process (never for anything written or shown)."""
        payload = schema.plain(self)
        return redacted(payload) if redact else payload

    def digest(self) -> str:
        """A short hash of everything that defines the training (not where it writes, nor a credential: one
        changed password resumes the same run, and no manifest holds a hash of one)."""
        payload = self.to_dict()
        for key in ("output", "checkpoint", "reliability", "logging", "profile", "elastic", "preemption", "preflight"):
            payload.pop(key, None)
        return schema.digest(payload)

    def model_digest(self) -> str:
        """A hash of what a checkpoint's tensors depend on: model, data and seed.

        Two specs with the same model digest can resume each other's checkpoints, on any
        backend and world size."""
        payload = self.to_dict()
        default = schema.plain(DataSpec(name=self.data.name))
        data = {k: v for k, v in payload["data"].items()
                if k not in READING_FIELDS and not (k in LATER_DATA_FIELDS and v == default[k])}
        return schema.digest({"model": payload["model"], "data": data, "seed": payload["seed"]})

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.output) / "checkpoints"

    @property
    def checks_finite(self) -> bool:
        """Whether the Trainer checks every step's gradients for NaN/Inf (reliability.on_nonfinite); fp16 runs
        skip overflowing steps through their loss scaler instead."""
        return self.precision != "fp16"


def field_paths() -> list[str]:
    """Every field of a spec as a dotted path (``loop.epochs``), tables included, for suggestions."""
    return schema.field_paths(TrainSpec)


def parse(raw: Mapping[str, Any], *, data_sources: Sequence[str]) -> TrainSpec:
    """A TrainSpec from plain data, each field checked on its own (type, range, choices); ``data_sources``: the
    values ``data.name`` takes (the registry's rows). The rules across fields and the names checked against
    the registry are `polytrain.validation`'s: load a spec through it."""
    if not isinstance(raw, Mapping):
        raise SpecError(f"spec: expected a table at the top level, got {type(raw).__name__}")
    return schema.build(TrainSpec, raw, "", choices={"data.name": tuple(data_sources)})
