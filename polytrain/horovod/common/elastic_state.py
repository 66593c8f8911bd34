"""The framework-neutral half of ``hvd.elastic.ObjectState``: plain values kept as attributes, saved,
restored, synced from rank 0 and reset, and the snapshot a restarted job reads back.

Each framework's ``ObjectState`` adds what differs: its broadcast and rank (given to ``__init__``), its
barrier (`_barrier`), how a commit reaches the disk (``commit``/``persist``) and how a commit file is
read back (`_read_state`). `retrying` is ``hvd.elastic.run`` for both frameworks: each names what counts as a
failed collective and how it restarts Horovod.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polytrain.environments.detect import restart_count
from polytrain.horovod.common import elastic_stop
from polytrain.horovod.common.elastic_files import state_dir
from polytrain.horovod.common.errors import HostsUpdatedInterrupt
from polytrain.spec.preemption import PREEMPTED_EXIT
from polytrain.train.preemption import NO_STOP

#: the host change's place in a commit's all-reduced notes (above any count of signalled ranks)
HOSTS_NOTE = 1 << 20


class ObjectStateBase:
    """Plain values kept in step across ranks and restored on failure; each one is an attribute."""

    _stop: Any = NO_STOP  # the preemption signals at work (`elastic_stop`), set by `retrying`
    _commits = 0

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int], **kwargs: Any) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._saved_state = kwargs
        self._reset_callbacks: list[Callable[[], None]] = []
        self._set_attrs()

    def _barrier(self) -> None:
        raise NotImplementedError

    def _sum(self, value: float) -> float:
        """``value`` summed over the ranks (a collective)."""
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

    def _size(self) -> int:
        """The number of ranks now."""
        raise NotImplementedError

    def _host_change(self) -> int | None:
        """Rank 0's view of the elastic driver's hosts since the group formed (0 none, 1 removed only, 2 added;
        other ranks 0), or None when no elastic driver runs the job."""
        return None

    def check_host_updates(self) -> None:
        """A sync point. Under polytrain's elastic driver it raises HostsUpdatedInterrupt on every rank once rank 0
        saw the driver's hosts change (``skip_sync`` when hosts were only removed), as Horovod's does. With
        preemption signals handled (`elastic_stop`) it raises `StoppedAtCommit` on every rank once one of them
        was signalled. Either way the ranks agree in one all-reduce of their notes (the count of signalled
        ranks, plus rank 0's host change times `HOSTS_NOTE`); with neither, it is a barrier."""
        change = self._host_change()
        if self._stop.spec is None and change is None:
            self._barrier()
            return
        self._commits += 1
        notes = int(self._sum(float(self._stop.asked + (change or 0) * HOSTS_NOTE)))
        signalled, hosts = notes % HOSTS_NOTE, notes // HOSTS_NOTE
        if signalled and change is not None and signalled < self._size():  # some hosts go: the rest go on
            if self._stop.asked:
                raise elastic_stop.LeftAtCommit
            hosts = max(hosts, 1)  # as hosts removed (added ones too: then the state is synced)
        elif self._stop.spec is not None:
            self._stop.heard(signalled, self._commits)
            if self._stop.due(self._commits):
                raise elastic_stop.StoppedAtCommit
        if hosts:
            raise HostsUpdatedInterrupt(skip_sync=hosts == 1)

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
        if self._rank() != 0 or (restart_count() == 0 and not elastic_stop.take_mark(state_dir())):
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
    collective rolls ``state`` back to its last commit (a HostsUpdatedInterrupt, raised at a commit, does not),
    ``restart()`` shuts Horovod down and initialises it again, the reset callbacks run, and it tries again. Any other exception ends the run. A preemption signal
    (`elastic_stop`) ends it at the next commit with exit code 75 on every rank."""

    @functools.wraps(func)
    def wrapper(state: ObjectStateBase, *args: Any, **kwargs: Any) -> Any:
        state._stop = stop = elastic_stop.start(state._rank())
        try:
            begin(state)
            skip_sync = False
            while True:
                if not skip_sync:
                    state.sync()
                try:
                    return func(state, *args, **kwargs)
                except HostsUpdatedInterrupt as interrupt:  # at a commit: nothing to roll back
                    skip_sync = interrupt.skip_sync
                except Exception as error:
                    if not failed(error):
                        raise
                    state.restore()
                    skip_sync = False
                restart()
                state.on_reset()
        except elastic_stop.LeftAtCommit:
            print(f"polytrain: rank {state._rank()}: preempted by {stop.signal}: left the elastic job after its "
                  "commit; the other ranks go on without it (exit code 75)", file=sys.stderr, flush=True)
            stop.stopped_at = state._commits  # on its way out: a signal meanwhile changes nothing (`close`)
            raise SystemExit(PREEMPTED_EXIT) from None
        except elastic_stop.StoppedAtCommit:
            if state._rank() == 0:
                elastic_stop.mark(state_dir())
            stopped = stop.end(None, resume=elastic_stop.RESUME)
            if stopped.show:
                print(f"polytrain: {stopped}", file=sys.stderr, flush=True)
            raise SystemExit(stopped.exit_code) from None
        finally:
            stop.close()
            state._stop = NO_STOP

    return wrapper
