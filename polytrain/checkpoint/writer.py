"""A checkpoint write on a thread of its own (``checkpoint.async_save``): the training loop hands over the state it
has already copied out (numpy arrays and a manifest, nothing the loop goes on changing) and trains on while the
files are written, hashed, fsynced and committed by `polytrain.checkpoint.store.save_checkpoint`'s atomic rename.

One write at a time: the next save, and the end of the run, first wait for this one (`BackgroundWrite.result`);
its failure is raised there, where `polytrain.comm.settle.settled` tells every rank. A process killed mid-write
leaves only the write's temporary directory: the previous checkpoint stays the newest complete one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


class BackgroundWrite:
    """``write`` started on a non-daemon thread (the interpreter waits for it, so a run that returns leaves no write
    half done); `result` joins it and returns the directory written, or raises what the write raised."""

    def __init__(self, write: Callable[[], Path], step: int, state: tuple[dict[str, Any], dict[str, Any]]) -> None:
        #: the arrays being written (model, optimizer): the next save may fill them once this write is done
        self.state = state
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"polytrain-checkpoint-{step}")
        self._thread.start()

    def _run(self, write: Callable[[], Path]) -> None:
        try:
            self._path = write()
        except BaseException as exc:  # noqa: BLE001 - raised again on the training thread, in `result`
            self._error = exc

    def result(self) -> Path:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path

    def wait_quietly(self) -> None:
        """Join without raising (a run already failing: the write ends or fails on its own)."""
        self._thread.join()
