"""What the Trainer checks and makes of things going wrong: ranks that disagree at start-up, a collective that
lost its peers, an unwritable output."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from polytrain.errors import SpecError, TrainingFailure, UserError

if TYPE_CHECKING:
    from polytrain.protocols import Backend

# How gloo, NCCL and torch.distributed word a lost or stalled peer.
PEER_FAILURE_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Connection refused",
                        "Broken pipe", "Timed out", "timed out", "NCCL communicator was aborted",
                        "Socket Timeout", "connection was lost")


#: Exception types that mean a collective lost its peers: torch.distributed's, TensorFlow's collective
#: errors (a gRPC peer gone, a collective timed out or aborted) and Horovod's.
PEER_FAILURE_TYPES = ("DistBackendError", "UnavailableError", "DeadlineExceededError", "AbortedError",
                      "HorovodInternalError")


def is_peer_failure(exc: BaseException) -> bool:
    text = str(exc)
    return any(marker in text for marker in PEER_FAILURE_MARKERS) or type(exc).__name__ in PEER_FAILURE_TYPES


def peer_failure_detail(exc: BaseException) -> str:
    """The most telling line of a collective's error (TensorFlow's first line is only "Graph execution error:")."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    telling = [line for line in lines if any(marker in line for marker in PEER_FAILURE_MARKERS)]
    return (telling or lines or [type(exc).__name__])[0][:200]


def make_writable_dir(path: Path) -> None:
    """Create ``path`` (with its parents) and write and remove a probe file there; OSError if either fails.
    A real probe: ``os.access`` says yes to root even where nothing can be made (e.g. under /proc)."""
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".polytrain-write-test-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def check_writable_dir(field_name: str, path: Path) -> None:
    """Create ``path`` (rank 0, before any work) or fail in one line naming the spec field."""
    try:
        make_writable_dir(path)
    except OSError as exc:
        raise SpecError(f"{field_name}: cannot write to {path} ({exc.strerror or exc}); choose a writable "
                        "directory") from None


T = TypeVar("T")


def settled(backend: Backend, size: int, action: Callable[[], T]) -> T:
    """Run ``action`` on this rank, then let every rank learn whether any rank's action failed.

    For what one rank does alone (rank 0 writing a checkpoint, checking the output directory; one rank
    reading a file that another cannot): without this, the ranks that did not fail would wait in their next
    collective until its timeout. Returns this rank's result (only the outcome travels); when any rank
    failed, every rank raises the first failure's error, with its class and its one line, so all exit
    with the same reason and code. A failure that is not a `UserError`/`TrainingFailure`/`OSError` (a bug)
    still tells the others, and then propagates unchanged on its own rank.
    """
    mine: tuple[str, str] | None = None
    result = None
    try:
        result = action()
    except (UserError, TrainingFailure) as exc:
        mine, raised = (type(exc).__name__, str(exc)), exc
    except OSError as exc:
        mine, raised = ("TrainingFailure", f"{type(exc).__name__}: {exc}"), exc
    except Exception as exc:
        mine, raised = ("TrainingFailure", f"an internal error ({type(exc).__name__}: {exc})"), exc
    everyone = backend.all_gather_object(mine) if size > 1 else [mine]
    failed = [(rank, failure) for rank, failure in enumerate(everyone) if failure is not None]
    if mine is not None:
        raise raised
    if failed:
        rank, (kind, message) = failed[0]
        cls = _error_classes().get(kind, TrainingFailure)
        raise cls(" ".join(message.split()) if rank == 0 else f"rank {rank}: {' '.join(message.split())}")
    return result  # type: ignore[return-value]  # set whenever no rank failed


def _error_classes() -> dict[str, type[Exception]]:
    """polytrain's error classes by name (those defined anywhere that is imported, e.g. CheckpointError)."""
    found: dict[str, type[Exception]] = {}
    todo: list[type[Exception]] = [UserError, TrainingFailure]
    while todo:
        cls = todo.pop()
        found.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    return found


def check_ranks_agree(backend: Backend, mine: dict[str, Any]) -> None:
    """Every rank must run the same spec, model and libraries; a mismatch fails on every rank."""
    everyone = backend.all_gather_object(mine)
    for rank, theirs in enumerate(everyone):
        for key, value in theirs.items():
            if value != everyone[0][key]:
                raise TrainingFailure(
                    f"startup check: rank {rank}'s {key} ({value}) differs from rank 0's ({everyone[0][key]}); "
                    f"every rank must run the same spec, code and libraries")


def check_replicas_agree(backend: Backend, digest: str, step: int) -> None:
    """Data-parallel replicas must hold bit-identical weights (``digest``: `polytrain.checkpoint.state_digest` of
    this rank's); the ranks that drifted from rank 0's fail the run on every rank."""
    digests = backend.all_gather_object(digest)
    drifted = [rank for rank, d in enumerate(digests) if d != digests[0]]
    if drifted:
        raise TrainingFailure(f"step {step}: the weights of rank(s) {', '.join(map(str, drifted))} differ from "
                              f"rank 0's (replicas drifted apart; reliability.verify_every_n_steps)")


def library_versions() -> dict[str, str]:
    """Installed versions of a fixed list of libraries (read from metadata, so no rank's own imports matter)."""
    import importlib.metadata
    import sys

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "tensorflow", "tensorflow-cpu", "keras", "deepspeed", "horovod", "numpy", "mpi4py"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out
