"""The own-loop API's error (a `UserError`: one line, exit code 2 from the CLI), shared with
`polytrain.tensorflow`: it lives in `polytrain.errors`, which imports no framework."""

from __future__ import annotations

from polytrain.errors import OwnLoopError

__all__ = ["OwnLoopError"]
