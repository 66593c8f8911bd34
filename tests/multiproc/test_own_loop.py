"""A hand-written loop on `polytrain.torch.Distributed` (tests/multiproc/own_loop_worker.py) on 2 ranks under
real launchers equals the same loop in one process: every micro-step's loss and the final weights, with
accumulation, clipping and an uneven final batch, on ddp, fsdp and DeepSpeed ZeRO-3 under torchrun, mpi under
mpirun and the Horovod shim under mpirun; also real Horovod under horovodrun, ZeRO-2 under DeepSpeed's launcher,
ddp under ``polytrain launch --launcher torchrun`` and fsdp on Ray Train's workers (``--launcher ray``; srun:
tests/cluster/test_slurm.py). After ``end()``, with the model still held, no group thread is left. Checkpoints
cross backends, world sizes and the Trainer; fp16 skips an overflowed update on every rank alike."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import check, command, job_env, read_metrics, run, train

from polytrain.checkpoint.store import read_model
from polytrain.horovod.common import _import_error

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

WORKER = str(Path(__file__).resolve().parent / "own_loop_worker.py")
JOBS = {  # backend: (launcher, environment); ZeRO-2 is the deepspeed-launcher case below
    "ddp": ("torchrun", {}),
    "fsdp": ("torchrun", {}),
    "deepspeed-3": ("torchrun", {}),
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


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each backend's 2-rank run, one launch per launcher: the backends of a launcher run in turn in the same
    processes (a session starts after the previous one ended: what a script that switches backends does)."""
    root, runs = tmp_path_factory.mktemp("two-ranks"), {}
    for launcher in dict.fromkeys(launcher for launcher, _ in JOBS.values()):
        names = [name for name, (where, _) in JOBS.items() if where == launcher
                 and (not name.startswith("deepspeed") or _import_error("deepspeed") is None)]
        env = {k: v for name in names for k, v in JOBS[name][1].items()}
        exports = [name for name, value in env.items() if value is not None]
        done = check(run(command(launcher, [WORKER, ",".join(names), str(root / "{backend}.json")], 2,
                                 exports=exports), env=job_env(env), timeout=400))
        assert not done.left_behind, done.left_behind
        runs |= {name: json.loads((root / f"{name}.json").read_text()) for name in names}
    return runs


@pytest.mark.parametrize("backend", list(JOBS))
def test_two_ranks_equal_one_process(one_process: dict, two_ranks: dict, backend: str) -> None:
    if backend.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    assert_equals_one_process(two_ranks[backend], one_process, backend)


def assert_equals_one_process(got: dict, one_process: dict, backend: str) -> None:
    """2 ranks of ``backend`` (``deepspeed-<stage>``: DeepSpeed) made the one-process run's every loss, norm and
    weight within 1e-5."""
    assert (got["backend"], got["world"]) == (backend.partition("-")[0], 2)
    assert len(got["losses"]) == len(one_process["losses"]) == 40  # 20 updates of 2 micro-steps
    assert max(one_process["norms"]) > 0.5  # the clip at 0.5 bit on some updates
    np.testing.assert_allclose(got["losses"], one_process["losses"], rtol=1e-5)
    if got["backend"] != "deepspeed":  # DeepSpeed's engine clips inside its step and reports no norm here
        np.testing.assert_allclose(got["norms"], one_process["norms"], rtol=1e-5)
    else:
        assert got["refused"].startswith("clip_grad_norm_: deepspeed clips inside its step, at the norm given when "
                                          "the engine is built (loop.grad_clip_norm: 0.5)")
    assert got["weights"].keys() == one_process["weights"].keys()
    for name, values in one_process["weights"].items():
        np.testing.assert_allclose(got["weights"][name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    assert_ended(got)


def assert_ended(got: dict) -> None:
    """After `end()`, with the script still holding the model and optimizer, no gloo worker or store thread is
    left (run on into interpreter shutdown, one aborted the process now and then); a DDP model then runs as its
    module on the process, with the trained weights; an FSDP one refuses in one line."""
    assert got["threads_left"] == [], got["threads_left"]
    if got["backend"] == "ddp":
        weights = {k: np.asarray(v, dtype=np.float32) for k, v in got["weights"].items()}
        hidden = np.maximum(weights["0.weight"].reshape(32, 64).sum(axis=1) + weights["0.bias"], 0)
        expected = 2 * float((weights["2.weight"].reshape(10, 32) @ hidden + weights["2.bias"]).sum())
        assert got["after_end"].startswith("local "), got["after_end"]
        assert float(got["after_end"].split()[1]) == pytest.approx(expected, rel=1e-5)
    elif got["backend"] == "fsdp":
        assert got["after_end"].startswith("forward: this module was sharded across the ranks by fsdp"), got


needs_horovod = pytest.mark.skipif(_import_error("horovod.torch") is not None,
                                   reason="real Horovod is not installed (scripts/build_horovod.sh)")
MORE_LAUNCHERS = {  # case: (backend, launcher as procs.command names it, environment, World.launcher, backend label)
    "horovod-horovodrun": ("horovod", "horovodrun-gloo", {"MASTER_ADDR": None}, "horovodrun-gloo",
                           "horovod (Horovod implementation)"),
    "deepspeed-launcher": ("deepspeed-2", "launch-deepspeed", {}, "deepspeed", "deepspeed"),
    "ddp-polytrain-launch": ("ddp", "launch-torchrun", {}, "torchrun", "ddp"),
    "fsdp-ray": ("fsdp", "launch-ray", {}, "ray", "fsdp"),  # run by test_own_loop_ray.py (Ray's test group)
}


@pytest.mark.parametrize("case", [pytest.param("horovod-horovodrun", marks=needs_horovod), "deepspeed-launcher",
                                  "ddp-polytrain-launch"])
def test_two_ranks_equal_one_process_under_more_launchers(one_process: dict, tmp_path: Path, case: str) -> None:
    """The same loop under real Horovod's ``horovodrun --gloo`` (backend horovod on real Horovod), DeepSpeed's
    own launcher (through ``polytrain launch --launcher deepspeed``) and ``polytrain launch --launcher torchrun``
    (which starts a script as it starts a spec); Ray Train's workers in test_own_loop_ray.py: each names its
    launcher to the ranks, and equals one process."""
    run_under_launcher(one_process, tmp_path, case)


def run_under_launcher(one_process: dict, tmp_path: Path, case: str) -> None:
    backend, launcher, env, world_launcher, label = MORE_LAUNCHERS[case]
    if backend.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    if launcher == "launch-ray":
        pytest.importorskip("ray.train")
    got = loop_run(tmp_path, backend, launcher, 2, env)
    assert (got["launcher"], got["label"]) == (world_launcher, label)
    # a rank runs at the launcher's priority (Ray would start it at nice 15: the local Ray is the job's own)
    assert got["niceness"] == os.nice(0), got["niceness"]
    assert_equals_one_process(got, one_process, backend)


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


def test_launch_starts_the_ranks_itself_and_equals_one_process(one_process: dict, tmp_path: Path) -> None:
    """`Distributed.launch(train, ..., np=2)` from a plain `python script.py` (the mp.spawn case): two ranks of
    ddp on loopback, the same losses and weights as one process."""
    out = tmp_path / "launched.json"
    done = check(run([sys.executable, WORKER, "ddp", str(out), "--launch", "2"], env=job_env({}), timeout=180))
    assert not done.left_behind, done.left_behind
    got = json.loads(out.read_text())
    assert (got["backend"], got["world"]) == ("ddp", 2)
    np.testing.assert_allclose(got["losses"], one_process["losses"], rtol=1e-5)
    for name, values in one_process["weights"].items():
        np.testing.assert_allclose(got["weights"][name], values, rtol=1e-5, atol=1e-6, err_msg=name)


def test_launch_names_the_rank_that_failed_and_stops_the_others(tmp_path: Path) -> None:
    """Rank 1 raises before training; rank 0 would wait for it in the first collective: it is stopped, the
    script fails with exit code 1 and one line naming rank 1, and no process is left."""
    done = run([sys.executable, WORKER, "ddp", str(tmp_path / "x.json"), "--launch", "2", "--fail-rank", "1"],
               env=job_env({}), timeout=180)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RuntimeError: rank 1 fails on purpose" in done.stderr
    assert "TrainingFailure: Distributed.launch: rank 1 of 2 exited with code 1" in done.stderr
    assert not done.left_behind, done.left_behind
    assert not (tmp_path / "x.json").exists()


def test_launch_under_a_launcher_must_agree_with_its_world(tmp_path: Path) -> None:
    """Under torchrun with 2 processes, np=3 is a one-line error naming both numbers (no process is started)."""
    done = run(command("torchrun", [WORKER, "ddp", str(tmp_path / "x.json"), "--launch", "3"], 2),
               env=job_env({}), timeout=120)
    assert done.returncode != 0
    assert "launch: np=3, but torchrun started 2 process(es)" in done.stderr
    assert not done.left_behind, done.left_behind


SPLITS = {  # a loop stopped after 8 of its 20 updates on one backend and world size, resumed on another
    "fsdp-2-to-local-1": (("fsdp", "torchrun", 2), ("local", "python", 1)),
    "local-1-to-deepspeed-3-2": (("local", "python", 1), ("deepspeed-3", "torchrun", 2)),
}
#: how each split's first job stops: fsdp's by a SIGTERM to rank 1 after update 6, the ranks agreeing every 4
#: updates (`dist.preempted`: at update 8), the other at update 8 as the loop's own choice
STOPS = {"fsdp-2-to-local-1": ["--preempt", "6", "--every", "4"], "local-1-to-deepspeed-3-2": ["--stop", "8"]}


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_loop_saved_on_one_backend_resumes_on_another(one_process: dict, tmp_path: Path, split: str) -> None:
    """`dist.save` after update 8 (every rank calls it; FSDP and ZeRO-3 gather their shards), `dist.load` in a
    new job of another backend and world size, the loop going on from the step it returns: every later
    micro-step's loss and the final weights equal the run that never stopped (weights, momentum and the step
    carried over exactly). On fsdp the stop is a preemption: one rank's SIGTERM, `dist.preempted` true on every
    rank at the same update, `dist.exit_preempted`: exit code 75 on each rank and rank 0's one line."""
    (first, launcher1, n1), (second, launcher2, n2) = SPLITS[split]
    if "deepspeed" in split:
        pytest.importorskip("deepspeed")
    root = tmp_path / "checkpoints"
    for backend, launcher, nproc, extra in ((first, launcher1, n1, [*STOPS[split], "--save", str(root)]),
                                            (second, launcher2, n2, ["--resume", str(root)])):
        done = run(command(launcher, [WORKER, backend, str(tmp_path / "out.json"), *extra], nproc),
                   env=job_env({}), timeout=240)
        if "--preempt" in extra:  # torchrun reports each rank's code and fails itself
            text = done.stdout + done.stderr
            codes = re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*exitcode\s*: (\d+)", text)
            assert done.returncode != 0 and set(codes) == {("0", "75"), ("1", "75")}, text[-3000:]
            assert re.findall(r"polytrain: preempted by .*", text) == [
                "polytrain: preempted by a signal to another rank: every rank stopped after step 8, its checkpoint "
                "written at step 8; load the loop's last save to go on (Distributed.load)"], text[-3000:]
        else:
            check(done)
        assert not done.left_behind, done.left_behind
    manifest = json.loads((root / "step-00000008" / "manifest.json").read_text())
    assert (manifest["origin"], manifest["global_step"], manifest["world_size"]) == ("own-loop", 8, n1)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["world"] == n2 and len(got["losses"]) == 24  # updates 8-19, 2 micro-steps each
    np.testing.assert_allclose(got["losses"], one_process["losses"][16:], rtol=1e-5)
    for name, values in one_process["weights"].items():
        np.testing.assert_allclose(got["weights"][name], values, rtol=1e-5, atol=1e-6, err_msg=name)


TRAINER_LOOP = str(Path(__file__).resolve().parent / "loop_trainer_worker.py")
DIGITS = ["model.params.hidden_sizes=[32]", "loop.epochs=4", "checkpoint.every_n_epochs=1", "checkpoint.keep_last=4",
          "data.val_fraction=0.2"]


def test_the_trainer_and_a_loop_resume_each_others_checkpoints(tmp_path: Path) -> None:
    """The Trainer (one process, local) writes a checkpoint after each of 4 epochs; a loop on 2 ranks of fsdp
    loads the one after epoch 2 (its weights are the Trainer's) and saves it again as its own; the Trainer
    resumes from the loop's checkpoint (a new backend and world size each way) and ends on exactly the weights
    of the run that never stopped: model, momentum, step and epoch all crossed over."""
    straight = tmp_path / "straight"
    check(train(straight, DIGITS))
    trainer_ckpt = sorted((straight / "checkpoints").glob("step-*"))[1]  # the one after epoch 2
    loop_root, out = tmp_path / "loop", tmp_path / "loop.json"
    done = check(run(command("torchrun", [TRAINER_LOOP, "fsdp", str(trainer_ckpt), str(loop_root), str(out)], 2),
                     env=job_env({}), timeout=240))
    assert not done.left_behind, done.left_behind
    got = json.loads(out.read_text())
    step = int(trainer_ckpt.name.removeprefix("step-"))
    assert (got["values"]["step"], got["values"]["epoch"], got["world"]) == (step, 2, 2)
    stored, _ = read_model_dir(trainer_ckpt)
    for name, values in stored.items():
        np.testing.assert_array_equal(np.asarray(got["weights"][name], dtype=np.float32), values.flatten(), name)
    resumed = tmp_path / "resumed"
    check(train(resumed, DIGITS, resume=loop_root))
    assert read_metrics(resumed, "resume")[0]["step"] == step
    final, _ = read_model(straight)
    again, _ = read_model(resumed)
    for name, values in final.items():
        np.testing.assert_allclose(again[name], values, rtol=1e-6, atol=1e-7, err_msg=name)


def read_model_dir(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    from polytrain.checkpoint.store import load_checkpoint

    manifest, tensors = load_checkpoint(path)
    return tensors["model"], manifest


FP16 = str(Path(__file__).resolve().parent / "loop_fp16_worker.py")


def fp16_runs(tmp_path: Path, backends: list[str], launcher: str, nproc: int) -> dict[str, dict]:
    """The fp16 loop on each of ``backends`` in turn, in one launch."""
    env = {k: v for backend in backends for k, v in JOBS.get(backend, ("python", {}))[1].items()}
    exports = [key for key, value in env.items() if value is not None]
    done = check(run(command(launcher, [FP16, ",".join(backends), str(tmp_path / "{backend}.json")], nproc,
                             exports=exports), env=job_env(env), timeout=240))
    assert not done.left_behind, done.left_behind
    return {backend: json.loads((tmp_path / f"{backend}.json").read_text()) for backend in backends}


@pytest.fixture(scope="module")
def fp16_one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fp16_runs(tmp_path_factory.mktemp("fp16"), ["local"], "python", 1)["local"]


@pytest.fixture(scope="module")
def fp16_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """ddp then fsdp in one torchrun launch; the Horovod shim under mpirun."""
    root = tmp_path_factory.mktemp("fp16-two")
    return {**fp16_runs(root, ["ddp", "fsdp"], "torchrun", 2), **fp16_runs(root, ["horovod"], "mpirun", 2)}


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "horovod"])  # mpi takes no fp16
def test_fp16_skips_the_overflowed_update_on_every_rank_alike(fp16_one_process: dict, fp16_two_ranks: dict,
                                                             backend: str) -> None:
    """An inf in one rank's loss of update 3: every rank skips that update (optimizer.step() returns False) and
    halves its loss scale, as one process does with the inf in its batch; the other updates apply, and the
    ranks end on the same finite weights."""
    one, two = fp16_one_process, fp16_two_ranks[backend]
    assert one["applied"] == [True, True, False, True, True, True]  # only update 3 skipped
    assert (two["world"], two["applied"], two["scales"]) == (2, one["applied"], one["scales"])
    assert two["threads_left"] == [], two["threads_left"]
    assert two["scales"][2] == two["scales"][1] / 2
    assert two["same"] and two["finite"]
