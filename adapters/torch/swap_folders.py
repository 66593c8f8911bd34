"""ZeRO-Infinity's folders under ``deepspeed.nvme_path``: one per job, locked while the job lives
(`polytrain.adapters.torch.zero_infinity` says what goes in them and when).

A job's folder is ``polytrain-<digest of the output directory and the job's key>`` (`job_folder`; the key is rank
0's, random, the same on every rank). Its ``.polytrain-lock`` names the job's output, and every rank of the job
holds a shared ``flock`` on it (`hold`) until `remove`: the kernel lets go of it when a process dies, even by
SIGKILL, so a lock that can be taken exclusively is a dead job's. At start-up the first local rank of each node
makes and locks its folder, then looks at the others (`claim`): a locked one of the same output is a live job, and
this one is refused before anything is touched; a free one is a killed job's, and it is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

from polytrain.spec.tables import TrainSpec

SWAP_ROOT = "zero_stage_3"  # DeepSpeed's folder under the nvme_path it is given
LOCK = ".polytrain-lock"  # in a job's folder: its ranks hold a shared flock on it; it names the job's output


def job_folder(spec: TrainSpec, key: str = "") -> Path:
    """Where the offloaded files of the job ``key`` (`prepare`'s, the same on every rank) go: a folder of its own
    under ``deepspeed.nvme_path``, named after the output directory and the key (without a key: the output's
    alone, the folder older polytrain used)."""
    tag = hashlib.sha256((str(Path(spec.output).resolve()) + key).encode()).hexdigest()[:12]
    return Path(str(spec.deepspeed.nvme_path)).expanduser().resolve() / f"polytrain-{tag}"


#: the lock each rank of this process's job holds, by folder (`hold`, `remove`)
_held: dict[Path, int] = {}


def claim(folder: Path, spec: TrainSpec) -> str:
    """The first local rank of a node: make the job's ``folder`` and hold its lock; then, of the other folders under
    ``nvme_path`` that name this job's output, refuse this job when one is locked (a live job: nothing is touched)
    or else remove those whose lock is free (killed jobs), and the folder an older polytrain used. Returns the
    problem ("" for none)."""
    output = str(Path(spec.output).resolve())
    try:
        folder.mkdir(parents=True, exist_ok=True)
        hold(folder, output)
    except OSError as exc:
        verb = "create" if not folder.is_dir() else "write to"
        return f"cannot {verb} {folder} ({exc.strerror or exc}); choose a writable directory"
    live, dead = [], []
    for other in sorted(p for p in folder.parent.glob("polytrain-*") if p != folder and p.is_dir()):
        found = _look(other, output)
        if found is True:
            live.append(other)
        elif found is not None:
            dead.append((other, found))
    try:
        if live:
            return (f"{live[0]} holds the offloaded files of another job with output {output}, still running; wait "
                    "for it to end, or give this job another output")
        legacy = job_folder(spec)
        if legacy.is_dir() and not (legacy / LOCK).exists():  # an older polytrain's, keyed by the output alone
            shutil.rmtree(legacy / SWAP_ROOT, ignore_errors=True)
            with contextlib.suppress(OSError):
                legacy.rmdir()
        for other, _ in dead:
            shutil.rmtree(other, ignore_errors=True)  # a killed job's, removed under its lock
    finally:
        for _, fd in dead:
            os.close(fd)
    return ""


def hold(folder: Path, output: str | None) -> None:
    """Take a shared lock on ``folder``'s lock file for this rank, kept until `remove`; the first local rank writes
    the job's ``output`` into it (the same bytes from every node, where nodes share the drive)."""
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while another job's `claim` looks at a new, empty one
        if output is not None:
            data = json.dumps({"output": output}).encode()
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
    except OSError:
        os.close(fd)
        raise
    _held[folder] = fd


def _look(other: Path, output: str) -> bool | int | None:
    """Another job's folder as `claim` sees it: None when it is not of ``output`` (or has no lock file: one being
    made, or not polytrain's), True when its job is live, else (a killed job's) the descriptor of its lock, held."""
    try:
        fd = os.open(other / LOCK, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        free = True
    except OSError:
        free = False
    try:
        owner = json.loads(os.pread(fd, 1 << 16, 0)).get("output")
    except (OSError, ValueError, AttributeError):
        owner = None
    if owner != output or not free:
        os.close(fd)
        return None if owner != output else True
    return fd


def rank_files(folder: Path, rank: int) -> list[Path]:
    """This rank's offloaded files (optimizer state and parameters)."""
    return sorted(p for d in folder.glob(f"{SWAP_ROOT}/*/rank{rank}") for p in d.iterdir() if p.is_file())


def remove(folder: Path, rank: int) -> None:
    """This rank's files, and its lock let go; then the last rank to let go (the lock free) removes the folders
    left empty, the job's with its lock file — kept where a dead rank's files are left, for a restart (`claim`)."""
    for d in folder.glob(f"{SWAP_ROOT}/*/rank{rank}"):
        shutil.rmtree(d, ignore_errors=True)
    fd = _held.pop(folder, None)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    else:
        try:
            fd = os.open(folder / LOCK, os.O_RDWR)
        except OSError:
            fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: another rank still holds it
        for d in [*folder.glob(f"{SWAP_ROOT}/*"), folder / SWAP_ROOT]:
            with contextlib.suppress(OSError):
                d.rmdir()  # another rank's files are still there, or it is gone already
        if fd is not None and [p.name for p in folder.iterdir()] == [LOCK]:
            (folder / LOCK).unlink()
        folder.rmdir()
    except OSError:
        pass  # a rank of the job still holds the lock, or files are left
    finally:
        if fd is not None:
            os.close(fd)
