"""The Horovod-style example scripts run unchanged under mpirun, torchrun and horovodrun."""

import re
import shutil
import sys

import pytest
from hvd_launch import REPO, launch
from procs import BIN, check, loopback_env, run

pytestmark = pytest.mark.multiproc

DIGITS = REPO / "examples" / "horovod" / "pytorch_digits.py"
SYNTHETIC = REPO / "examples" / "horovod" / "pytorch_synthetic_benchmark.py"


def final_accuracy(stdout):
    match = re.search(r"final val accuracy (\d\.\d+) on 2 workers", stdout)
    assert match, stdout[-2000:]
    return float(match.group(1))


@pytest.mark.timeout(400)
def test_digits_reaches_95_percent_under_mpirun_and_torchrun_alike():
    by_mpirun = final_accuracy(launch("mpirun", 2, DIGITS).stdout)
    by_torchrun = final_accuracy(launch("torchrun", 2, DIGITS).stdout)
    assert by_mpirun >= 0.95
    assert by_torchrun == by_mpirun  # same seeds, same shards: the launcher changes nothing


@pytest.mark.timeout(300)
def test_digits_under_horovodrun_gloo():
    horovodrun = shutil.which("horovodrun", path=str(BIN))
    if horovodrun is None:  # horovodrun's variables and rendezvous server, without Horovod installed
        stdout = launch("horovodrun-env", 2, DIGITS, "--epochs", "4").stdout
    else:
        env = loopback_env(POLYTRAIN_HOROVOD_IMPL="shim")
        env.pop("MASTER_ADDR")
        stdout = check(run([horovodrun, "-np", "2", "--gloo", "--network-interface", "lo", sys.executable,
                            str(DIGITS), "--epochs", "4"], env=env)).stdout
    assert final_accuracy(stdout) >= 0.85


@pytest.mark.timeout(300)
def test_synthetic_benchmark_reports_throughput():
    stdout = launch("torchrun", 2, SYNTHETIC, "--num-iters", "2", "--num-batches-per-iter", "2",
                    "--batch-size", "8").stdout
    per_worker = re.search(r"Img/sec per worker: (\d+\.\d)", stdout)
    total = re.search(r"Total img/sec on 2 worker\(s\): (\d+\.\d)", stdout)
    assert per_worker and total, stdout
    assert float(total.group(1)) == pytest.approx(2 * float(per_worker.group(1)), abs=0.11)
    assert float(per_worker.group(1)) > 0
