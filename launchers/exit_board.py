"""The exit board: each rank's own word on how it ended, so that `polytrain launch` can name the rank that failed.

Under torchrun, mpirun, srun or deepspeed, `polytrain launch` supervises one process — the launcher —
and the exit code it sees is the launcher's, not the failed rank's. So for every run `polytrain launch`
makes a private directory (mode 0700, removed afterwards) and passes its path to the workers in
``POLYTRAIN_EXIT_BOARD``. Each polytrain worker (``polytrain train`` and the other commands of
``polytrain.cli``) writes ``rank-<N>.json`` there:

- when it starts: ``rank``, ``host``, ``pid``, ``start`` (wall-clock seconds);
- when it ends, cleanly or with an error: the same plus ``end``, ``code`` (its exit code), ``reason`` (the
  one-line error, or None) and ``peer_lost`` (true when the error only says that a collective lost a peer:
  this rank failed because another one did).

A rank with a start record and no end record ended without a word: a signal (SIGKILL, the out-of-memory
killer), or the launcher stopping it after another rank failed. While the launcher runs, a `DeathWatch`
notes when each such worker of this host disappears, so the first to die silently can be told from the
ones stopped after it.

The directory exists on this host only: ranks on other hosts find no board and write nothing (they are
known from the launcher's own output, see `failure_report`). Scripts that are not polytrain workers
write nothing either. Writes are atomic (a temporary file renamed over the record), and a worker never
fails because the board cannot be written.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BOARD_VARIABLE = "POLYTRAIN_EXIT_BOARD"
#: Where a worker finds its global rank: torchrun/deepspeed/local, Open MPI, MPICH/Intel MPI, PMIx, Slurm,
#: the horovodrun fallback, LSF's jsrun — the first one set wins.
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "HOROVOD_RANK",
                  "JSM_NAMESPACE_RANK")
REASON_LIMIT = 300
WATCH_SECONDS = 0.1


@dataclass(frozen=True)
class RankRecord:
    """What one rank wrote on the board."""

    rank: int
    host: str
    pid: int
    start: float
    end: float | None = None
    code: int | None = None
    reason: str | None = None
    peer_lost: bool = False

    @property
    def ended(self) -> bool:
        return self.end is not None


@contextmanager
def board() -> Iterator[Path]:
    """A fresh private board directory for one run; removed with everything in it afterwards."""
    path = Path(tempfile.mkdtemp(prefix="polytrain-launch-"))  # mkdtemp: mode 0700
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def worker_rank(env: Mapping[str, str]) -> int | None:
    for name in RANK_VARIABLES:
        value = env.get(name, "").strip()
        if value:
            return int(value) if value.isdigit() else None
    return None


def _record_path(env: Mapping[str, str]) -> Path | None:
    directory = env.get(BOARD_VARIABLE)
    rank = worker_rank(env)
    if not directory or rank is None or not os.path.isdir(directory):
        return None
    return Path(directory, f"rank-{rank}.json")


def _write(path: Path, fields: dict[str, object]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        temporary.write_text(json.dumps(fields))
        os.replace(temporary, path)
    except OSError:
        try:
            temporary.unlink()
        except OSError:
            pass


_started_at: dict[Path, float] = {}  # this process's start records: when each was written


def _fields(env: Mapping[str, str], path: Path) -> dict[str, object]:
    return {"rank": worker_rank(env), "host": socket.gethostname(), "pid": os.getpid(),
            "start": _started_at.get(path, time.time())}


def record_start(env: Mapping[str, str] | None = None) -> None:
    """Write this rank's start record (no-op unless this process runs under `polytrain launch` on its host)."""
    env = os.environ if env is None else env
    path = _record_path(env)
    if path is None:
        return
    _started_at[path] = time.time()
    _write(path, _fields(env, path))


def one_line(exc: BaseException) -> str:
    """An exception as one short line: polytrain's own errors as the CLI prints them, others with their type."""
    from polytrain.errors import TrainingFailure, UserError

    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if not isinstance(exc, (UserError, TrainingFailure)):
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 3] + "..."


def lost_a_peer(exc: BaseException) -> bool:
    """The error only says that a collective lost another rank (itself, or the error it was raised from)."""
    from polytrain.errors import is_peer_failure

    return is_peer_failure(exc) or (exc.__cause__ is not None and is_peer_failure(exc.__cause__))


def record_end(code: int, exc: BaseException | None = None, env: Mapping[str, str] | None = None) -> None:
    """Rewrite this rank's record with how it ended: exit ``code`` and, for a failure, the one-line reason."""
    env = os.environ if env is None else env
    path = _record_path(env)
    if path is None:
        return
    fields = _fields(env, path)
    fields.update(end=time.time(), code=int(code), reason=None if exc is None else one_line(exc),
                  peer_lost=bool(exc is not None and code and lost_a_peer(exc)))
    _write(path, fields)


def _parse(text: str) -> RankRecord | None:
    try:
        raw = json.loads(text)
        record = RankRecord(rank=int(raw["rank"]), host=str(raw["host"]), pid=int(raw["pid"]),
                            start=float(raw["start"]), end=None if raw.get("end") is None else float(raw["end"]),
                            code=None if raw.get("code") is None else int(raw["code"]),
                            reason=None if raw.get("reason") is None else str(raw["reason"]),
                            peer_lost=bool(raw.get("peer_lost", False)))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return record


def read_board(path: Path | str) -> dict[int, RankRecord]:
    """Every readable record on the board, by rank (a malformed or half-written file is skipped)."""
    records = {}
    try:
        files = sorted(Path(path).glob("rank-*.json"))
    except OSError:
        return {}
    for file in files:
        try:
            record = _parse(file.read_text())
        except OSError:
            continue
        if record is not None:
            records[record.rank] = record
    return records


def _ended(pid: int) -> tuple[bool, int | None]:
    """Whether ``pid`` has died, and the signal that killed it while that can still be read (an unreaped
    zombie's exit status, /proc/<pid>/stat field 52); None when it exited, or was reaped before we looked."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True, None
    except PermissionError:
        return False, None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False, None  # reaped while we looked: the next look sees it gone
    if not fields or fields[0] != "Z":
        return False, None
    status = int(fields[49]) if len(fields) > 49 and fields[49].isdigit() else 0
    return True, (status & 0x7F) or None


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` dies (Linux 5.3+), or None where there is none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class DeathWatch:
    """While the launcher runs: the moment each worker of this host that left no end record disappeared.

    ``deaths`` maps pid to that wall-clock time (a rank restarted by the launcher is a new pid) and
    ``signals`` pid to the signal that killed it, when it was seen dead but not yet reaped;
    `deaths_by_rank` and `signals_by_rank` give them by rank, to put the silent deaths in order (the first
    is the likely cause, the others were stopped after it). The watch waits on each worker's pidfd, so it
    wakes the moment a worker dies rather than at its next poll: a launcher that stops the other workers
    right after the first death (DeepSpeed's does, and says no rank) cannot make two deaths look
    simultaneous. Without pidfds it polls every ``interval`` seconds.
    """

    def __init__(self, path: Path | str, interval: float = WATCH_SECONDS) -> None:
        self.path = Path(path)
        self.interval = interval
        self.deaths: dict[int, float] = {}
        self.signals: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="polytrain-death-watch", daemon=True)
        self._host = socket.gethostname()
        self._poller: select.poll | None = None  # while the thread runs: pidfds and the wake pipe
        self._fds: dict[int, int] = {}  # pid -> its pidfd, while it lives
        self._wake = (-1, -1)

    def __enter__(self) -> DeathWatch:
        self._poller = select.poll()
        self._wake = os.pipe()  # written on exit: the watch stops waiting at once
        self._poller.register(self._wake[0], select.POLLIN)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        os.write(self._wake[1], b"x")
        self._thread.join()
        for pid in list(self._fds):
            self._forget(pid)
        for fd in self._wake:
            os.close(fd)
        self._poller = None
        self.look()

    def look(self) -> None:
        now = time.time()
        for record in read_board(self.path).values():
            pid = record.pid
            if pid in self.deaths or record.ended or record.host != self._host:
                continue
            if self._poller is not None and pid not in self._fds and (fd := _pidfd(pid)) is not None:
                self._fds[pid] = fd
                self._poller.register(fd, select.POLLIN)
            dead, sig = _ended(pid)
            if dead:
                self.deaths[pid] = now
                if sig is not None:
                    self.signals[pid] = sig
                self._forget(pid)

    def deaths_by_rank(self, records: Mapping[int, RankRecord]) -> dict[int, float]:
        return {rank: self.deaths[record.pid] for rank, record in records.items() if record.pid in self.deaths}

    def signals_by_rank(self, records: Mapping[int, RankRecord]) -> dict[int, int]:
        return {rank: self.signals[record.pid] for rank, record in records.items() if record.pid in self.signals}

    def _forget(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None and self._poller is not None:
            self._poller.unregister(fd)
            os.close(fd)

    def _watch(self) -> None:
        poller = self._poller
        assert poller is not None
        while not self._stop.is_set():
            self.look()
            poller.poll(self.interval * 1000)  # returns at once when a watched worker dies
