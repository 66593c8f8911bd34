"""A hand-written loop on `polytrain.torch.Distributed` (tests/multiproc/own_loop_worker.py) on 2 ranks under
real launchers equals the same loop in one process: every micro-step's loss and the final weights, with
accumulation and clipping, on ddp and fsdp under torchrun, mpi under mpirun and the Horovod shim under mpirun."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from procs import check, command, job_env, run

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

WORKER = str(Path(__file__).resolve().parent / "own_loop_worker.py")
JOBS = {  # backend: (launcher, environment)
    "ddp": ("torchrun", {}),
    "fsdp": ("torchrun", {}),
    "mpi": ("mpirun", {"MASTER_ADDR": None}),
    "horovod": ("mpirun", {"MASTER_ADDR": None, "POLYTRAIN_HOROVOD_IMPL": "shim"}),
}


def loop_run(tmp_path: Path, backend: str, launcher: str, nproc: int, env: dict[str, str | None]) -> dict:
    out = tmp_path / f"{backend}-{nproc}.json"
    exports = [name for name, value in env.items() if value is not None]
    done = check(run(command(launcher, [WORKER, backend, str(out)], nproc, exports=exports), env=job_env(env),
                     timeout=240))
    assert not done.left_behind, done.left_behind
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return loop_run(tmp_path_factory.mktemp("one"), "local", "python", 1, {})


@pytest.mark.parametrize("backend", list(JOBS))
def test_two_ranks_equal_one_process(one_process: dict, tmp_path: Path, backend: str) -> None:
    launcher, env = JOBS[backend]
    got = loop_run(tmp_path, backend, launcher, 2, env)
    assert (got["backend"], got["world"]) == (backend, 2)
    assert len(got["losses"]) == len(one_process["losses"]) == 40  # 20 updates of 2 micro-steps
    assert max(one_process["norms"]) > 0.5  # the clip at 0.5 bit on some updates
    np.testing.assert_allclose(got["losses"], one_process["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["norms"], one_process["norms"], rtol=1e-5)
    assert got["weights"].keys() == one_process["weights"].keys()
    for name, values in one_process["weights"].items():
        np.testing.assert_allclose(got["weights"][name], values, rtol=1e-5, atol=1e-6, err_msg=name)


GATHER = str(Path(__file__).resolve().parent / "gather_worker.py")


@pytest.mark.parametrize(("backend", "nproc"), [("ddp", 3), ("mpi", 2)])
def test_gather_for_metrics_is_exact_on_an_uneven_set(tmp_path: Path, backend: str, nproc: int) -> None:
    """11 samples on 3 (or 2) ranks: the samplers add copies to even the shares out; what `gather_for_metrics`
    returns is each sample once, in the order one process reads them, each epoch."""
    launcher, env = JOBS[backend]
    outs = {}
    for n in (1, nproc):
        out = tmp_path / f"gather-{n}.json"
        exports = [name for name, value in env.items() if value is not None]
        done = check(run(command("python" if n == 1 else launcher, [GATHER, "local" if n == 1 else backend,
                                                                    str(out)], n, exports=exports),
                         env=job_env(env), timeout=120))
        assert not done.left_behind, done.left_behind
        outs[n] = json.loads(out.read_text())
    assert outs[nproc]["world"] == nproc
    for one, many in zip(outs[1]["epochs"], outs[nproc]["epochs"]):
        assert sorted(many["ids"]) == list(range(11))
        assert many["ids"] == one["ids"] and many["preds"] == [2.0 * i for i in one["ids"]]
    assert outs[1]["epochs"][0]["ids"] != outs[1]["epochs"][1]["ids"]  # a new order each epoch
