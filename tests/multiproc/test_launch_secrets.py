"""``polytrain launch -x NAME`` forwards a secret by name: every rank sees its value, while no process on this
host — the launcher, its daemons, shells, the ranks — has it on its command line (``/proc/<pid>/cmdline`` is
readable by every user), looked at from inside the ranks while everything the launch started is running."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from procs import check, loopback_env, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

WORKER = Path(__file__).resolve().parent / "secret_worker.py"

LAUNCHES = {  # name: polytrain launch flags
    "local": ["--launcher", "local"],
    "torchrun": ["--launcher", "torchrun"],
    "mpirun": ["--launcher", "mpirun"],
    "deepspeed": ["--launcher", "deepspeed"],
    "horovodrun-gloo": ["--launcher", "horovodrun", "--gloo"],
    "horovodrun-mpi": ["--launcher", "horovodrun", "--mpi"],
}


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_a_forwarded_secret_reaches_every_rank_and_no_command_line(tmp_path: Path, name: str) -> None:
    if name == "deepspeed":
        pytest.importorskip("deepspeed")
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    done = check(run([sys.executable, "-m", "polytrain.cli", "launch", *LAUNCHES[name], "-np", "2",
                      "-x", "POLYTRAIN_TEST_SECRET", str(WORKER), str(tmp_path)],
                     env=loopback_env(POLYTRAIN_TEST_SECRET=secret), timeout=240))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [report["secret"] for report in reports] == [secret, secret], done.stderr
    assert [report["holders"] for report in reports] == [{}, {}]
    assert done.left_behind == []
