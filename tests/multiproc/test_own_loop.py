"""A hand-written loop on `polytrain.torch.Distributed` (tests/multiproc/own_loop_worker.py) on 2 ranks under
real launchers equals the same loop in one process: every micro-step's loss and the final weights, with
accumulation, clipping and an uneven final batch, on ddp, fsdp and DeepSpeed ZeRO-3 under torchrun, mpi under
mpirun and the Horovod shim under mpirun; also real Horovod under horovodrun, ZeRO-2 under DeepSpeed's launcher,
ddp under ``polytrain launch --launcher torchrun`` and fsdp on Ray Train's workers (``--launcher ray``; srun:
tests/cluster/test_slurm.py). After ``end()``, with the model still held, no group thread is left. Checkpoints
cross backends, world sizes and the Trainer; fp16 skips an overflowed update on every rank alike.

A launch costs seconds of CPU per rank before it trains (torch, DeepSpeed, the agent), so the jobs that need the
same launcher and world share one launch (own_loop_worker.py ``--jobs``: each job a session after the previous
one ended): one process (`local`), 2 ranks under torchrun (`torchrun_2`), 2 under mpirun (`mpirun_2`), 3 under
torchrun (`torchrun_3`) and one process after torchrun's (`after`); a job meant to fail the launch comes last in it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from procs import Finished, check, command, job_env, read_metrics, run

from polytrain.checkpoint.store import read_model
from polytrain.horovod.common import _import_error

pytest.importorskip("torch")
# a test may be the first of its launch's (and the launches before it): `after` waits for `torchrun_2`, which
# waits for `local`
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

WORKER = str(Path(__file__).resolve().parent / "own_loop_worker.py")
#: backend: its 2-rank launch (ZeRO-2 is the deepspeed-launcher case below)
JOBS = {"ddp": "torchrun_2", "fsdp": "torchrun_2", "deepspeed-3": "torchrun_2", "mpi": "mpirun_2", "horovod": "mpirun_2"}


def loop_run(tmp_path: Path, backend: str, launcher: str, nproc: int, env: dict[str, str | None]) -> dict:
    out = tmp_path / f"{backend}-{nproc}.json"
    exports = [name for name, value in env.items() if value is not None]
    done = check(run(command(launcher, [WORKER, backend, str(out)], nproc, exports=exports), env=job_env(env),
                     timeout=240))
    assert not done.left_behind, done.left_behind
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-process loop alone, for test_own_loop_ray.py (this file's tests use `local`'s)."""
    return loop_run(tmp_path_factory.mktemp("one"), "local", "python", 1, {})


@dataclass
class Launched:
    """One launch of own_loop_worker.py ``--jobs``: the finished command, and each job's JSON by its name."""

    done: Finished
    root: Path

    def __getitem__(self, name: str) -> dict:
        out = self.root / f"{name}.json"
        assert out.exists(), (f"job {name} wrote nothing (exit {self.done.returncode})\nstdout:\n"
                              f"{self.done.stdout[-3000:]}\nstderr:\n{self.done.stderr[-4000:]}")
        return json.loads(out.read_text())


def launch_jobs(root: Path, launcher: str, nproc: int, jobs: dict[str, dict], timeout: float,
                env: dict[str, str | None] | None = None) -> Launched:
    """The ``jobs`` (name: an own_loop_worker.py ``--jobs`` job, which writes ``root/<name>.json``) in turn on
    ``nproc`` ranks of one launch; nothing may be left running after it."""
    env = env or {}
    plan = root / "jobs.json"
    plan.write_text(json.dumps([{"out": str(root / f"{name}.json"), **job} for name, job in jobs.items()]))
    exports = [name for name, value in env.items() if value is not None]
    done = run(command(launcher, [WORKER, "--jobs", str(plan)], nproc, exports=exports), env=job_env(env),
               timeout=timeout)
    assert not done.left_behind, done.left_behind
    return Launched(done, root)


def loop(backend: str, **steps: int | str) -> dict:
    return {"do": "loop", "backend": backend, **steps}


TRAINER_DIGITS = ["model.params.hidden_sizes=[32]", "loop.epochs=4", "checkpoint.every_n_epochs=1",
                  "checkpoint.keep_last=4", "data.val_fraction=0.2"]


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """One process: the loop every 2-rank run is held to (``loop``), gather's and fp16's one-process runs, the
    loop stopped at update 8 by its own choice, saving under ``checkpoints`` (``stop-8``), and the Trainer's run
    that never stops, with a checkpoint each epoch (into ``straight``)."""
    root = tmp_path_factory.mktemp("local")
    jobs = {"loop": loop("local"), "gather": {"do": "gather", "backend": "local"},
            "fp16": {"do": "fp16", "backend": "local"}, "stop-8": loop("local", stop=8, save=str(root / "checkpoints")),
            "straight": {"do": "fit", "sets": TRAINER_DIGITS, "out": str(root / "straight")}}
    launched = launch_jobs(root, "python", 1, jobs, timeout=240)
    check(launched.done)
    return launched


@pytest.fixture(scope="module")
def torchrun_2(local: Launched, tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """2 ranks under torchrun: the loop on ddp, fsdp and ZeRO-3; fp16 on ddp and fsdp; ZeRO-3 resuming `local`'s
    update-8 checkpoint; the loop taking over `local`'s Trainer checkpoint after epoch 2 and saving it under
    ``loop``; last, fsdp preempted, saving under ``checkpoints``: every rank exits 75, and so the launch fails."""
    root = tmp_path_factory.mktemp("torchrun-2")
    deepspeed = ["deepspeed-3"] if _import_error("deepspeed") is None else []
    jobs = {name: loop(name) for name in ["ddp", "fsdp", *deepspeed]}
    jobs |= {f"fp16-{name}": {"do": "fp16", "backend": name} for name in ["ddp", "fsdp"]}
    jobs |= {f"resumed-{name}": loop(name, resume=str(local.root / "checkpoints")) for name in deepspeed}
    jobs["trainer"] = {"do": "trainer", "backend": "fsdp", "given": str(trainer_checkpoint(local.root)),
                       "root": str(root / "loop")}
    jobs["preempted"] = loop("fsdp", preempt=6, every=4, save=str(root / "checkpoints"))
    return launch_jobs(root, "torchrun", 2, jobs, timeout=480)


def trainer_checkpoint(root: Path) -> Path:
    return sorted((root / "straight" / "checkpoints").glob("step-*"))[1]  # the one after epoch 2


#: the ranks agree on a master themselves, as under a plain mpirun; horovod is the shim on torch.distributed
MPIRUN_ENV = {"MASTER_ADDR": None, "POLYTRAIN_HOROVOD_IMPL": "shim"}


@pytest.fixture(scope="module")
def mpirun_2(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """2 ranks under mpirun: the loop on mpi and the Horovod shim, gather on mpi, fp16 on the Horovod shim."""
    jobs = {"mpi": loop("mpi"), "horovod": loop("horovod"), "gather-mpi": {"do": "gather", "backend": "mpi"},
            "fp16-horovod": {"do": "fp16", "backend": "horovod"}}
    launched = launch_jobs(tmp_path_factory.mktemp("mpirun-2"), "mpirun", 2, jobs, timeout=400, env=MPIRUN_ENV)
    check(launched.done)
    return launched


@pytest.fixture(scope="module")
def torchrun_3(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """3 ranks under torchrun: gather on ddp; last, ``Distributed.launch(..., np=2)``, which must fail."""
    jobs = {"gather-ddp": {"do": "gather", "backend": "ddp"}, "launch-2": {"do": "launch", "backend": "ddp", "np": 2}}
    return launch_jobs(tmp_path_factory.mktemp("torchrun-3"), "torchrun", 3, jobs, timeout=240)


@pytest.fixture(scope="module")
def after(torchrun_2: Launched, tmp_path_factory: pytest.TempPathFactory) -> Launched:
    """One process after `torchrun_2`: the loop resuming fsdp's preempted checkpoint; the Trainer resuming the
    loop's checkpoint (into ``resumed``); then, from this plain python, ``Distributed.launch`` of 2 ranks of ddp
    (the ``mp.spawn`` case), twice, the second with rank 1 failing before training: the script fails."""
    root = tmp_path_factory.mktemp("after")
    jobs = {"resumed-local": loop("local", resume=str(torchrun_2.root / "checkpoints")),
            "resumed": {"do": "fit", "sets": TRAINER_DIGITS, "out": str(root / "resumed"),
                        "resume": str(torchrun_2.root / "loop")},
            "launched": {"do": "launch", "backend": "ddp", "np": 2},
            "failed": {"do": "launch", "backend": "ddp", "np": 2, "fail_rank": 1}}
    return launch_jobs(root, "python", 1, jobs, timeout=300)


@pytest.mark.parametrize("backend", list(JOBS))
def test_two_ranks_equal_one_process(local: Launched, request: pytest.FixtureRequest, backend: str) -> None:
    if backend.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    two_ranks = request.getfixturevalue(JOBS[backend])
    assert_equals_one_process(two_ranks[backend], local["loop"], backend)


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
def test_two_ranks_equal_one_process_under_more_launchers(local: Launched, tmp_path: Path, case: str) -> None:
    """The same loop under real Horovod's ``horovodrun --gloo`` (backend horovod on real Horovod), DeepSpeed's
    own launcher (through ``polytrain launch --launcher deepspeed``) and ``polytrain launch --launcher torchrun``
    (which starts a script as it starts a spec); Ray Train's workers in test_own_loop_ray.py: each names its
    launcher to the ranks, and equals one process."""
    run_under_launcher(local["loop"], tmp_path, case)


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


@pytest.mark.parametrize(("backend", "nproc"), [("ddp", 3), ("mpi", 2)])
def test_gather_for_metrics_is_exact_on_an_uneven_set(local: Launched, request: pytest.FixtureRequest, backend: str,
                                                      nproc: int) -> None:
    """11 samples on 3 (or 2) ranks: the samplers add copies to even the shares out; what `gather_for_metrics`
    returns is each sample once, in the order one process reads them, each epoch."""
    launched = request.getfixturevalue({"ddp": "torchrun_3", "mpi": "mpirun_2"}[backend])
    one, many = local["gather"], launched[f"gather-{backend}"]
    assert many["world"] == nproc
    for one_epoch, many_epoch in zip(one["epochs"], many["epochs"]):
        assert sorted(many_epoch["ids"]) == list(range(11))
        assert many_epoch["ids"] == one_epoch["ids"] and many_epoch["preds"] == [2.0 * i for i in one_epoch["ids"]]
    assert one["epochs"][0]["ids"] != one["epochs"][1]["ids"]  # a new order each epoch


def test_launch_starts_the_ranks_itself_and_equals_one_process(local: Launched, after: Launched) -> None:
    """`Distributed.launch(train, ..., np=2)` from a plain `python script.py` (the mp.spawn case): two ranks of
    ddp on loopback, the same losses and weights as one process."""
    got, one_process = after["launched"], local["loop"]
    assert (got["backend"], got["world"]) == ("ddp", 2)
    np.testing.assert_allclose(got["losses"], one_process["losses"], rtol=1e-5)
    for name, values in one_process["weights"].items():
        np.testing.assert_allclose(got["weights"][name], values, rtol=1e-5, atol=1e-6, err_msg=name)


def test_launch_names_the_rank_that_failed_and_stops_the_others(after: Launched) -> None:
    """Rank 1 raises before training; rank 0 would wait for it in the first collective: it is stopped, the
    script fails with exit code 1 and one line naming rank 1, and no process is left (`launch_jobs`)."""
    done = after.done
    assert done.returncode == 1, done.stderr[-2000:]
    assert "RuntimeError: rank 1 fails on purpose" in done.stderr
    assert "TrainingFailure: Distributed.launch: rank 1 of 2 exited with code 1" in done.stderr
    assert not (after.root / "failed.json").exists()


def test_launch_under_a_launcher_must_agree_with_its_world(torchrun_3: Launched) -> None:
    """Under torchrun with 3 processes, np=2 is a one-line error naming both numbers (no process is started;
    none is left: `launch_jobs`)."""
    done = torchrun_3.done
    assert done.returncode != 0
    assert "launch: np=2, but torchrun started 3 process(es)" in done.stderr
    assert not (torchrun_3.root / "launch-2.json").exists()


@pytest.mark.parametrize("split", ["fsdp-2-to-local-1", "local-1-to-deepspeed-3-2"])
def test_a_loop_saved_on_one_backend_resumes_on_another(local: Launched, request: pytest.FixtureRequest,
                                                        split: str) -> None:
    """`dist.save` after update 8 (every rank calls it; FSDP and ZeRO-3 gather their shards), `dist.load` in a
    new job of another backend and world size, the loop going on from the step it returns: every later
    micro-step's loss and the final weights equal the run that never stopped (weights, momentum and the step
    carried over exactly). On fsdp the stop is a preemption (`torchrun_2`'s last job: a SIGTERM to rank 1 after
    update 6, the ranks agreeing every 4 updates): `dist.preempted` true on every rank at update 8,
    `dist.exit_preempted`: exit code 75 on each rank and rank 0's one line; the other stops at update 8 as the
    loop's own choice (`local`'s ``stop-8``)."""
    if "deepspeed" in split:
        pytest.importorskip("deepspeed")
    torchrun = request.getfixturevalue("torchrun_2")
    if split == "fsdp-2-to-local-1":
        text = torchrun.done.stdout + torchrun.done.stderr  # torchrun reports each rank's code and fails itself
        codes = re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*exitcode\s*: (\d+)", text)
        assert torchrun.done.returncode != 0 and set(codes) == {("0", "75"), ("1", "75")}, text[-3000:]
        assert re.findall(r"polytrain: preempted by .*", text) == [
            "polytrain: preempted by a signal to another rank: every rank stopped after step 8, its checkpoint "
            "written at step 8; load the loop's last save to go on (Distributed.load)"], text[-3000:]
        root, n1, n2, got = torchrun.root / "checkpoints", 2, 1, request.getfixturevalue("after")["resumed-local"]
    else:
        root, n1, n2, got = local.root / "checkpoints", 1, 2, torchrun["resumed-deepspeed-3"]
    one_process = local["loop"]
    manifest = json.loads((root / "step-00000008" / "manifest.json").read_text())
    assert (manifest["origin"], manifest["global_step"], manifest["world_size"]) == ("own-loop", 8, n1)
    assert got["world"] == n2 and len(got["losses"]) == 24  # updates 8-19, 2 micro-steps each
    np.testing.assert_allclose(got["losses"], one_process["losses"][16:], rtol=1e-5)
    for name, values in one_process["weights"].items():
        np.testing.assert_allclose(got["weights"][name], values, rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_trainer_and_a_loop_resume_each_others_checkpoints(local: Launched, torchrun_2: Launched,
                                                                after: Launched) -> None:
    """The Trainer (one process, local: `local`'s ``straight``) writes a checkpoint after each of 4 epochs; a loop
    on 2 ranks of fsdp loads the one after epoch 2 (its weights are the Trainer's) and saves it again as its own
    (`torchrun_2`'s ``trainer``); the Trainer resumes from the loop's checkpoint (`after`'s ``resumed``: a new
    backend and world size each way) and ends on exactly the weights of the run that never stopped: model,
    momentum, step and epoch all crossed over."""
    straight, trainer_ckpt, resumed = local.root / "straight", trainer_checkpoint(local.root), after.root / "resumed"
    got = torchrun_2["trainer"]
    step = int(trainer_ckpt.name.removeprefix("step-"))
    assert (got["values"]["step"], got["values"]["epoch"], got["world"]) == (step, 2, 2)
    stored, _ = read_model_dir(trainer_ckpt)
    for name, values in stored.items():
        np.testing.assert_array_equal(np.asarray(got["weights"][name], dtype=np.float32), values.flatten(), name)
    assert read_metrics(resumed, "resume")[0]["step"] == step
    final, _ = read_model(straight)
    again, _ = read_model(resumed)
    for name, values in final.items():
        np.testing.assert_allclose(again[name], values, rtol=1e-6, atol=1e-7, err_msg=name)


def read_model_dir(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    from polytrain.checkpoint.store import load_checkpoint

    manifest, tensors = load_checkpoint(path)
    return tensors["model"], manifest


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "horovod"])  # mpi takes no fp16
def test_fp16_skips_the_overflowed_update_on_every_rank_alike(local: Launched, request: pytest.FixtureRequest,
                                                             backend: str) -> None:
    """An inf in one rank's loss of update 3: every rank skips that update (optimizer.step() returns False) and
    halves its loss scale, as one process does with the inf in its batch; the other updates apply, and the
    ranks end on the same finite weights (tests/multiproc/loop_fp16_worker.py)."""
    one, two = local["fp16"], request.getfixturevalue(JOBS[backend])[f"fp16-{backend}"]
    assert one["applied"] == [True, True, False, True, True, True]  # only update 3 skipped
    assert (two["world"], two["applied"], two["scales"]) == (2, one["applied"], one["scales"])
    assert two["threads_left"] == [], two["threads_left"]
    assert two["scales"][2] == two["scales"][1] / 2
    assert two["same"] and two["finite"]
