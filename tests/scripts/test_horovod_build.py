"""The real Horovod that scripts/build_horovod.sh installs; skipped when it is not installed.

Every check runs the installed Horovod in a subprocess (so TensorFlow is not
imported into the test process): both framework bindings load, report MPI and
Gloo support, ``horovodrun --check-build`` agrees, and two ranks started by
``horovodrun --gloo`` really allreduce.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from procs import check, loopback_env, run

if getattr(importlib.util.find_spec("horovod"), "origin", None) is None:  # tests/horovod is a namespace, not it
    pytest.skip("Horovod is not installed (scripts/build_horovod.sh builds it)", allow_module_level=True)

HOROVODRUN = Path(sys.executable).parent / "horovodrun"

REPORT_BUILD = """
import json
import horovod.torch as hvd_torch
import horovod.tensorflow as hvd_tf
print(json.dumps({
    name: {"mpi": mod.mpi_built(), "gloo": mod.gloo_built()}
    for name, mod in (("torch", hvd_torch), ("tensorflow", hvd_tf))
}))
"""

TORCH_ALLREDUCE = """
import horovod.torch as hvd
import torch
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
print(f"RESULT rank={hvd.rank()} size={hvd.size()} sum={total.item():g}", flush=True)
"""


def check_build_sections(text: str) -> dict[str, set[str]]:
    """Map each ``Available ...:`` heading of ``--check-build`` to the items marked [X]."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        heading = re.match(r"Available (.+):$", line.strip())
        if heading:
            current = sections.setdefault(heading.group(1), set())
        elif current is not None and (item := re.match(r"\s*\[X\] (.+)$", line)):
            current.add(item.group(1).strip())
    return sections


@pytest.mark.slow
def test_bindings_import_with_mpi_and_gloo() -> None:
    result = check(run([sys.executable, "-c", REPORT_BUILD], timeout=180))
    built = json.loads(result.stdout.strip().splitlines()[-1])
    assert built == {
        "torch": {"mpi": True, "gloo": True},
        "tensorflow": {"mpi": True, "gloo": True},
    }


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_check_build_lists_frameworks_and_controllers() -> None:
    # --check-build imports every framework in several subprocesses: ~70 s idle, >2 min under load.
    assert HOROVODRUN.is_file(), f"horovodrun is not next to {sys.executable}"
    result = check(run([str(HOROVODRUN), "--check-build"], timeout=400))
    sections = check_build_sections(result.stdout)
    assert {"PyTorch", "TensorFlow"} <= sections["Frameworks"], result.stdout
    assert {"MPI", "Gloo"} <= sections["Controllers"], result.stdout
    assert {"MPI", "Gloo"} <= sections["Tensor Operations"], result.stdout


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_horovodrun_gloo_two_ranks_allreduce() -> None:
    cmd = [str(HOROVODRUN), "-np", "2", "-H", "localhost:2", "--gloo", "--network-interface", "lo",
           sys.executable, "-c", TORCH_ALLREDUCE]
    result = check(run(cmd, timeout=200, env=loopback_env()))
    lines = sorted(set(re.findall(r"RESULT rank=\d size=\d sum=\S+", result.stdout)))
    assert lines == ["RESULT rank=0 size=2 sum=3", "RESULT rank=1 size=2 sum=3"], result.stdout
