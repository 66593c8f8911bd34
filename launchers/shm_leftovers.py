"""Shared-memory files a killed MPI job leaves in /dev/shm, removed once nothing uses them.

Open MPI's shared-memory transport backs each node's segment with a 16 MiB file
(``/dev/shm/sm_segment.<host>.<uid>.<job>.<n>``, ``vader_segment.*`` in older releases) that the ranks unlink
when they finalise. A rank killed by a signal never does, and the kernel does not remove the file: unless the
launcher does (Open MPI 5.0.11's mpirun was measured to, for ranks killed by SIGKILL; a singleton has no
launcher), every failed run leaks 16 MiB of RAM-backed storage until the machine reboots.

`polytrain launch --launcher mpirun` notes the files that exist before the job and, after it, removes the
new ones that no running process maps or holds open — a job still running beside it keeps its files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SHM = Path("/dev/shm")
PREFIXES = ("sm_segment.", "vader_segment.")


def present(prefixes: Iterable[str] = PREFIXES, where: Path = SHM) -> set[str]:
    """The names of this user's MPI segment files there now."""
    prefixes = tuple(prefixes)
    try:
        entries = list(os.scandir(where))
    except OSError:
        return set()
    uid = os.getuid()
    names = set()
    for entry in entries:
        try:
            if entry.name.startswith(prefixes) and entry.is_file(follow_symlinks=False) \
                    and entry.stat(follow_symlinks=False).st_uid == uid:
                names.add(entry.name)
        except OSError:
            continue
    return names


def in_use(where: Path = SHM) -> set[str]:
    """Names of files under ``where`` that some process this user can inspect maps or holds open."""
    prefix = f"{where}/"
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at >= 0:
                        used.add(line[at + len(prefix):].strip().removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target[len(prefix):])
        except OSError:  # it ended meanwhile, or is not ours to read
            continue
    return used


def remove_orphans(before: set[str], prefixes: Iterable[str] = PREFIXES, where: Path = SHM) -> list[str]:
    """Remove the segment files made since ``before`` that nothing uses any more; their names."""
    new = present(prefixes, where) - before
    if not new:
        return []
    removed = []
    for name in sorted(new - in_use(where)):
        try:
            (where / name).unlink()
            removed.append(name)
        except OSError:
            continue
    return removed
