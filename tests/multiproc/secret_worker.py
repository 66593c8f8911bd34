"""``python secret_worker.py OUT``: one rank's report of ``POLYTRAIN_TEST_SECRET`` (tests of ``-x`` forwarding).

Writes ``OUT/rank<R>.json``: the value this rank sees, its host, and every process of the machine (read
while the launch that started this rank is running) whose command line holds the value."""

import json
import os
import socket
import sys
from pathlib import Path

RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK")

secret = os.environ.get("POLYTRAIN_TEST_SECRET", "")
rank = next(os.environ[name] for name in RANK_VARIABLES if name in os.environ)
holders = {}
for entry in Path("/proc").iterdir():
    try:
        words = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
    except OSError:
        continue
    if secret and any(secret.encode() in word for word in words):
        holders[entry.name] = b" ".join(words).decode(errors="replace")
report = {"secret": secret, "host": socket.gethostname(), "holders": holders}
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(report))
