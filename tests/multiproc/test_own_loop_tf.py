"""A ``tf.GradientTape`` loop and a ``model.fit`` on `polytrain.tensorflow.Distributed`
(tests/multiproc/own_loop_tf_worker.py) on 2 ranks under real launchers equal the same script in one process: every
step's loss and the final weights of both, with the ranks' weights identical; mpi under mpirun, tf-multiworker under
torchrun, horovod (real Horovod's TensorFlow ops, when built) under horovodrun. The checkpoint 2 ranks of mpi save
loads in one process with the same weights and optimizer state."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from procs import check, command, job_env, run

from polytrain.horovod.common import _import_error

pytest.importorskip("tensorflow")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

WORKER = str(Path(__file__).resolve().parent / "own_loop_tf_worker.py")
THREADS = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
JOBS = {  # backend: (launcher, environment)
    "mpi": ("mpirun", {"MASTER_ADDR": None}),
    "tf-multiworker": ("torchrun", {}),
    "horovod": ("horovodrun-gloo", {"MASTER_ADDR": None}),
}


def loop_run(tmp: Path, backend: str, nproc: int, *extra: str) -> dict:
    launcher, env = JOBS[backend] if nproc > 1 else ("python", {})
    out = tmp / f"{backend}-{nproc}.json"
    done = check(run(command(launcher, [WORKER, backend, str(out), str(tmp / "ckpt"), *extra], nproc),
                     env=job_env({**THREADS, **env}), timeout=240))
    assert not done.left_behind, done.left_behind
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return loop_run(tmp_path_factory.mktemp("mpi"), "mpi", 2)


@pytest.fixture(scope="module")
def one_process(mpi_run: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference, which afterwards loads the checkpoint the 2 ranks of mpi saved."""
    return loop_run(tmp_path_factory.mktemp("one"), "local", 1, "--load", mpi_run["saved"])


@pytest.mark.parametrize("backend", list(JOBS))
def test_two_ranks_equal_one_process(mpi_run: dict, one_process: dict, tmp_path: Path, backend: str) -> None:
    if backend == "horovod" and _import_error("horovod.tensorflow") is not None:
        pytest.skip("Horovod with TensorFlow ops is not installed (scripts/build_horovod.sh)")
    got = mpi_run if backend == "mpi" else loop_run(tmp_path, backend, 2)
    assert (got["backend"], got["world"]) == (backend, 2)
    assert got["spread"] == 0.0  # every weight of both models bit-identical on the two ranks
    for part in ("tape", "fit"):
        assert len(got[f"{part}_losses"]) == len(one_process[f"{part}_losses"]) == 12  # 2 epochs of 6 steps
        np.testing.assert_allclose(got[f"{part}_losses"], one_process[f"{part}_losses"], rtol=1e-5, err_msg=part)
        np.testing.assert_allclose(got[f"{part}_weights"], one_process[f"{part}_weights"], rtol=1e-5, atol=1e-6,
                                   err_msg=part)
    assert one_process["tape_losses"][-1] < 0.7 * one_process["tape_losses"][0]  # both trained
    assert one_process["fit_losses"][-1] < 0.9 * one_process["fit_losses"][0]
    assert got["refused"] == (f"gradient: the step is compiled with XLA (jit_compile), which cannot run the "
                              f"collectives of backend '{backend}'; compile it with jit_compile=False (for model.fit: "
                              f"model.compile(..., jit_compile=False))")


def test_two_ranks_save_and_one_process_loads(mpi_run: dict, one_process: dict) -> None:
    loaded = one_process["loaded"]
    assert loaded["values"] == {"backend": "mpi", "step": 12, "epoch": 2, "step_in_epoch": 0}
    assert loaded["weights"] == mpi_run["fit_weights"]  # exactly: the saved weights, not a retrained copy
    assert loaded["iterations"] == 12
    saved = Path(mpi_run["saved"])
    manifest = json.loads((saved / "manifest.json").read_text())
    assert {k: manifest[k] for k in ("framework", "backend", "world_size", "global_step", "epoch", "origin")} == {
        "framework": "tensorflow", "backend": "mpi", "world_size": 2, "global_step": 12, "epoch": 2,
        "origin": "own-loop"}
    assert len(manifest["rng_states"]) == 2 and manifest["rng_states"][0] != manifest["rng_states"][1]
    from safetensors.numpy import load_file

    names = set(load_file(str(saved / "model.safetensors")))
    assert names == {"hidden.0.weight", "hidden.0.bias", "head.weight", "head.bias"}  # the zoo MLP's portable names
    slots = set(load_file(str(saved / "keras_optimizer.safetensors")))
    assert {f"{name}/momentum" for name in names} <= slots and "iteration" in slots
