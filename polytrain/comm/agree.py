"""What the ranks must agree on: the same spec, code and libraries at start-up, and bit-identical replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polytrain.errors import TrainingFailure

if TYPE_CHECKING:
    from polytrain.protocols import Backend


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
    """Data-parallel replicas must hold bit-identical weights (``digest``: `polytrain.checkpoint.store.state_digest` of
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
