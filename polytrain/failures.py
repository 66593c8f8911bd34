"""What the Trainer makes of things going wrong: a collective that lost its peers, an unwritable output."""

from __future__ import annotations

import os
from pathlib import Path

from polytrain.errors import SpecError

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


def check_writable_dir(field_name: str, path: Path) -> None:
    """Create ``path`` (rank 0, before any work) or fail in one line naming the spec field."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".polytrain-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise SpecError(f"{field_name}: cannot write to {path} ({exc.strerror or exc}); choose a writable "
                        "directory") from None
