"""The migration examples (examples/migrate/) prove their move with numbers: each original script and its
`polytrain.torch` version train the same problem (digits, 32 optimizer steps over a global batch of 32, clipping
that bites), and every step's loss and gradient norm and the final weights agree within 1e-5 (measured: within
4e-7 of each other, float rounding of the different summation orders).

Every PyTorch script trains the same problem, so each is also held to the one-process original
(dataparallel_original.py).
Run here: the DDP script under `torch.multiprocessing.spawn` and its move under `Distributed.launch`; the
DataParallel script in one process and its move on 2 ranks; the Horovod script under real Horovod's
`horovodrun --gloo` (when Horovod is built) and on polytrain's Horovod API with its one import line changed (under
torchrun), its move under horovodrun. Accelerate is not installed here, and is not installed on purpose:
accelerate_original.py is shown, not run; its move runs under torchrun and is held to the one-process original.
The Keras pair (Horovod's Keras API → `polytrain.tensorflow`, `model.fit`) runs under horovodrun and is held to
itself: the original's model is Keras', not the PyTorch scripts' one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from procs import REPO, check, command, job_env, run

from polytrain.horovod.common import _import_error

pytest.importorskip("torch")
pytest.importorskip("sklearn")  # the digits file ships with scikit-learn
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

MIGRATE = REPO / "examples" / "migrate"
STEPS, CLIP, VAL_SAMPLES = 32, 1.0, 101
RTOL, ATOL = 1e-5, 1e-6  # the project's parity tolerance; the runs differ by < 4e-7 (float summation order)
needs_horovod = pytest.mark.skipif(_import_error("horovod.torch") is not None,
                                   reason="real Horovod is not installed (scripts/build_horovod.sh)")


def example(tmp_path: Path, script: Path | str, launcher: str, env: dict[str, str | None] | None = None) -> dict:
    """``script`` (a name in examples/migrate or a path) run by ``launcher`` (procs.command's names; 2 ranks where
    it starts ranks): what its rank 0 wrote."""
    path = Path(script) if Path(script).is_absolute() else MIGRATE / f"{script}.py"
    out = tmp_path / f"{path.stem}-{launcher}.json"
    done = check(run(command(launcher, [str(path), str(out)], 2), env=job_env(env), timeout=150))
    assert not done.left_behind, done.left_behind
    return json.loads(out.read_text())


def assert_same(got: dict, want: dict) -> None:
    assert len(got["losses"]) == len(want["losses"]) == STEPS
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL, err_msg="losses")
    np.testing.assert_allclose(got["norms"], want["norms"], rtol=RTOL, err_msg="gradient norms")
    assert got["weights"].keys() == want["weights"].keys()
    for name, values in want["weights"].items():
        np.testing.assert_allclose(got["weights"][name], values, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The DataParallel original: one process, the whole batch of 32 at each step."""
    ref = example(tmp_path_factory.mktemp("dataparallel"), "dataparallel_original", "python")
    assert ref["losses"][-1] < 0.5 * ref["losses"][0]  # it learned
    assert min(ref["norms"]) < CLIP < max(ref["norms"])  # the clip bit on some steps, not all
    assert ref["val_count"] == VAL_SAMPLES
    return ref


def test_dataparallel_moved_to_two_ranks(one_process: dict, tmp_path: Path) -> None:
    """One process with the whole batch → 2 ranks with half each (`Distributed.launch`): the same updates, and
    `gather_for_metrics` gives the accuracy over exactly the 101 validation samples (the sampler pads to 102)."""
    moved = example(tmp_path, "dataparallel_polytrain", "python")
    assert_same(moved, one_process)
    assert moved["val_count"] == VAL_SAMPLES
    assert moved["val_accuracy"] == one_process["val_accuracy"]


def test_ddp_spawned_by_mp_spawn_moved(one_process: dict, tmp_path: Path) -> None:
    original = example(tmp_path, "ddp_original", "python")  # starts its 2 ranks with mp.spawn
    moved = example(tmp_path, "ddp_polytrain", "python")  # and these with Distributed.launch
    assert_same(moved, original)
    assert_same(original, one_process)


def on_polytrains_horovod_api(tmp_path: Path, name: str, module: str) -> Path:
    """examples/migrate/<name>.py with the one line polytrain's Horovod API asks changed (README.md): ``import
    <module> as hvd`` becomes ``import polytrain.horovod.<framework> as hvd``, written to ``tmp_path``."""
    line = f"\nimport {module} as hvd\n"
    text = (MIGRATE / f"{name}.py").read_text()
    assert text.count(line) == 1
    framework = "keras" if module.endswith("keras") else module.split(".")[1]
    path = tmp_path / f"{name}_on_polytrain.py"
    path.write_text(text.replace(line, f"\nimport polytrain.horovod.{framework} as hvd\n"))
    return path


@pytest.fixture(scope="module")
def horovod_original(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The Horovod script as it is, under real Horovod's horovodrun (gloo controller)."""
    return example(tmp_path_factory.mktemp("horovod"), "horovod_original", "horovodrun-gloo", {"MASTER_ADDR": None})


def test_horovod_script_on_polytrains_horovod_api(one_process: dict, tmp_path: Path) -> None:
    """The Horovod script, its import line changed, on polytrain's implementation under torchrun."""
    env = {"POLYTRAIN_HOROVOD_IMPL": "shim", "PYTHONPATH": str(MIGRATE)}  # the copy imports digits_task from there
    script = on_polytrains_horovod_api(tmp_path, "horovod_original", "horovod.torch")
    assert_same(example(tmp_path, script, "torchrun", env), one_process)


@needs_horovod
def test_horovod_script_under_horovodrun_moved(one_process: dict, horovod_original: dict, tmp_path: Path) -> None:
    """The original and its move (backend horovod), both under real horovodrun on real Horovod."""
    moved = example(tmp_path, "horovod_polytrain", "horovodrun-gloo", {"MASTER_ADDR": None})
    assert_same(moved, horovod_original)
    assert_same(horovod_original, one_process)


def test_accelerate_script_moved(one_process: dict, tmp_path: Path) -> None:
    """Accelerate's original is shown, not run (Accelerate is not installed here). Its move (2 ranks under
    torchrun, 2 micro-steps of 8 per rank per update) makes the one-process original's updates, and its
    `gather_for_metrics` the same accuracy over the 101 validation samples."""
    assert "from accelerate import Accelerator" in (MIGRATE / "accelerate_original.py").read_text()
    moved = example(tmp_path, "accelerate_polytrain", "torchrun")
    assert_same(moved, one_process)
    assert moved["val_count"] == VAL_SAMPLES
    assert moved["val_accuracy"] == one_process["val_accuracy"]


@needs_horovod
def test_keras_horovod_script_moved(tmp_path: Path) -> None:
    """The Keras pair, both under real horovodrun (Horovod's TensorFlow collectives). Horovod 0.28's own Keras layer
    predates Keras 3 (its broadcast callback calls ``Variable.ref``, which Keras 3 variables lack), so the original
    runs with the one line polytrain's Keras 3 form of that API asks changed."""
    pytest.importorskip("tensorflow")
    env = {"MASTER_ADDR": None, "PYTHONPATH": str(MIGRATE), "TF_NUM_INTRAOP_THREADS": "1",
           "TF_NUM_INTEROP_THREADS": "1"}
    script = on_polytrains_horovod_api(tmp_path, "keras_horovod_original", "horovod.tensorflow.keras")
    original = example(tmp_path, script, "horovodrun-gloo", env)
    moved = example(tmp_path, "keras_polytrain", "horovodrun-gloo", env)
    assert original["losses"][-1] < 0.5 * original["losses"][0]  # it learned
    assert_same(moved, original)
