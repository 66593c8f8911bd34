"""Under torchrun, the start-up line names every socket torchrun listens on, as bound (issue 48 item 19).

``polytrain launch --launcher torchrun`` runs a 2-rank job whose rank 0 stops in ``on_train_start`` (a callback
reading a FIFO the test writes only when it is done looking). Meanwhile the test reads, from /proc, every TCP
socket each process of the job listens on: torchrun's own process listens on two, both on every interface (its
c10d rendezvous at ``--rdzv_endpoint`` and its agent store at MASTER_PORT). The line rank 0 printed (and its
``rendezvous`` record in metrics.jsonl) must name exactly those two, each on all interfaces: it used to name one
of them as ``127.0.0.1:PORT``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from procs import _kill_tagged, _tagged, free_port, loopback_env, read_metrics

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

pytest.importorskip("torch")

MARK = "PAUSED-FOR-THE-PROBE"

CALLBACK = f"""\
import os


class Pause:
    def on_train_start(self, run):
        if os.environ.get("RANK") == "0":
            fd = os.open(os.environ["PROBE_FIFO"], os.O_RDWR)  # read-write: blocks on read until the test writes
            print("{MARK}", flush=True)
            os.read(fd, 1)
            os.close(fd)
"""

SPEC = """\
framework: torch
backend: ddp
model: {{name: mlp, params: {{hidden_sizes: [8]}}}}
data: {{name: digits, batch_size: 64}}
loop: {{epochs: 1, max_steps: 1}}
callbacks: ["pause_probe:Pause"]
output: {output}
"""


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def listening(pid: int) -> set[tuple[str, int]]:
    """(address as /proc/net writes it, port) of every TCP socket ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.add((address, int(port, 16)))
    return found


def test_the_start_up_line_names_both_of_torchruns_listening_sockets(tmp_path: Path) -> None:
    fifo, out, port = tmp_path / "go", tmp_path / "out", free_port()
    os.mkfifo(fifo)
    (tmp_path / "pause_probe.py").write_text(CALLBACK)
    (tmp_path / "spec.yaml").write_text(SPEC.format(output=out))
    token = uuid.uuid4().hex
    env = loopback_env(PROBE_FIFO=str(fifo), PYTHONPATH=str(tmp_path), POLYTRAIN_TEST_TOKEN=token)
    command = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "torchrun", "-np", "2",
               "--master-port", str(port), str(tmp_path / "spec.yaml")]
    with (tmp_path / "stderr").open("w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                start_new_session=True)
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # until rank 0 waits in its callback (EOF: the job ended first)
            seen.append(line)
            if MARK in line:
                break
        assert seen and MARK in seen[-1], "".join(seen) + (tmp_path / "stderr").read_text()
        job = {pid: listening(pid) for pid in descendants(proc.pid)}
        [agent] = [pid for pid in job if any(Path(arg).name == "torchrun" for arg in
                                             Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:2])]
        go = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the callback holds the FIFO open: this cannot block
        os.write(go, b"x")
        os.close(go)
        proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = _tagged(token)
        _kill_tagged(token)
    stderr_text = (tmp_path / "stderr").read_text()
    assert proc.returncode == 0 and left == {}, stderr_text
    sockets = job[agent]
    assert len(sockets) == 2 and all(set(address) == {"0"} for address, _ in sockets), sockets  # both on *
    rendezvous = f"all interfaces, port {port} (torchrun's c10d rendezvous, --rdzv_endpoint)"
    [store] = [f"all interfaces, port {p} (torchrun's agent store, MASTER_PORT)" for _, p in sockets if p != port]
    said = f"{rendezvous} and {store}; torchrun binds them, polytrain does not control them"
    assert f"polytrain: rendezvous listens on {said}\n" in stderr_text, stderr_text
    assert [r["listen"] for r in read_metrics(out, "rendezvous")] == [said]
