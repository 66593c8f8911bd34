"""The own-loop API's error (a `UserError`: one line, exit code 2 from the CLI)."""

from __future__ import annotations

from polytrain.errors import UserError


class OwnLoopError(UserError):
    """The own-loop API used out of order or with what it cannot take; the message is one line."""
