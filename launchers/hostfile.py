"""Host lists in the forms launchers speak, parsed into ``[(host, slots), ...]`` and written back.

Read: Open MPI hostfiles (``host slots=N [max_slots=M]``, ``#`` comments; a bare
``host`` has 1 slot, as in Horovod and MPICH; MPICH ``host:N`` lines are accepted
too) and Horovod ``-H h1:2,h2`` strings. A host listed twice gets the sum of its
slots, as in Open MPI. Written: Open MPI / DeepSpeed hostfiles, ``-H`` strings,
MPICH machinefiles, Slurm node lists. Every error is one line naming the source
and, for files, the line number.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from polytrain.errors import LaunchError

Host = tuple[str, int]

_HOST_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_KEYS = ("slots", "max_slots")


def _positive(value: str, what: str, where: str) -> int:
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise LaunchError(f"{where}: {what} must be a positive integer, got {value!r}")
    return int(value)


def _check_name(name: str, where: str) -> str:
    if not _HOST_NAME.match(name):
        raise LaunchError(f"{where}: bad host name {name!r} (letters, digits, '.', '-', '_')")
    return name


def _merge(pairs: Iterable[Host]) -> list[Host]:
    slots: dict[str, int] = {}
    for host, count in pairs:
        slots[host] = slots.get(host, 0) + count
    return list(slots.items())


def _host_colon_slots(entry: str, where: str) -> Host:
    name, sep, count = entry.partition(":")
    slots = _positive(count, "slots", where) if sep else 1
    return _check_name(name, where), slots


def parse_hosts_string(text: str, flag: str = "-H") -> list[Host]:
    """Horovod's ``h1:2,h2:4,h3`` (no ``:N`` means one slot)."""
    if not text.strip():
        raise LaunchError(f"{flag} is empty: give hosts as host1:slots,host2:slots")
    pairs = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            raise LaunchError(f"{flag} {text!r}: empty host entry (form: host1:slots,host2:slots)")
        pairs.append(_host_colon_slots(entry, f"{flag} {entry!r}"))
    return _merge(pairs)


def _parse_line(line: str, where: str) -> Host:
    tokens = line.split()
    if len(tokens) == 1 and ":" in tokens[0]:
        return _host_colon_slots(tokens[0], where)
    name = _check_name(tokens[0], where)
    fields: dict[str, int] = {}
    for token in tokens[1:]:
        key, sep, value = token.partition("=")
        key = key.replace("-", "_")
        if not sep:
            raise LaunchError(f"{where}: expected key=value after the host name, got {token!r}")
        if key not in _KEYS:
            raise LaunchError(f"{where}: unknown field {key!r} (allowed: {', '.join(_KEYS)})")
        if key in fields:
            raise LaunchError(f"{where}: {key} given twice")
        fields[key] = _positive(value, key, where)
    slots = fields.get("slots", 1)
    if fields.get("max_slots", slots) < slots:
        raise LaunchError(f"{where}: max_slots={fields['max_slots']} is less than slots={slots} "
                          f"(max_slots must be >= slots)")
    return name, slots


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[Host]:
    """Parse hostfile contents; ``source`` names the file in error messages."""
    pairs = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            pairs.append(_parse_line(line, f"{source} line {number}"))
    if not pairs:
        raise LaunchError(f"{source} names no hosts (expected lines like 'host slots=N')")
    return _merge(pairs)


def read_hostfile(path: str | Path) -> list[Host]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LaunchError(f"--hostfile {path}: cannot read it ({exc.strerror or exc})") from exc
    return parse_hostfile_text(text, f"hostfile {path}")


def to_hosts_string(hosts: Sequence[Host]) -> str:
    """Horovod / Open MPI ``-H`` form: ``h1:2,h2:1``."""
    return ",".join(f"{host}:{slots}" for host, slots in hosts)


def to_openmpi_hostfile(hosts: Sequence[Host]) -> str:
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts)


def to_deepspeed_hostfile(hosts: Sequence[Host]) -> str:
    """DeepSpeed reads the Open MPI form (``host slots=N``), one entry per host."""
    return to_openmpi_hostfile(hosts)


def to_mpich_hostfile(hosts: Sequence[Host]) -> str:
    """MPICH / Intel MPI hydra machinefile: ``host:N``."""
    return "".join(f"{host}:{slots}\n" for host, slots in hosts)


def to_slurm_nodelist(hosts: Sequence[Host]) -> str:
    return ",".join(host for host, _ in hosts)
