"""``polytrain launch -x NAME`` across two hosts over real ssh: every rank sees the value, and no process of
the machine (ssh clients, sshd's children, the guards, Open MPI's prted, Hydra's proxies, horovodrun's shells,
the ranks: the namespaces share one /proc) has it on its command line while the ranks run."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from jobs import launch, wait_no_processes
from mpich import mpich_unavailable

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

WORKER = str(Path(__file__).resolve().parents[1] / "multiproc" / "secret_worker.py")
LAUNCHES = {  # name: polytrain launch flags (after them: -H h1:1,h2:1)
    "torchrun": ["--launcher", "torchrun", "--master-port", "29411"],
    "deepspeed": ["--launcher", "deepspeed", "--master-port", "29412"],
    "mpirun": ["--launcher", "mpirun"],
    "horovodrun-gloo": ["--launcher", "horovodrun", "--gloo"],
    "hydra": ["--launcher", "mpirun", "--mpi-flavour", "hydra"],
}


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_a_forwarded_secret_reaches_both_hosts_and_no_command_line(cluster, tmp_path: Path, name: str) -> None:
    if name == "deepspeed":
        pytest.importorskip("deepspeed")
    extra: list[str] = []
    if name == "hydra":
        if why := mpich_unavailable():
            pytest.skip(f"no MPICH here: {why}")
        extra = ["--", "-launcher", "ssh", "-launcher-exec", str(cluster.bin / "ssh")]
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    job = launch(cluster, "launch", *LAUNCHES[name], "-H", "h1:1,h2:1", "-x", "POLYTRAIN_TEST_SECRET",
                 WORKER, str(tmp_path), *extra, env=cluster.env(POLYTRAIN_TEST_SECRET=secret)).check(240)
    reports = {path.name: json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))}
    assert sorted(report["host"] for report in reports.values()) == ["h1", "h2"], job.text()
    assert [report["secret"] for report in reports.values()] == [secret, secret]
    assert [report["holders"] for report in reports.values()] == [{}, {}]
    assert wait_no_processes(cluster) == {}, job.text()
