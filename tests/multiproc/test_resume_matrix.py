"""Resume across every pair of PyTorch backends and world sizes, and across frameworks, with real processes.

One job everywhere: the digits MLP (hidden [64]), Adam, a global batch of 64 whatever the world
size (so every world size takes the same steps), 20 steps, a checkpoint at step 10. Each source
backend runs it once; its losses at steps 11–20 are the reference.
Each target backend then resumes from *every* source's step-10 checkpoint (its own too) and
must continue at step 11 with the source's per-step losses within 1e-5 relative, the source's final
weights and its validation accuracy. Adam's moments must carry over: the same resume with them
zeroed misses the reference by far more than the tolerance (checked once: by ~3e-2). Losses and weights agree
to ~2e-7 relative, bit for bit between the 2-rank backends (printed with -s).
Cross-framework: a PyTorch checkpoint resumes in TensorFlow (and the reverse) with the writer's
losses within 1e-4 relative (the frameworks' kernels may round differently; measured ~1e-7) and the
same validation accuracy.

A process start costs seconds of CPU (torch ~6 s a rank, DeepSpeed's import several more, TensorFlow ~12 s), so
the runs share 11 launches (`Runs`; 24 until 2026-12): 6 PyTorch, 5 TensorFlow.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from procs import check, command, job_env, losses_by_step, read_metrics, run, train

from polytrain.checkpoint import store as ckpt


def has(module: str) -> bool:
    """Whether ``module`` is installed: looked up, not imported (TensorFlow's import costs this process ~12 s of
    CPU, torch's ~4 s, and only the launched ranks need them)."""
    return importlib.util.find_spec(module) is not None


def need(module: str) -> None:
    if not has(module):
        pytest.skip(f"{module} is not installed")


if not has("torch"):
    pytest.skip("torch is not installed", allow_module_level=True)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

COMMON = ["optimizer.name=adam", "optimizer.lr=0.003", "optimizer.momentum=0.0", "schedule.decay=none",
          "data.global_batch_size=64", "model.params.hidden_sizes=[64]", "loop.epochs=1", "loop.max_steps=20",
          "loop.log_every_n_steps=1"]
SAVED, TOTAL = 10, 20
AFTER = list(range(SAVED + 1, TOTAL + 1))
SAVE = f"checkpoint.every_n_steps={SAVED}"
TOLERANCE = 1e-5  # relative, losses and weights (weights: of each tensor's largest magnitude)
TF_TOLERANCE = 1e-4  # PyTorch vs TensorFlow: the frameworks' kernels round differently
VAL_SAMPLES = 359  # digits' validation split
WORKER = str(Path(__file__).resolve().parent / "resume_worker.py")
# a test's timeout: the first to use a launch starts it (and what it needs); each launch has its own timeout too
FIRST_USE, FIRST_USE_TF = 1200, 1800


@dataclass(frozen=True)
class Job:
    """How one backend runs: processes, launcher (python, torchrun, mpirun or launch-local: procs.command's
    names) and the spec's backend fields."""

    nproc: int
    sets: tuple[str, ...]
    launcher: str = "torchrun"

    @property
    def backend(self) -> str:
        return next(s.partition("=")[2] for s in self.sets if s.startswith("backend="))

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str | None]:
        """The variables this job adds to the loopback environment (``extra`` among them)."""
        away = {"MASTER_ADDR": None} if self.launcher == "mpirun" else {}  # the ranks agree on one through MPI
        return {**away, **(extra or {})}


SOURCES = {
    "local": Job(1, ("backend=local",), "python"),
    "ddp": Job(2, ("backend=ddp",)),
    "fsdp": Job(2, ("backend=fsdp", "fsdp.sharding=full_shard")),
    "zero3": Job(2, ("backend=deepspeed", "deepspeed.stage=3")),
    "zero1": Job(2, ("backend=deepspeed", "deepspeed.stage=1")),
    "horovod": Job(2, ("backend=horovod",)),  # under torchrun: polytrain's Horovod implementation
    "mpi": Job(2, ("backend=mpi",), "mpirun"),
}
TARGETS = {**SOURCES, "ddp@3": Job(3, ("backend=ddp",))}
TORCHRUN_2 = [name for name, job in SOURCES.items() if job.launcher == "torchrun"]  # sources and targets, one launch
TF_SOURCES = {  # in the ring's order
    "tf-local": Job(1, ("framework=tensorflow", "backend=local"), "python"),
    "tf-multiworker": Job(2, ("framework=tensorflow", "backend=tf-multiworker"), "launch-local"),  # polytrain's own
    "tf-mpi": Job(2, ("framework=tensorflow", "backend=mpi"), "mpirun"),
    "tf-horovod": Job(2, ("framework=tensorflow", "backend=horovod"), "mpirun"),
}
TF_ENV = {"TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}


def horovod_tf() -> bool:
    """Whether Horovod is installed with its TensorFlow extension: looked up, not imported (that imports
    TensorFlow: ~12 s of CPU in this process)."""
    spec = importlib.util.find_spec("horovod")  # tests/horovod, a namespace package, has no origin
    return bool(spec and spec.origin and list(Path(spec.origin).parent.glob("tensorflow/mpi_lib*.so")))


@dataclass
class Run:
    out: Path
    losses: dict[int, float]
    state: dict[str, np.ndarray]
    manifest: dict

    @classmethod
    def read(cls, out: Path) -> Run:
        state, manifest = ckpt.read_model(out)
        return cls(out, losses_by_step(out), state, manifest)

    @property
    def checkpoint(self) -> Path:
        return self.out / "checkpoints" / ckpt.step_dir_name(SAVED)


def trained(job: Job, out: Path, env_extra: Mapping[str, str] | None = None, timeout: float = 400) -> Run:
    """A source run (a checkpoint at 10 and 20) through ``polytrain train`` as the job's launcher starts it."""
    check(train(out, [*COMMON, *job.sets, SAVE], launcher=job.launcher, nproc=job.nproc, env=job.env(env_extra),
                timeout=timeout))
    return Run.read(out)


def launched(job: Job, root: Path, runs: Mapping[str, tuple[tuple[str, ...], Path | None]],
             env_extra: Mapping[str, str] | None = None, timeout: float = 600) -> dict[str, Run]:
    """ONE launch of ``resume_worker.py`` on the job's launcher and ranks: each run (name: its own sets and the
    checkpoint it resumes, or None) in turn into ``root/name``; each run's result by name."""
    plan = {"sets": COMMON, "runs": [{"sets": list(sets), "output": str(root / name),
                                      **({"resume": str(resume)} if resume is not None else {})}
                                     for name, (sets, resume) in runs.items()]}
    check(run(command(job.launcher, [WORKER, json.dumps(plan)], job.nproc), env=job_env(job.env(env_extra)),
              timeout=timeout))
    return {name: Run.read(root / name) for name in runs}


def zeroed_moments(checkpoint: Path, root: Path) -> Path:
    """A copy of ``checkpoint`` with Adam's moments zeroed (its weights and step counts kept)."""
    manifest, tensors = ckpt.load_checkpoint(checkpoint)
    optimizer = {k: np.zeros_like(v) if k.endswith(("/exp_avg", "/exp_avg_sq")) else v
                 for k, v in tensors["optimizer"].items()}
    for key in ("format_version", "global_step", "files"):
        manifest.pop(key)
    return ckpt.save_checkpoint(root, SAVED, {"model": tensors["model"], "optimizer": optimizer}, manifest)


class Runs:
    """Every run of the file, made by its launch on first use and kept for the module. PyTorch: the one-process
    and the mpirun source (``polytrain train``); ONE 2-rank torchrun launch: the ddp, fsdp, ZeRO-3, ZeRO-1 and
    Horovod-shim sources, then each of those five backends resuming every source's checkpoint (ddp the TensorFlow
    one too); mpirun, one process (the zeroed moments and TensorFlow's checkpoint too) and 3 torchrun ranks, each
    one launch resuming every source. TensorFlow: tf-local's source (``polytrain train``); each 2-rank TF backend
    in one launch resumes the previous one's checkpoint, then trains its own source; one TF process last resumes
    the last backend's checkpoint (closing the ring) and the PyTorch one-process and ZeRO-3 ones."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sources: dict[str, Run] = {}
        self.resumed: dict[str, dict[str, Run]] = {}  # target: source: its resume
        self.extra: dict[str, Run] = {}  # the zeroed moments' resume and the cross-framework ones
        self.tf: dict[str, Run] = {}  # the TensorFlow sources
        self.ring: dict[tuple[str, str], Run] = {}  # (writer, reader): the reader's resume

    def source(self, name: str) -> Run:
        if name not in self.sources:
            if name in TORCHRUN_2:
                self._torchrun_2()
            else:
                self.sources[name] = trained(SOURCES[name], self.root / "sources" / name)
        return self.sources[name]

    def resumed_by(self, target: str) -> dict[str, Run]:
        """``target``'s resume of every source's step-10 checkpoint, by source."""
        if target in TORCHRUN_2:
            self._torchrun_2()
        elif target not in self.resumed:
            job = TARGETS[target]
            checkpoints = {name: self.source(name).checkpoint for name in SOURCES}
            runs = {f"to-{target}/{name}": (job.sets, path) for name, path in checkpoints.items()}
            extra = {}
            if target == "local":  # Adam's moments zeroed; TensorFlow's checkpoint
                extra["zeroed"] = zeroed_moments(checkpoints["local"], self.root / "zeroed")
                if has("tensorflow"):
                    extra["tensorflow-to-local"] = self.tf_source("tf-local").checkpoint
            done = launched(job, self.root, {**runs, **{name: (job.sets, path) for name, path in extra.items()}})
            self.resumed[target] = {name: done[f"to-{target}/{name}"] for name in SOURCES}
            self.extra.update({name: done[name] for name in extra})
        return self.resumed[target]

    def _torchrun_2(self) -> None:
        if "ddp" in self.resumed:
            return
        checkpoints = {name: self.source(name).checkpoint if name not in TORCHRUN_2
                       else self.root / "sources" / name / "checkpoints" / ckpt.step_dir_name(SAVED)
                       for name in SOURCES}
        runs = {f"sources/{name}": ((*SOURCES[name].sets, SAVE), None) for name in TORCHRUN_2}
        runs |= {f"to-{target}/{name}": (SOURCES[target].sets, path) for target in TORCHRUN_2
                 for name, path in checkpoints.items()}
        if has("tensorflow"):
            runs["tensorflow-to-ddp"] = (SOURCES["ddp"].sets, self.tf_source("tf-local").checkpoint)
        done = launched(SOURCES["ddp"], self.root, runs, timeout=1200)
        self.sources.update({name: done[f"sources/{name}"] for name in TORCHRUN_2})
        self.resumed.update({target: {name: done[f"to-{target}/{name}"] for name in SOURCES} for target in TORCHRUN_2})
        self.extra.update({name: run_ for name, run_ in done.items() if name.startswith("tensorflow-")})

    def from_tensorflow(self, target: str) -> Run:
        """``target`` (local or ddp) resuming tf-local's checkpoint."""
        self.resumed_by(target)
        return self.extra[f"tensorflow-to-{target}"]

    def tf_names(self) -> list[str]:
        """The TensorFlow backends here, in the ring's order (the chain's launches); tf-local alone without mpi4py
        (the ring is skipped then)."""
        return [n for n in TF_SOURCES if n == "tf-local" or has("mpi4py") and (n != "tf-horovod" or horovod_tf())]

    def tf_source(self, name: str) -> Run:
        if name not in self.tf:
            if name == "tf-local":
                self.tf[name] = trained(TF_SOURCES[name], self.root / "tf" / name, TF_ENV)
            else:
                names = self.tf_names()
                for writer, reader in zip(names, names[1:]):  # the chain: resume the writer's, then train
                    job, link = TF_SOURCES[reader], f"{writer}-to-{reader}"
                    done = launched(job, self.root / "tf", {link: (job.sets, self.tf_source(writer).checkpoint),
                                                            reader: ((*job.sets, SAVE), None)}, TF_ENV, 900)
                    self.ring[writer, reader], self.tf[reader] = done[link], done[reader]
        return self.tf[name]

    def in_tensorflow(self) -> None:
        """The last launch: one TF process resumes the ring's last checkpoint and the PyTorch ones."""
        if "torch-local-to-tensorflow" in self.extra:
            return
        last = self.tf_names()[-1]
        runs = {f"torch-{name}-to-tensorflow": (TF_SOURCES["tf-local"].sets, self.source(name).checkpoint)
                for name in ("local", "zero3")}
        if last != "tf-local":
            runs = {f"{last}-to-tf-local": (TF_SOURCES["tf-local"].sets, self.tf_source(last).checkpoint), **runs}
        done = launched(TF_SOURCES["tf-local"], self.root / "tf", runs, TF_ENV)
        if last != "tf-local":
            self.ring[last, "tf-local"] = done.pop(f"{last}-to-tf-local")
        self.extra.update(done)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("resume-matrix"))


def relative(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))


def weight_difference(state: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    """The largest difference of any tensor, relative to that tensor's largest magnitude."""
    assert set(state) == set(ref)
    return max(float(np.max(np.abs(state[k] - ref[k])) / np.max(np.abs(ref[k]))) for k in ref)


def continuation_problems(resumed: Run, source: Run, tolerance: float) -> tuple[list[str], str]:
    """What is wrong with ``resumed`` as the continuation of ``source`` from step 10 (nothing: []), and by how much
    its losses and final weights differ."""
    problems = []
    resumes = read_metrics(resumed.out, "resume")
    if [(e["step"], e["path"]) for e in resumes] != [(SAVED, str(source.checkpoint))]:
        problems.append(f"resume events {resumes}")
    if sorted(resumed.losses) != AFTER:  # a restart would log steps 1–20
        problems.append(f"logged steps {sorted(resumed.losses)}, not 11–20")
        return problems, "-"
    loss_rel = relative([resumed.losses[s] for s in AFTER], [source.losses[s] for s in AFTER])
    if loss_rel > tolerance:
        problems.append(f"losses 11–20 differ by {loss_rel:.1e} relative")
    if resumed.manifest["global_step"] != TOTAL:
        problems.append(f"ended at step {resumed.manifest['global_step']}")
    weight_rel = weight_difference(resumed.state, source.state)
    if weight_rel > tolerance:
        problems.append(f"final weights differ by {weight_rel:.1e}")
    if abs(resumed.manifest["val_accuracy"] - source.manifest["val_accuracy"]) > 0.5 / VAL_SAMPLES:
        problems.append(f"val accuracy {resumed.manifest['val_accuracy']} vs {source.manifest['val_accuracy']}")
    return problems, f"losses {loss_rel:.0e}, weights {weight_rel:.0e}"


# ------------------------------------------------------------------------------ PyTorch backends


@pytest.mark.timeout(FIRST_USE)
@pytest.mark.parametrize("name", SOURCES)
def test_source_runs_checkpoint_and_agree(name: str, runs: Runs) -> None:
    """Every source checkpoints at 10 and 20 and trains like one process (so all sources are one reference)."""
    run_ = runs.source(name)
    job = SOURCES[name]
    assert [p.name for p in ckpt.complete_checkpoints(run_.out / "checkpoints")] == ["step-00000010",
                                                                                    "step-00000020"]
    manifest = ckpt.verify(run_.checkpoint)
    assert (manifest["backend"], manifest["world_size"], manifest["step_in_epoch"]) == (job.backend, job.nproc, SAVED)
    _, tensors = ckpt.load_checkpoint(run_.checkpoint)
    moments = {k: v for k, v in tensors["optimizer"].items() if k.endswith("/exp_avg_sq")}
    assert len(moments) == 4 and all(np.any(v > 0) for v in moments.values())  # Adam's state is in there
    steps = {k: v for k, v in tensors["optimizer"].items() if k.endswith("/step")}
    assert all(v.shape == () for v in steps.values()), "Adam's step must stay a scalar"
    assert {float(v) for v in steps.values()} == {SAVED}, f"Adam's step counts at step {SAVED}: {steps}"
    assert sorted(run_.losses) == list(range(1, TOTAL + 1))
    assert run_.losses[TOTAL] < run_.losses[1] - 0.3  # it learned
    if name != "local":
        local = runs.source("local")
        assert relative(list(run_.losses.values()), list(local.losses.values())) < TOLERANCE
        assert weight_difference(run_.state, local.state) < TOLERANCE


@pytest.mark.timeout(FIRST_USE)
@pytest.mark.parametrize("target", TARGETS)
def test_resume_from_every_backend(target: str, runs: Runs) -> None:
    """``target`` resumes each source's step-10 checkpoint and continues it exactly (steps 11–20)."""
    resumed = runs.resumed_by(target)
    assert list(resumed) == list(SOURCES)
    failures, report = [], []
    for name, run_ in resumed.items():
        assert run_.manifest["backend"] == TARGETS[target].backend
        assert run_.manifest["world_size"] == TARGETS[target].nproc
        problems, differences = continuation_problems(run_, runs.source(name), TOLERANCE)
        report.append(f"{name}→{target}: {differences}")
        failures += [f"{name}→{target}: {p}" for p in problems]
    print("\nrelative differences: " + "; ".join(report))
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(FIRST_USE)
def test_resume_with_adam_moments_zeroed_is_caught(runs: Runs) -> None:
    """The check above would catch lost optimizer state: zeroed moments miss the reference by far (the one-process
    target's launch resumes the one-process source's checkpoint with them zeroed)."""
    source = runs.source("local")
    runs.resumed_by("local")
    losses = runs.extra["zeroed"].losses
    assert sorted(losses) == AFTER
    assert losses[SAVED + 1] == pytest.approx(source.losses[SAVED + 1], rel=TOLERANCE)  # same weights at step 11
    miss = relative([losses[s] for s in AFTER], [source.losses[s] for s in AFTER])
    print(f"\nzeroed Adam moments: losses 11–20 miss the reference by {miss:.1e} relative")
    assert miss > 100 * TOLERANCE


# ------------------------------------------------------------------------------ PyTorch ↔ TensorFlow


@pytest.mark.timeout(FIRST_USE_TF)
def test_tensorflow_checkpoint_resumes_in_torch(runs: Runs) -> None:
    """A TensorFlow run's checkpoint (the one-process run of the TF ring) continues on PyTorch, on one process and
    on 2 DDP ranks (in the launches of those two targets)."""
    need("tensorflow")
    source = runs.tf_source("tf-local")
    assert source.manifest["framework"] == "tensorflow" and source.losses[TOTAL] < source.losses[1] - 0.3
    failures = []
    for name in ("local", "ddp"):
        resumed = runs.from_tensorflow(name)
        assert resumed.manifest["framework"] == "torch"
        problems, differences = continuation_problems(resumed, source, TF_TOLERANCE)
        print(f"\ntensorflow → torch {name}: {differences}")
        failures += [f"tensorflow → torch {name}: {p}" for p in problems]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(FIRST_USE_TF)
def test_tensorflow_backends_resume_each_other(runs: Runs) -> None:
    """A ring over the TensorFlow backends (local → tf-multiworker → mpi → horovod → local): each resumes the
    previous one's step-10 checkpoint and continues it exactly as that backend went on, so every backend's
    checkpoint is read by another backend and every backend reads one it did not write. Every backend trains
    like one process (its losses equal tf-local's), which makes any pair of them as good as the ring's: the
    checkpoint is one format whoever writes it. (All 16 ordered pairs, until 2026-12-03, cost 11 TensorFlow
    launches; the ring 8 until 2026-12-03, now a chain of 5: `Runs`.)"""
    need("tensorflow")
    need("mpi4py")
    names = runs.tf_names()
    sources = {name: runs.tf_source(name) for name in names}
    runs.in_tensorflow()
    failures, report = [], []
    local = sources["tf-local"]
    for name, source in sources.items():  # every TF backend trains like one process
        assert relative(list(source.losses.values()), list(local.losses.values())) < TOLERANCE, name
    for writer, reader in zip(names, [*names[1:], names[0]]):
        job = TF_SOURCES[reader]
        run_ = runs.ring[writer, reader]
        assert (run_.manifest["backend"], run_.manifest["world_size"]) == (job.backend, job.nproc)
        problems, differences = continuation_problems(run_, sources[writer], TOLERANCE)
        report.append(f"{writer}→{reader}: {differences}")
        failures += [f"{writer}→{reader}: {p}" for p in problems]
    print("\nrelative differences: " + "; ".join(report))
    assert len(report) == len(names) and not failures, "\n".join(failures)


@pytest.mark.timeout(FIRST_USE_TF)
def test_torch_checkpoint_resumes_in_tensorflow(runs: Runs) -> None:
    """PyTorch checkpoints (one process, and ZeRO-3 on 2 ranks) continue in TensorFlow as PyTorch went on."""
    need("tensorflow")
    runs.in_tensorflow()
    failures = []
    for name in ("local", "zero3"):
        run_ = runs.extra[f"torch-{name}-to-tensorflow"]
        assert run_.manifest["framework"] == "tensorflow"
        problems, differences = continuation_problems(run_, runs.source(name), TF_TOLERANCE)
        print(f"\ntorch {name} → tensorflow: {differences}")
        failures += [f"torch {name} → tensorflow: {p}" for p in problems]
    assert not failures, "\n".join(failures)
