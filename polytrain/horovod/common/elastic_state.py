"""The framework-neutral half of ``hvd.elastic.ObjectState``: plain values kept as attributes, saved,
restored, synced from rank 0 and reset, and the snapshot a restarted job reads back.

Each framework's ``ObjectState`` adds what differs: its broadcast and rank (given to ``__init__``), its
barrier (`_barrier`), how a commit reaches the disk (``commit``/``persist``) and how a commit file is
read back (`_read_state`). `retrying` is ``hvd.elastic.run`` for both frameworks: each names what counts as a
failed collective and how it restarts Horovod.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polytrain.environments.detect import restart_count
from polytrain.horovod.common.elastic_files import state_dir


class ObjectStateBase:
    """Plain values kept in step across ranks and restored on failure; each one is an attribute."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._saved_state = kwargs
        self._reset_callbacks: list[Callable[[], None]] = []
        self._set_attrs()

    def _barrier(self) -> None:
        raise NotImplementedError

    def _read_state(self, directory: Path) -> Any | None:
        raise NotImplementedError

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call after a reset (e.g. to rescale the learning rate to the new size)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def check_host_updates(self) -> None:
        """A sync point; Horovod also raises HostsUpdatedInterrupt here, but the shim's world
        changes only by a restart."""
        self._barrier()

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def reset(self) -> None:
        pass

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)

    # persistence across job restarts
    def snapshot(self) -> dict[str, Any]:
        return {"objects": self._saved_state}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        self._saved_state = dict(snapshot["objects"])
        self._set_attrs()

    def load_persisted(self) -> bool:
        """On rank 0 of a restarted job (`restart_count`), restore the last commit written; whether there was one."""
        if self._rank() != 0 or restart_count() == 0:
            return False
        snapshot = self._read_state(state_dir())
        if snapshot is None:
            return False
        self.load_snapshot(snapshot)
        return True


def retrying(func: Callable[..., Any], *, begin: Callable[[ObjectStateBase], object],
             failed: Callable[[BaseException], bool], restart: Callable[[], None]) -> Callable[..., Any]:
    """``hvd.elastic.run(func)``: ``begin(state)`` once (a restarted job restores its last commit), then each
    attempt syncs ``state`` from rank 0 and calls ``func(state, ...)``; an exception ``failed`` says is a failed
    collective rolls ``state`` back to its last commit, ``restart()`` shuts Horovod down and initialises it again,
    the reset callbacks run, and it tries again. Any other exception ends the run."""

    @functools.wraps(func)
    def wrapper(state: ObjectStateBase, *args: Any, **kwargs: Any) -> Any:
        begin(state)
        while True:
            state.sync()
            try:
                return func(state, *args, **kwargs)
            except Exception as error:
                if not failed(error):
                    raise
                state.restore()
            restart()
            state.on_reset()

    return wrapper
