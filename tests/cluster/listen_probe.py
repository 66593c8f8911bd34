"""A callback for cluster jobs (``callbacks: ["listen_probe:Listening"]``, this folder on PYTHONPATH): at the
end of each validation — mid-run, while the rank's stores and collectives are up — a rank writes the TCP
sockets its own process listens on to ``<output>/listening-rank<r>.json``. Read from inside the rank, so a
job that finishes in a second is seen as surely as a slow one (polling from outside can miss it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hostnet import _decode_address, _socket_inodes


def own_listening() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on, from its namespace's /proc/net tables."""
    inodes = _socket_inodes([os.getpid()])
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                hexaddr, hexport = fields[1].split(":")
                found.append((_decode_address(hexaddr), int(hexport, 16)))
    return found


class Listening:
    def on_validation_end(self, run, epoch, logs) -> None:
        path = Path(run.spec.output, f"listening-rank{run.rank}.json")
        seen = {tuple(pair) for pair in json.loads(path.read_text())} if path.exists() else set()
        path.write_text(json.dumps(sorted(seen | set(own_listening()))))


def read(out: Path, rank: int) -> set[tuple[str, int]]:
    """What rank ``rank`` of the job that wrote to ``out`` listened on."""
    return {tuple(pair) for pair in json.loads((out / f"listening-rank{rank}.json").read_text())}
