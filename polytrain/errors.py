"""Errors a user can fix: the CLI prints them as one line and exits with code 2.

Every one reads with the credentials of the URIs it quotes masked (`polytrain.observe.redact`): a message may name a
spec value (a tracking URI with its password), and it is printed, logged and kept on the launcher's exit board.
"""

from __future__ import annotations

from polytrain.observe.redact import redact_text


class UserError(Exception):
    """Bad input (spec field, CLI flag, environment, file) — a one-line message, exit code 2.

    The message names the field or flag and what is allowed.
    """

    exit_code = 2

    def __str__(self) -> str:
        return redact_text(super().__str__())


class SpecError(UserError):
    """An invalid training specification."""


class EnvironmentDetectionError(UserError):
    """The launcher's environment variables contradict each other."""


class LaunchError(UserError):
    """A launcher cannot be built or started as asked."""


class BackendUnavailableError(UserError):
    """A backend or framework is asked for but is not installed/usable here."""


class RendezvousError(UserError):
    """The ranks could not meet: master unreachable, its port taken, fewer ranks than the world size."""


class OwnLoopError(UserError):
    """The own-loop API (`polytrain.torch`, `polytrain.tensorflow`) used out of order or with what it cannot
    take; the message is one line."""

    #: TensorFlow's AutoGraph passes an error with this attribute through as it is, instead of raising it again with
    #: the traced code's frames folded into its message: raised inside a ``tf.function`` it stays one line
    ag_pass_through = True


class TrainingFailure(Exception):
    """Training cannot go on (diverged, replicas drifted apart, ranks disagree): one line, exit code 1."""

    exit_code = 1

    def __str__(self) -> str:
        return redact_text(super().__str__())


class Preempted(Exception):
    """A signal stopped the run at a step every rank agreed on, its checkpoint written (the spec's ``preemption``
    table): not a failure, not a success. Exit code 75 (resumable); rank 0 prints the one line."""

    exit_code = 75

    def __init__(self, message: str, show: bool = True) -> None:
        super().__init__(message)
        self.show = show


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
