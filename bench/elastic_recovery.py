"""Training in place against a restart: the time from a SIGKILLed rank to the next trained step, the steps trained
again, and the steady-state cost of the commits (issue 51's figures).

Run:  python bench/elastic_recovery.py [--kill-after 25] [--every 10] [--backend ddp|fsdp] [--horovod]
      (~4 min on 2 cores)

One job, 3 ranks of ddp (or ``--backend fsdp``) on loopback: the digits data on a wider MLP (hidden [512, 512]),
a global batch of 96, every step logged. Once the job has logged step ``--kill-after`` (not a multiple of
``--every``), the bench SIGKILLs the process of rank 1 and times how long until the job logs a step it had logged
before: the first step trained after the recovery (a step logged right after the kill may have been trained
before it).

- in place: ``polytrain launch --launcher local --elastic`` (each rank on a loopback host of its own), a commit
  every ``--every`` steps: the two survivors roll back to their last commit and go on at 2 ranks;
- the reference: ``torchrun --max-restarts 1`` with a checkpoint every ``--every`` steps: every rank is started
  again and the job resumes from the newest checkpoint at 3 ranks.

Steps trained again: the kill step minus the step the job went on from. Then the commits' cost: the same elastic
job without a kill, its median step time with a commit every step and every 10 steps, as a ratio to one with a
commit only at the start. (Ray's restart and fsdp are not measured here: fsdp does not train in place yet.)

``--horovod`` (issue 50's figures): the same three measurements for a Horovod user's elastic script on
polytrain's Horovod implementation (`worker`, in this file: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``,
``state.commit()`` every ``--every`` steps, the same MLP and data, 32 samples per rank), in place under
``polytrain launch --launcher horovodrun --min-np 2`` against ``torchrun --max-restarts 1``, where the shim restores
the last commit rank 0 wrote to its state file.
The tests (tests/multiproc/test_elastic_trainer.py, test_elastic_own_loop.py) assert the samples and the weights;
the times are measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from polytrain.comm.net import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
HOSTS = "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"


def spec(root: Path, name: str, every: int | None, elastic: bool, backend: str = "ddp") -> tuple[Path, Path]:
    out = root / name
    table = {"framework": "torch", "backend": backend, "model": {"name": "mlp", "params": {"hidden_sizes": [512, 512]}},
             "data": {"name": "digits", "global_batch_size": 96}, "loop": {"epochs": 1000, "log_every_n_steps": 1},
             "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "output": str(out)}
    if elastic:
        table["elastic"] = {"min_np": 2, "max_np": 3, "commit_every_n_steps": every or 10**9}
    elif every:
        table["checkpoint"] = {"every_n_steps": every}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(table))
    return path, out


def steps(out: Path) -> list[tuple[int, float]]:
    """(step, time) of every step record rank 0 logged so far (the Trainer's metrics, or `worker`'s lines)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        steps_file = out / "steps.txt"
        if not steps_file.exists():
            return []
        return [(int(a), float(b)) for a, b, *_ in (line.split() + ["", ""] for line in
                                                   steps_file.read_text().splitlines()) if b]
    found = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if record.get("event") == "step":
            found.append((int(record["step"]), float(record["time"])))
    return found


def rank_pid(tag: str, rank: int) -> int:
    """The process of rank ``rank`` of the job whose environment holds ``POLYTRAIN_BENCH_TAG=tag``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item)
        except OSError:
            continue
        # a rank: the elastic driver's workers carry HOROVOD_RANK, torchrun's RANK (neither launcher does)
        if env.get("POLYTRAIN_BENCH_TAG") == tag and env.get("HOROVOD_RANK", env.get("RANK")) == str(rank):
            return int(entry.name)
    raise RuntimeError(f"no process of rank {rank} found")


def start(cmd: list[str], tag: str) -> subprocess.Popen:
    env = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "HOME": os.environ["HOME"],
           "PATH": f"{BIN}:/usr/bin:/bin", "POLYTRAIN_BENCH_TAG": tag, "POLYTRAIN_ELASTIC_DISCOVERY_INTERVAL": "0.2",
           "HOROVOD_GLOO_TIMEOUT_SECONDS": "60", "POLYTRAIN_HOROVOD_IMPL": "shim"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def stop(job: subprocess.Popen) -> None:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def wait_for(job: subprocess.Popen, out: Path, done: object, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if job.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what}:\n{job.stdout.read()[-3000:] if job.poll() is not None else 'timed out'}")
        time.sleep(0.02)


def repeated(out: Path) -> tuple[int, float, int] | None:
    """The first step logged a second time (the job went back to a commit or a checkpoint): its number, when, and
    the last step logged before it; None before there is one."""
    highest = 0
    for step, when in steps(out):
        if step <= highest:
            return step, when, highest
        highest = step
    return None


def killed(name: str, cmd: list[str], out: Path, after: int) -> dict:
    """Kill rank 1 once step ``after`` is logged; the seconds until the first step trained again is logged, and
    how many steps were trained again."""
    tag = uuid.uuid4().hex
    job = start(cmd, tag)
    try:
        wait_for(job, out, lambda: any(s >= after for s, _ in steps(out)), f"{name}: step {after} never logged")
        os.kill(rank_pid(tag, 1), signal.SIGKILL)
        sent = time.time()
        wait_for(job, out, lambda: repeated(out) is not None, f"{name}: no step trained again after the kill")
        first, when, last = repeated(out)
        return {"case": name, "last_step_before": last, "went_on_from": first - 1, "redone": last - (first - 1),
                "seconds_to_next_step": round(when - sent, 2)}
    finally:
        stop(job)


def step_time(cmd: list[str], out: Path, first: int, last: int) -> float:
    """The median time between consecutive logged steps from ``first`` to ``last``."""
    job = start(cmd, uuid.uuid4().hex)
    try:
        wait_for(job, out, lambda: any(s >= last for s, _ in steps(out)), f"step {last} never logged")
    finally:
        stop(job)
    times = dict(steps(out))
    return statistics.median(times[s] - times[s - 1] for s in range(first + 1, last + 1))


def worker(out: Path, every: int) -> None:
    """A Horovod user's elastic loop on polytrain's implementation; rank 0 appends ``step time`` lines to
    ``out/steps.txt`` (the step count is the state's: it goes back with a rollback)."""
    import torch
    from sklearn.datasets import load_digits
    from torch.utils.data import DataLoader, TensorDataset

    import polytrain.horovod.torch as hvd

    hvd.init()
    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)

    @hvd.elastic.run
    def train(state: Any) -> None:
        for epoch in range(state.epoch, 1000):
            state.epoch = epoch
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                state.sampler.record_batch(i, 32)
                state.step += 1
                if hvd.rank() == 0:
                    with open(out / "steps.txt", "a") as log:
                        log.write(f"{state.step} {time.time():.3f}\n")
                if state.step % every == 0:
                    state.commit()
            state.sampler.set_epoch(state.epoch + 1)

    train(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill-after", type=int, default=25)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--backend", choices=("ddp", "fsdp"), default="ddp", help="the Trainer's backend")
    parser.add_argument("--horovod", action="store_true", help="a Horovod elastic script instead of the Trainer")
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "EVERY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker[0]), int(args.worker[1]))
    cli = [str(BIN / "python"), "-m", "polytrain.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def job(name: str, every: int | None, elastic: bool) -> tuple[list[str], Path]:
            """The command line and output folder of one job: the Trainer's or `worker`'s."""
            if args.horovod:
                out = root / name
                out.mkdir()
                program = [__file__, "--worker", str(out), str(every or 10**9)]
                if elastic:
                    return [*cli, "launch", "--launcher", "horovodrun", "-np", "3", "--min-np", "2", "-H", HOSTS,
                            *program], out
                return [str(BIN / "torchrun"), "--nproc_per_node=3", "--max-restarts=1", "--master_addr=127.0.0.1",
                        f"--master_port={free_port()}", *program], out
            path, out = spec(root, name, every, elastic, args.backend)
            if elastic:
                return [*cli, "launch", "--launcher", "local", "--elastic", "-np", "3", "--min-np", "2", "-H", HOSTS,
                        str(path)], out
            return [str(BIN / "torchrun"), "--nproc_per_node=3", "--max-restarts=1", "--master_addr=127.0.0.1",
                    f"--master_port={free_port()}", "-m", "polytrain.cli", "train", str(path), "--quiet"], out

        in_place = killed("in place (polytrain launch --elastic)", *job("in-place", args.every, True),
                          args.kill_after)
        restart = killed("torchrun --max-restarts 1, from the last checkpoint" if not args.horovod else
                         "torchrun --max-restarts 1, from the last commit's file", *job("restart", args.every, False),
                         args.kill_after)
        for row in (in_place, restart):
            print(json.dumps(row))
        ratio = in_place["seconds_to_next_step"] / restart["seconds_to_next_step"]
        goal = 0.5 if args.horovod else 0.333
        print(f"time from the kill to the next step, in place / torchrun's restart: {ratio:.3f} (goal <= {goal})")
        medians = {}
        for every in (10**9, args.every, 1):
            medians[every] = step_time(*job(f"commits-{every}", every, True), 20, 80)
        base = medians[10**9]
        for every in (1, args.every):
            print(f"step time with a commit every {every} step(s) / with none after the start: "
                  f"{medians[every] / base:.3f} (median {medians[every] * 1000:.1f} ms against {base * 1000:.1f} ms; "
                  f"goal <= {1.05 if args.horovod else 1.03} at every step)")


if __name__ == "__main__":
    main()
