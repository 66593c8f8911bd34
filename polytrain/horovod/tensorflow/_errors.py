"""Errors of the Horovod-compatible TensorFlow API: user errors that are also Horovod's exception types."""

from __future__ import annotations

from polytrain.errors import UserError


class HorovodArgumentError(UserError, ValueError):
    """A Horovod call got an argument Horovod rejects too (also a ``ValueError``, as in Horovod)."""


class HorovodUnsupportedError(UserError, NotImplementedError):
    """A Horovod feature polytrain does not provide here (also a ``NotImplementedError``)."""
