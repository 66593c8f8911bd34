"""The exceptions of the Horovod-compatible APIs, shared by every framework.

Each is also the built-in exception Horovod raises in its place, so ``except ValueError`` or
``except hvd.HorovodInternalError`` in a script keeps working.
"""

from __future__ import annotations

from polytrain.errors import UserError


class HorovodEnvError(UserError):
    """A ``HOROVOD_*`` / ``POLYTRAIN_HOROVOD_*`` variable holds a value that is not allowed."""


class HorovodArgumentError(UserError, ValueError):
    """A Horovod call got an argument Horovod rejects too (also a ``ValueError``, as in Horovod)."""


class HorovodUnsupportedError(UserError, NotImplementedError):
    """A Horovod feature polytrain does not provide here (also a ``NotImplementedError``)."""


class HorovodInternalError(RuntimeError):
    """A collective failed (Horovod's name, so ``except hvd.HorovodInternalError`` keeps working)."""


class HostsUpdatedInterrupt(RuntimeError):
    """The elastic driver's hosts changed; raised on every rank at a commit or ``check_host_updates``, so that
    ``hvd.elastic.run`` re-forms the group with the new workers (Horovod's name). ``skip_sync`` as Horovod's:
    hosts were only removed, so no newcomer needs the survivors' state (nothing is rolled back either way)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the elastic driver's hosts changed")
        self.skip_sync = skip_sync
