"""Where the elastic driver's hosts come from: a discovery script run at a fixed interval, or ``-H``'s list.

A discovery script is an executable printing one ``HOST`` or ``HOST:SLOTS`` per line (Horovod's format;
``HOST`` alone has ``--slots-per-host`` slots, 1 when that is not given). Each run is bounded
(`script_timeout_s`); its output must be all well-formed lines. A bad first run is bad input (exit 2, one
line naming the script and what is wrong); a later bad run is reported on stderr and the hosts stay as they were.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Mapping

HOST_PATTERN = re.compile(r"^[\w.\-]+$")
INTERVAL_VARIABLE = "POLYTRAIN_ELASTIC_DISCOVERY_INTERVAL"
SCRIPT_TIMEOUT_VARIABLE = "POLYTRAIN_ELASTIC_DISCOVERY_TIMEOUT"
DEFAULT_INTERVAL_S = 1.0
DEFAULT_SCRIPT_TIMEOUT_S = 30.0


class DiscoveryError(Exception):
    """The discovery script cannot be run or its output is not host lines: one line naming it."""


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DiscoveryError(f"{name}={raw!r} must be a number of seconds > 0")
    return value


def interval_s() -> float:
    """Seconds between two discoveries (``POLYTRAIN_ELASTIC_DISCOVERY_INTERVAL``, default 1: Horovod's)."""
    return _seconds(INTERVAL_VARIABLE, DEFAULT_INTERVAL_S)


def script_timeout_s() -> float:
    """The longest a discovery script may run (``POLYTRAIN_ELASTIC_DISCOVERY_TIMEOUT``, default 30 s)."""
    return _seconds(SCRIPT_TIMEOUT_VARIABLE, DEFAULT_SCRIPT_TIMEOUT_S)


def parse_line(line: str, default_slots: int | None, where: str) -> tuple[str, int]:
    """``HOST`` or ``HOST:SLOTS`` -> (host, slots); DiscoveryError naming the line otherwise."""
    host, sep, slots = line.rpartition(":")
    if not sep:
        host = line
    malformed = f"{where} printed a malformed line {line!r}: expected HOST or HOST:SLOTS (SLOTS a whole number >= 1)"
    if not host or not HOST_PATTERN.match(host):
        raise DiscoveryError(malformed)
    if not sep:
        return host, default_slots or 1
    if not slots.isascii() or not slots.isdigit() or int(slots) < 1:
        raise DiscoveryError(malformed)
    return host, int(slots)


def parse_output(text: str, default_slots: int | None, where: str) -> dict[str, int]:
    """Every non-empty line as host -> slots (a host listed twice: its last line)."""
    hosts: dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line:
            host, slots = parse_line(line, default_slots, where)
            hosts[host] = slots
    return hosts


class ScriptDiscovery:
    """Runs ``script`` (an executable file) and parses what it prints."""

    def __init__(self, script: str, default_slots: int | None = None, timeout_s: float | None = None) -> None:
        self.script = script
        self.default_slots = default_slots
        self.timeout_s = script_timeout_s() if timeout_s is None else timeout_s

    def check(self) -> None:
        """The script is there and executable (DiscoveryError otherwise)."""
        where = f"--host-discovery-script {self.script}"
        if not os.path.exists(self.script):
            raise DiscoveryError(f"{where}: no such file")
        if os.path.isdir(self.script) or not os.access(self.script, os.X_OK):
            raise DiscoveryError(f"{where}: not an executable file (chmod +x it)")

    def find(self) -> dict[str, int]:
        """One run: host -> slots."""
        self.check()
        where = f"--host-discovery-script {self.script}"
        proc = subprocess.Popen([os.path.abspath(self.script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise DiscoveryError(f"{where} ran longer than {self.timeout_s:g} s (set {SCRIPT_TIMEOUT_VARIABLE} "
                                 f"for a slower one)") from None
        except BaseException:
            _kill_group(proc)
            raise
        if proc.returncode != 0:
            last = (err.decode(errors="replace").strip().splitlines() or [""])[-1]
            raise DiscoveryError(f"{where} failed with exit code {proc.returncode}" + (f": {last}" if last else ""))
        return parse_output(out.decode(errors="replace"), self.default_slots, where)


class FixedDiscovery:
    """``-H``'s hosts, always the same."""

    def __init__(self, hosts: Mapping[str, int]) -> None:
        self.hosts = dict(hosts)

    def check(self) -> None:
        return None

    def find(self) -> dict[str, int]:
        return dict(self.hosts)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
