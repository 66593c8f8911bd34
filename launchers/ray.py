"""The ``ray`` launcher: N workers on a Ray cluster through Ray Train (``polytrain launch --launcher ray``).

Without ``--ray-address`` a local Ray is started for the job (as many logical CPUs as workers, when the machine
has fewer) and stopped after it; with one, the job runs on that cluster. The workers are Ray Train's: a
`DataParallelTrainer` of ``-np`` workers (a GPU each where the driver sees one) with
``FailureConfig(max_failures=--max-restarts)``. Ray Train's ``TorchTrainer`` would make a torch process group in
each worker actor and ``TensorflowTrainer`` a ``TF_CONFIG``; polytrain's backends make their own (ddp, fsdp,
DeepSpeed, Horovod, MPI, tf-multiworker alike), so the base trainer is used and nothing is made twice.

Each worker actor starts the program (``polytrain train SPEC ...`` or the script; in the driver's working directory
where the node has it) as a child process with
torchrun's variables: ranks from Ray Train's context, ``GROUP_RANK`` its node rank, ``MASTER_ADDR``/``MASTER_PORT``
chosen by rank 0's actor (loopback on a local Ray, else its node's address) and broadcast with Ray Train's
collective, ``POLYTRAIN_LAUNCHER=ray`` (`polytrain.environments.ray`) and ``POLYTRAIN_RESTART_COUNT``: Ray restarts
the whole worker group after a failure (rank 0 counts this launch's group starts in a file of its own, removed
after), and a restarted spec run with checkpoints resumes from its latest, exactly as under the other launchers.
A child that fails fails its actor, naming its rank and node. When the children end,
every worker reports to Ray Train (`ray.train.report`): rank 0 the last epoch record of ``metrics.jsonl`` and the
run's final model directory as the checkpoint, so Ray's result and checkpoint manager see them; the output
directory is the same as under any launcher. Ray's own files go under ``<output>/ray`` for a spec, else Ray's
default.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polytrain.errors import LaunchError
from polytrain.launchers.base import Launcher, LaunchRequest, launch_spec

LOOPBACK = "127.0.0.1"
RAY_NICENESS = "RAY_worker_niceness"  # the niceness Ray gives its worker processes (15 by default)
INSTALL_HINT = "pip install 'polytrain[ray]'"


def import_ray() -> Any:
    """Ray with Ray Train, or the one-line `LaunchError` naming the extra to install."""
    try:
        import ray
        import ray.train  # noqa: F401 - Ray Train is the ray[train] extra
    except ImportError as exc:
        raise LaunchError(f"--launcher ray: Ray Train is not installed ({INSTALL_HINT}): {exc}") from None
    return ray


#: backends that take their ranks from an MPI launcher, and what runs on Ray instead (torch's horovod backend runs
#: polytrain's implementation over gloo there; TensorFlow's needs MPI)
MPI_LAUNCHED = {("tensorflow", "mpi"): "tf-multiworker", ("tensorflow", "horovod"): "tf-multiworker",
                ("torch", "mpi"): "ddp"}


def _spec_output(program: list[str]) -> Path | None:
    """The output directory of a ``polytrain train SPEC`` program (`base.program_for_target`'s form; its --set
    output= wins), or None for a script; a spec whose backend needs an MPI launcher is refused here, before Ray
    starts."""
    if program[1:4] != ["-m", "polytrain.cli", "train"] or len(program) < 5:
        return None
    try:
        spec = launch_spec(program[4], program[5:])
    except Exception:  # noqa: BLE001 - `polytrain launch` checked the spec already; the workers say what is wrong
        return None
    if (spec.framework, spec.backend) in MPI_LAUNCHED:
        raise LaunchError(f"--launcher ray: backend {spec.backend!r} takes its ranks from an MPI launcher (mpirun, "
                          f"horovodrun); on Ray use backend '{MPI_LAUNCHED[spec.framework, spec.backend]}'")
    return Path(spec.output).absolute()


class RayLauncher(Launcher):
    name = "ray"

    def build_command(self, req: LaunchRequest) -> list[str]:
        """What each Ray worker runs (Ray Train starts the workers: there is no launcher binary)."""
        return list(req.program)

    def describe(self, req: LaunchRequest) -> str:
        where = req.ray_address or "a local Ray started for the job"
        return (f"# Ray Train DataParallelTrainer: {req.nproc} workers on {where}, max_failures={req.max_restarts}; "
                f"each runs:\n{' '.join(req.program)}")

    def run(self, req: LaunchRequest) -> int:
        if req.hosts:
            raise LaunchError("--launcher ray runs on the Ray cluster's nodes: give --ray-address, not -H/--hostfile")
        ray = import_ray()
        from ray.train import RunConfig, ScalingConfig
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        output = _spec_output(list(req.program))
        # this launch's count of group starts (rank 0 keeps it on its node; removed after): a later launch into the
        # same output starts from 0, not as a restart
        attempts = (output / "ray" if output else Path(tempfile.gettempdir())) / f".attempts-{uuid.uuid4().hex}"
        with contextlib.ExitStack() as stack:
            stack.callback(lambda: attempts.unlink(missing_ok=True))
            stack.enter_context(ray_session(ray, req.ray_address, req.nproc, env=dict(req.env)))
            gpu = bool(ray.cluster_resources().get("GPU"))
            trainer = DataParallelTrainer(
                _worker, train_loop_config={"program": list(req.program), "attempts": str(attempts),
                                            "loopback": not req.ray_address, "output": str(output or ""),
                                            "cwd": os.getcwd()},
                scaling_config=ScalingConfig(num_workers=req.nproc, use_gpu=gpu),
                run_config=RunConfig(name=f"polytrain-{os.getpid()}",
                                     storage_path=str(output / "ray") if output else None,
                                     failure_config=_failures(req.max_restarts)))
            try:
                trainer.fit()
            except Exception as exc:  # noqa: BLE001 - Ray's TrainingFailedError holds each failed worker's error
                print(f"polytrain: the Ray job failed: {_failure_line(exc)}", file=sys.stderr, flush=True)
                return 1
            return 0


@contextlib.contextmanager
def ray_session(ray: Any, address: str | None, workers: int, *, worker_output: bool = True,
                env: dict[str, str] | None = None) -> Iterator[None]:
    """Ray for the duration of a job: connected to the cluster at ``address``, or a local Ray sized for ``workers``
    (`_connect`); shut down after, a local Ray's session files (logs, sockets) removed with it. ``worker_output``:
    Ray's workers' output is shown here (a sweep's trials write theirs to files). ``env`` (the ``-x`` variables)
    reaches every worker without travelling in the job's config, which Ray keeps: a local Ray's processes inherit
    this process's environment, and a cluster gets them as the job's runtime environment."""
    os.environ.update(env or {})
    temp = _connect(ray, address, workers, worker_output, env or {})
    try:
        yield
    finally:
        started = _descendants() if temp is not None else []
        ray.shutdown()
        if temp is not None:
            _end(started)
            shutil.rmtree(temp, ignore_errors=True)


def _descendants() -> list[Any]:
    """The processes this one started and their children: a local Ray's (raylet, GCS, its workers)."""
    import psutil

    return psutil.Process().children(recursive=True)


def _end(processes: list[Any], wait_s: float = 10.0) -> None:
    """Wait for a local Ray's processes to end, and kill what is left: `ray.shutdown` returns before its workers
    (a placement-group cleaner, say) have exited, and a loaded machine kept one running past the job's end."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=wait_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


def _connect(ray: Any, address: str | None, workers: int, worker_output: bool, env: dict[str, str]) -> str | None:
    """``ray.init`` on the cluster at --ray-address, or on a local Ray sized for the job, its session files in a
    temporary directory of its own (returned, for removal after the job)."""
    if address:
        _check_reachable(address)  # Ray itself retries a wrong address for minutes
        try:
            ray.init(address=address, include_dashboard=False, logging_level="WARNING", log_to_driver=worker_output,
                     runtime_env={"env_vars": env} if env else None)
        except Exception as exc:  # noqa: BLE001 - every way an address can be wrong
            detail = " ".join(str(exc).split())[:200]
            raise LaunchError(f"--ray-address {address}: cannot connect to a Ray cluster there "
                              f"({type(exc).__name__}: {detail}); give the head's host:port (ray status shows it), "
                              f"or leave --ray-address out for a local Ray") from None
        return None
    cpus = max(workers, os.cpu_count() or 1)  # logical CPUs: one per worker, even on a smaller machine
    temp = tempfile.mkdtemp(prefix="polytrain-ray-")  # short: Ray's socket paths live under it
    # Ray starts its workers at nice 15, and the ranks they run inherit it: beside any other busy process the job
    # would get a sliver of the CPU. A local Ray is the job's own, so its ranks run at the launcher's priority, as
    # under torchrun (a value the user set is kept).
    os.environ.setdefault(RAY_NICENESS, "0")
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level="WARNING", log_to_driver=worker_output,
             _node_ip_address=LOOPBACK, _temp_dir=temp)
    return temp


def head_refusal(address: str, timeout: float) -> str | None:
    """Why the Ray head at ``HOST:PORT`` does not take a connection within ``timeout`` seconds (the error's text),
    or None when it does; ``ValueError`` when ``address`` is not ``HOST:PORT``."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise ValueError(address)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        return str(exc.strerror or exc)
    return None


def _check_reachable(address: str) -> None:
    """A ``host:port`` --ray-address must accept a connection within seconds (``auto``, ``ray://`` go to Ray)."""
    if address == "auto" or "://" in address:
        return
    try:
        refused = head_refusal(address, timeout=5)
    except ValueError:
        raise LaunchError(f"--ray-address {address}: expected HOST:PORT of the Ray head (ray status shows it), "
                          f"'auto', or ray://HOST:PORT") from None
    if refused is not None:
        raise LaunchError(f"--ray-address {address}: no Ray head answers there ({refused}); start one "
                          f"with `ray start --head`, or leave --ray-address out for a local Ray")


def _failures(max_restarts: int) -> Any:
    """Ray Train's failure handling for ``--max-restarts``: that many restarts of the worker group after a worker
    fails, and as many retries of a group that cannot start. Ray's default retries such a group for ever: after a
    lost node, workers that no longer fit the cluster would leave the job waiting, never failing."""
    from ray.train import FailureConfig

    return FailureConfig(max_failures=max_restarts, controller_failure_limit=max_restarts)


def _failure_line(exc: BaseException) -> str:
    """What failed, from Ray's error: each worker's ``rank R on NODE: ... exited with code C``; workers that could
    not be placed (the cluster has no room for them: a lost node, too few CPUs or GPUs); else the error's start."""
    text = " ".join(str(exc).split())
    ranks = sorted(set(re.findall(r"rank \d+ on \S+: .*? exited with code -?\d+", text)))
    if ranks:
        return "; ".join(ranks)
    unplaced = re.search(r"startup timed out after ([\d.]+) seconds waiting for (\d+) workers", text)
    if unplaced:
        return (f"Ray could not place the {unplaced.group(2)} workers within {float(unplaced.group(1)):g} s: the "
                f"cluster has no room for them (a node lost, or too few CPUs/GPUs free; `ray status` shows them); "
                f"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S on the cluster sets how long it waits")
    return text[:400] + ("..." if len(text) > 400 else "")


def _worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: run the program as a child with torchrun's variables, then report to Ray."""
    import ray.train
    from ray.train import collective

    from polytrain.comm.net import free_port

    ctx = ray.train.get_context()
    rank, size = ctx.get_world_rank(), ctx.get_world_size()
    node = LOOPBACK if config["loopback"] else ray.util.get_node_ip_address()
    output = Path(config["output"]) if config["output"] else None
    attempt = 0
    if rank == 0:  # how many times Ray has started this launch's group: rank 0 counts on its node
        counter = Path(config["attempts"])
        counter.parent.mkdir(parents=True, exist_ok=True)
        attempt = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(attempt + 1))
    address, port, attempt = collective.broadcast_from_rank_zero((node, free_port(), attempt))
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size),
           "LOCAL_RANK": str(ctx.get_local_rank()), "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()),
           "GROUP_RANK": str(ctx.get_node_rank()), "MASTER_ADDR": address, "MASTER_PORT": str(port),
           "POLYTRAIN_LAUNCHER": "ray", "POLYTRAIN_RESTART_COUNT": str(attempt)}
    cwd = config["cwd"] if os.path.isdir(config["cwd"]) else None  # the driver's, where this node has it
    code = subprocess.run(config["program"], env=env, cwd=cwd, check=False).returncode
    if code != 0:
        raise RuntimeError(f"rank {rank} on {node}: {' '.join(config['program'][:4])} ... exited with code {code}")
    metrics, checkpoint = {}, None
    if rank == 0 and output is not None:
        metrics = _last_epoch(output / "metrics.jsonl")
        if (output / "model.safetensors").exists():
            checkpoint = ray.train.Checkpoint.from_directory(str(_model_dir(output)))
    ray.train.report(metrics, checkpoint=checkpoint)


def _last_epoch(path: Path) -> dict[str, Any]:
    """The last ``epoch`` record of ``metrics.jsonl`` (numbers only), with its step; empty when there is none."""
    from polytrain.observe.metrics import read_records

    epochs = [record for record in read_records(path)[0] if record.get("event") == "epoch"]
    return {k: v for k, v in (epochs[-1] if epochs else {}).items() if isinstance(v, (int, float)) and k != "time"}


def _model_dir(output: Path) -> Path:
    """The final model's two files alone in a directory (Ray copies a checkpoint directory whole)."""
    target = output / "ray" / "model"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "model.json"):
        shutil.copy2(output / name, target / name)
    return target


LAUNCHER = RayLauncher()
