"""Errors a user can fix: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (spec field, CLI flag, environment, file) — a one-line message, exit code 2.

    The message names the field or flag and what is allowed.
    """

    exit_code = 2


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
