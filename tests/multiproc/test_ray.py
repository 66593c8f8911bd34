"""``polytrain launch --launcher ray`` (issue 30): Ray Train's workers run polytrain's ranks, on a local Ray the launch
starts and stops. A killed rank restarted by Ray's FailureConfig is in test_elastic.py; here: a tensor-parallel layout, DeepSpeed
ZeRO-2 and TensorFlow (tf-multiworker) on digits train on Ray exactly what they train under torchrun, their metrics and
final model reaching Ray's own checkpoint manager, a failure without restarts named by rank and node with
nothing left running, and the refusals that come before Ray starts (a bad --ray-address, an MPI-launched backend).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from procs import REPO, check, loopback_env, read_metrics, run, train
from specs import PARITY_TRAINING, lm, merged

from polytrain.checkpoint.store import read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]
pytest.importorskip("ray.train")

HERE = Path(__file__).parent
SPEC = {"model": {"name": "mlp", "params": {"hidden_sizes": [8]}}, "loop": {"epochs": 2},
        "data": {"name": "synthetic", "batch_size": 12, "val_fraction": 0.2,
                 "synthetic": {"samples": 200, "features": 6, "classes": 3, "noise": 1.5}}}


def launch(tmp_path: Path, spec: dict, *flags: str, env: dict[str, str] | None = None):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return run([sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "ray", "-np", "2", *flags, str(path),
                "--quiet"], env=env or loopback_env(), timeout=240)


def ray_leftovers() -> set[str]:
    """Local Ray session directories the launcher made (it removes its own)."""
    return {p.name for p in Path(tempfile.gettempdir()).glob("polytrain-ray-*")}


def test_without_restarts_a_killed_rank_fails_the_job_naming_it(tmp_path: Path) -> None:
    before = ray_leftovers()
    spec = {**SPEC, "framework": "torch", "backend": "ddp", "output": str(tmp_path / "out"),
            "model": {"name": "faulty_model:make"}}
    failed = launch(tmp_path, spec, env=loopback_env(PYTHONPATH=str(HERE), FAULT_RANK="1", FAULT_AT="3"))
    assert failed.returncode == 1
    last = [line for line in failed.stderr.splitlines() if line.startswith("polytrain: the Ray job failed")]
    assert last and "rank 1 on 127.0.0.1:" in last[-1] and "exited with code -9" in last[-1], failed.stderr[-3000:]
    assert ray_leftovers() == before


@pytest.mark.parametrize(("flags", "spec", "line"), [
    (["--ray-address", "127.0.0.1:1"], {}, "polytrain: error: --ray-address 127.0.0.1:1: no Ray head answers there "
                                           "(Connection refused)"),
    (["--ray-address", "head"], {}, "polytrain: error: --ray-address head: expected HOST:PORT of the Ray head"),
    ([], {"framework": "tensorflow", "backend": "mpi"},
     "polytrain: error: --launcher ray: backend 'mpi' takes its ranks from an MPI launcher (mpirun, horovodrun); "
     "on Ray use backend 'tf-multiworker'"),
    ([], {"framework": "torch", "backend": "mpi"},
     "polytrain: error: --launcher ray: backend 'mpi' takes its ranks from an MPI launcher (mpirun, horovodrun); "
     "on Ray use backend 'ddp'"),
])
def test_refused_before_ray_starts(tmp_path: Path, flags: list[str], spec: dict, line: str) -> None:
    refused = launch(tmp_path, {**SPEC, "output": str(tmp_path / "out"), **spec}, *flags)
    assert refused.returncode == 2
    assert refused.stderr.strip().startswith(line) and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert not (tmp_path / "out").exists()


DIGITS = REPO / "examples" / "digits.yaml"
ON_RAY = {  # each as under torchrun: (spec file or dict, --set values)
    "tensor2": (merged(lm(n_layers=2, dropout=0.0), PARITY_TRAINING), ["backend=ddp", "parallel.tensor=2"]),
    "deepspeed-zero2": (DIGITS, ["backend=deepspeed", "deepspeed.stage=2", "loop.epochs=1"]),
    "tensorflow-digits": (DIGITS, ["framework=tensorflow", "backend=tf-multiworker", "loop.epochs=1"]),
}


@pytest.mark.parametrize("name", sorted(ON_RAY))
def test_a_layout_trains_on_ray_what_it_trains_under_torchrun(tmp_path: Path, name: str) -> None:
    spec, sets = ON_RAY[name]
    if isinstance(spec, dict):
        path = tmp_path / "spec.json"
        path.write_text(json.dumps(spec))
        spec = path
    if name.startswith("tensorflow"):
        pytest.importorskip("tensorflow")
    elif name.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    for launcher in ("launch-ray", "torchrun"):
        check(train(tmp_path / launcher, sets, spec=spec, launcher=launcher, nproc=2, timeout=280))
    got, manifest = read_model(tmp_path / "launch-ray")
    want, _ = read_model(tmp_path / "torchrun")
    assert manifest["world_size"] == 2 and sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
    reported_to_ray(tmp_path / "launch-ray")


def reported_to_ray(out: Path) -> None:
    """Ray's checkpoint manager holds the run's last epoch record and its final model (rank 0 reported them)."""
    (snapshot,) = (out / "ray").glob("polytrain-*/checkpoint_manager_snapshot.json")
    reported = json.loads(snapshot.read_text())["latest_checkpoint_result"]
    last_epoch = read_metrics(out, "epoch")[-1]
    assert reported["metrics"] == {k: last_epoch[k] for k in reported["metrics"]} and \
        {"val_loss", "step"} <= set(reported["metrics"])
    state, manifest = read_model(snapshot.parent / reported["checkpoint_dir_name"])
    final, _ = read_model(out)
    assert manifest["world_size"] == 2 and manifest["versions"] and sorted(state) == sorted(final)
    assert all((state[k] == final[k]).all() for k in final)
