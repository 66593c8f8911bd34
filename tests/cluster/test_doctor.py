"""``polytrain doctor`` on three namespace hosts, one rank each, under torchrun over ssh (issue 52): with the link
between h1 and h2 capped (htb, only that pair's traffic), the check names exactly that link; with h3's CPU cut to
1 % of a core (a cgroup quota, set once its rank has joined the job: from its start it would take minutes to import
torch; the multiply is sustained 5 s, so a quota set up to ~1 s late still leaves the rank far below), it names
exactly h3's rank. Each run exits 1 with its findings, one line each, and leaves nothing behind.

The medians make both robust to a loaded machine: of three links (or ranks) with one sick, the median is a healthy
one's, and no healthy one can fall below a fifth (``--min-ratio 0.2``) of the slower healthy one; the sick ones are
~100 times off."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from jobs import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(540)]

CPU = Path("/sys/fs/cgroup/cpu")
HOSTS = "h1:1,h2:1,h3:1"


def doctor(cluster3, tmp_path: Path, *extra: str):
    out = tmp_path / "doctor.json"
    job = launch(cluster3, "doctor", "-np", "3", "-H", HOSTS, "--launcher", "torchrun", "--min-ratio", "0.2",
                 "--json", str(out), *extra)
    return job, out


def findings(job) -> list[str]:
    return [line.removeprefix("polytrain doctor: ") for line in job.stderr.splitlines()
            if line.startswith("polytrain doctor: ")]


def test_a_capped_link_is_named_and_nothing_else(cluster3, tmp_path: Path) -> None:
    h1, h2, _ = cluster3.hosts
    h1.rate_limit_with(h2.addr, "40mbit")
    try:
        job, out = doctor(cluster3, tmp_path)
        code = job.wait(360)
    finally:
        h1.netem(None)
    named = findings(job)
    assert code == 1 and len(named) == 1, job.text()
    assert named[0].startswith("link rank 0 (h1) <-> rank 1 (h2): "), named
    report = json.loads(out.read_text())
    assert report["findings"] == named and [r["host"] for r in report["ranks"]] == ["h1", "h2", "h3"]
    assert "rank  host  GEMM GFLOP/s" in job.stdout
    assert not cluster3.leftovers()


def _rank_joined(host) -> bool:
    """Whether the doctor's rank on ``host`` (not its launcher) holds an established TCP connection: it has
    imported torch and is joining the job."""
    from hostnet import _socket_inodes

    ranks = [pid for pid, cmd in host.commands().items()
             if "health.py" in cmd and not any(mark in cmd.split("health.py")[0] for mark in ("torchrun", "ssh"))]
    if not ranks:
        return False
    inodes = _socket_inodes(ranks)
    table = host.run(["cat", "/proc/net/tcp", "/proc/net/tcp6"]).stdout.splitlines()
    return any(len(f := line.split()) > 9 and f[3] == "01" and f[9] in inodes for line in table)


def _move(pids: list[int], group: Path) -> None:
    for pid in pids:
        try:
            (group / "cgroup.procs").write_text(str(pid))
        except OSError:  # it ended meanwhile
            continue


@pytest.mark.skipif(not (CPU / "cgroup.procs").exists() or os.geteuid() != 0,
                    reason="no writable cgroup v1 cpu hierarchy here")
def test_a_rank_whose_cpu_is_cut_is_named_and_nothing_else(cluster3, tmp_path: Path) -> None:
    h3 = cluster3.hosts[2]
    group = CPU / f"{cluster3.tag}-doctor"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("1000")  # 1 % of a core
        job, out = doctor(cluster3, tmp_path, "--gemm-seconds", "5")  # ~4 min in all, mostly h3 waiting on its
        # quota (~2 s of CPU after joining: its measurements, then two interpreters with torch ending): little CPU
        deadline = time.monotonic() + 240
        while not _rank_joined(h3):
            if job.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"h3's rank never joined the job\n{job.text()}")
            time.sleep(0.05)
        _move(h3.pids(), group)  # what runs on h3 from now on: its matrix multiply among it
        code = job.wait(420)
    finally:
        _move([int(pid) for pid in (group / "cgroup.procs").read_text().split()], CPU)
        group.rmdir()
    named = findings(job)
    assert code == 1 and len(named) == 1, job.text()
    assert named[0].startswith("rank 2 on host h3: matrix multiply at "), named
    ranks = json.loads(out.read_text())["ranks"]
    assert ranks[2]["gemm_gflops"] < 0.2 * min(ranks[0]["gemm_gflops"], ranks[1]["gemm_gflops"])
    assert not cluster3.leftovers()
