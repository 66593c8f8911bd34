"""What the Horovod-compatible APIs of every framework share.

Reduce-op constants with Horovod 0.28.1's values (``horovod/common/message.h``), the
topology Horovod reports (rank, local rank, cross rank, homogeneity) derived from
polytrain's `World`, the ``HOROVOD_*`` tuning variables with Horovod's defaults, the
stall-warning text, and the choice between the real ``horovod`` package and polytrain's
shim (``POLYTRAIN_HOROVOD_IMPL``). Imports no framework.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from polytrain.errors import BackendUnavailableError, UserError
from polytrain.world import World

# Horovod's ReduceOp enum values: scripts sometimes compare or serialise them as ints.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
REDUCE_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."

MiB = 1024 * 1024
#: Horovod 0.28.1 ``operations.cc``: ``SetTensorFusionThresholdBytes(128 * 1024 * 1024)``.
DEFAULT_FUSION_THRESHOLD = 128 * MiB
#: Horovod 0.28.1 ``operations.cc``: ``SetCycleTimeMs(1)``.
DEFAULT_CYCLE_TIME_MS = 1.0
#: Horovod 0.28.1 ``stall_inspector.h``: warning after 60 s, no shutdown unless set.
DEFAULT_STALL_CHECK_SECONDS = 60.0

IMPL_VARIABLE = "POLYTRAIN_HOROVOD_IMPL"
IMPL_CHOICES = ("auto", "shim", "horovod")
#: polytrain's own switch for the cross-rank metadata check of every collective (on by default).
METADATA_CHECK_VARIABLE = "POLYTRAIN_HOROVOD_METADATA_CHECK"


class HorovodEnvError(UserError):
    """A ``HOROVOD_*`` / ``POLYTRAIN_HOROVOD_*`` variable holds a value that is not allowed."""


def reduce_op_name(op: int) -> str:
    if op not in REDUCE_OP_NAMES:
        raise ValueError(f"op={op!r} is not a Horovod reduce op; use one of hvd.Average, hvd.Sum, "
                         "hvd.Min, hvd.Max, hvd.Product")
    return REDUCE_OP_NAMES[op]


# ----------------------------------------------------------------------------- topology

@dataclass(frozen=True)
class Topology:
    """Horovod's view of where a process sits.

    ``cross_rank``/``cross_size`` are Horovod's: the rank and size of the communicator of
    processes that share this process's local rank (one per node on homogeneous jobs).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool


def topology_from_world(world: World) -> Topology:
    """Topology from the launcher's World alone, assuming the same process count on every node.

    `topology_from_records` gives the exact answer once processes can exchange records.
    """
    return Topology(rank=world.rank, size=world.size, local_rank=world.local_rank,
                    local_size=world.local_size, cross_rank=world.node_rank, cross_size=world.num_nodes,
                    is_homogeneous=world.local_size * world.num_nodes == world.size)


def topology_from_records(records: Sequence[Sequence[int]], rank: int) -> Topology:
    """Exact topology from every rank's ``(node_rank, local_rank, local_size)``, indexed by rank."""
    node, local_rank, local_size = (int(v) for v in records[rank])
    peers = sorted(r for r, rec in enumerate(records) if int(rec[1]) == local_rank)
    node_sizes: dict[int, int] = {}
    for rec in records:
        node_sizes[int(rec[0])] = int(rec[2])
    return Topology(rank=rank, size=len(records), local_rank=local_rank, local_size=local_size,
                    cross_rank=peers.index(rank), cross_size=len(peers),
                    is_homogeneous=len(set(node_sizes.values())) == 1)


# ----------------------------------------------------------------------------- settings

def _read_float(env: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise HorovodEnvError(f"{name}={raw!r} is not a number; it must be a number >= {minimum:g}") from None
    if value < minimum:
        raise HorovodEnvError(f"{name}={raw!r} is below {minimum:g}; it must be a number >= {minimum:g}")
    return value


def _read_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on", "y"):
        return True
    if raw in ("0", "false", "no", "off", "n"):
        return False
    raise HorovodEnvError(f"{name}={env[name]!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


@dataclass(frozen=True)
class HorovodSettings:
    """The ``HOROVOD_*`` variables the shims honour, with Horovod 0.28.1's defaults."""

    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    cycle_time_ms: float = DEFAULT_CYCLE_TIME_MS
    stall_check: bool = True
    stall_check_seconds: float = DEFAULT_STALL_CHECK_SECONDS
    #: 0 means never shut down (Horovod's default); otherwise abort stalled ranks after this long.
    stall_shutdown_seconds: float = 0.0
    timeline: str | None = None
    metadata_check: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HorovodSettings:
        env = os.environ if env is None else env
        threshold = _read_float(env, "HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD)
        if threshold != int(threshold):
            raise HorovodEnvError(f"HOROVOD_FUSION_THRESHOLD={env['HOROVOD_FUSION_THRESHOLD']!r} "
                                  "is not a whole number of bytes; it must be an integer >= 0")
        timeline = env.get("HOROVOD_TIMELINE", "").strip() or None
        return cls(
            fusion_threshold=int(threshold),
            cycle_time_ms=_read_float(env, "HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_TIME_MS),
            stall_check=not _read_bool(env, "HOROVOD_STALL_CHECK_DISABLE", False),
            stall_check_seconds=_read_float(env, "HOROVOD_STALL_CHECK_TIME_SECONDS",
                                            DEFAULT_STALL_CHECK_SECONDS),
            stall_shutdown_seconds=_read_float(env, "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0),
            timeline=timeline,
            metadata_check=_read_bool(env, METADATA_CHECK_VARIABLE, True),
        )

    @property
    def shutdown_after(self) -> float | None:
        """Seconds after which a stalled collective aborts the job, or None (Horovod ignores a
        shutdown time shorter than the warning time)."""
        if self.stall_shutdown_seconds <= 0 or self.stall_shutdown_seconds < self.stall_check_seconds:
            return None
        return self.stall_shutdown_seconds


def stall_message(missing: Mapping[int, Iterable[str]], waited_seconds: float, shutdown: bool = False) -> str:
    """Horovod's stall warning: which ranks have not submitted which tensors.

    ``missing`` maps a global rank to the names of the tensors it has not submitted yet.
    """
    lines = [
        "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks "
        f"and are waiting for remainder of ranks for more than {waited_seconds:.0f} seconds. This may "
        "indicate that different ranks are trying to submit different tensors or that only subset of "
        "ranks is submitting tensors, which will cause deadlock.",
        "Missing ranks:",
    ]
    for rank in sorted(missing):
        names = sorted(missing[rank])
        shown = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
        lines.append(f"{rank}{'!' if shutdown else ''}: [{shown}]")
    if shutdown:
        lines.append(f"One or more rank (marked by \"!\") is stalled for longer than {waited_seconds:.0f} "
                     "seconds. Will shutdown.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- real Horovod or shim

def implementation(env: Mapping[str, str] | None = None) -> str:
    """The value of ``POLYTRAIN_HOROVOD_IMPL``: ``auto`` (default), ``shim`` or ``horovod``."""
    env = os.environ if env is None else env
    value = env.get(IMPL_VARIABLE, "").strip().lower() or "auto"
    if value not in IMPL_CHOICES:
        raise HorovodEnvError(f"{IMPL_VARIABLE}={env[IMPL_VARIABLE]!r} is not allowed; use one of "
                              f"{', '.join(IMPL_CHOICES)}")
    return value


@cache
def _import_error(module: str) -> str | None:
    """None when ``module`` imports; otherwise why not (one line)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken extension raises OSError/ImportError/RuntimeError alike
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


#: Launchers under which the real Horovod can form its job: it reads only horovodrun's and MPI's
#: variables, so under torchrun & co. every process would silently become a job of size 1.
HOROVOD_CAPABLE_LAUNCHERS = frozenset({"horovodrun-gloo", "horovodrun-mpi", "openmpi", "mpich", "intelmpi",
                                       "mvapich", "lsf", "single"})


def _launcher(env: Mapping[str, str] | None) -> str | None:
    from polytrain.environments import detect_world

    try:
        return detect_world(env).launcher
    except UserError:
        return None


def use_real_horovod(framework: str, env: Mapping[str, str] | None = None) -> bool:
    """True when scripts should get the real ``horovod.<framework>`` rather than polytrain's shim.

    ``framework`` is the module path below ``horovod`` (``torch``, ``tensorflow``,
    ``tensorflow.keras``, ``keras``). ``POLYTRAIN_HOROVOD_IMPL=shim`` never uses it and
    ``horovod`` requires it. ``auto`` (the default) uses it when it imports and the launcher
    is one it can run under (horovodrun, an MPI launcher, or a single process); under
    torchrun, the DeepSpeed launcher, Slurm's srun or polytrain's own launcher it uses the shim.
    """
    choice = implementation(env)
    if choice == "shim":
        return False
    if choice == "horovod":
        error = _import_error(f"horovod.{framework}")
        if error is not None:
            raise BackendUnavailableError(f"{IMPL_VARIABLE}=horovod but horovod.{framework} does not import "
                                          f"({error}); install Horovod (scripts/build_horovod.sh) or use auto/shim")
        return True
    launcher = _launcher(env)
    if launcher is not None and launcher not in HOROVOD_CAPABLE_LAUNCHERS:
        return False  # decided without importing Horovod (and its MPI library)
    return _import_error(f"horovod.{framework}") is None
