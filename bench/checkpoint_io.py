"""Checkpoint save and load (resume) time and size on disk, for the transformer LM on each PyTorch backend.

Run:  python bench/checkpoint_io.py [--backends ddp,fsdp,...] [--saves N] [--loads N]
      (local on 1 process; ddp, fsdp, zero3 and horovod on 2 ranks under torchrun; mpi on 2 under mpirun)

The zoo's transformer LM (d_model 256, 8 heads, 4 blocks, vocab 1024, 64 tokens, tied head:
~3.4 M parameters Ψ), Adam, fp32, a global batch of 16 sequences. What a checkpoint holds:
the consolidated weights (the tied embedding under both of its names), Adam's two moments
and step per parameter, and the manifest; so about 3 × 4Ψ plus the duplicated embedding.

How it is timed. ``metrics.jsonl`` records a ``checkpoint`` event per save, with the
wall-clock ``time`` (ms) of every event but no duration. With ``loop.log_every_n_steps: 1``
the Trainer writes step k's event, then saves checkpoint k (every rank gathers the full
state, rank 0 writes, fsyncs and renames), then writes the checkpoint event. So

- save time = t(checkpoint k) − t(step k), the median over ``--saves`` saves
  (``checkpoint.every_n_steps: 1``) of one ``polytrain train`` run;
- step time = t(step k+1) − t(checkpoint k), the median over the same run (for the save/step ratio).

A resume logs only its end (the ``resume`` event), so the load is timed in a process started by
the same launcher that runs the Trainer with ``--resume`` on the newest of those checkpoints and
nothing left to train: a subclass times the Trainer's own restore (find and verify the checkpoint:
sizes and SHA-256 of every file; read the safetensors; scatter weights and optimizer state into
the backend's model and optimizer) between two barriers, so the slowest rank counts. The
median of ``--loads`` restores in that process is reported (the first one included: the files
are in the page cache after the save either way). Size = the bytes of the checkpoint's files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LM = {"d_model": 256, "n_heads": 8, "n_layers": 4}
TOKENS = {"vocab": 1024, "seq_len": 64, "samples": 1024}
GLOBAL_BATCH = 16
BACKENDS: dict[str, tuple[int, str, dict[str, Any]]] = {  # name → processes, launcher, spec fields
    "local": (1, "python", {"backend": "local"}),
    "ddp": (2, "torchrun", {"backend": "ddp"}),
    "fsdp": (2, "torchrun", {"backend": "fsdp", "fsdp": {"sharding": "full_shard"}}),
    "zero3": (2, "torchrun", {"backend": "deepspeed", "deepspeed": {"stage": 3}}),
    "horovod": (2, "torchrun", {"backend": "horovod"}),
    "mpi": (2, "mpirun", {"backend": "mpi"}),
}


def spec_dict(name: str, output: str, **extra: Any) -> dict[str, Any]:
    return {**BACKENDS[name][2], "output": output, "model": {"name": "transformer", "params": LM},
            "data": {"name": "tokens", "tokens": TOKENS, "global_batch_size": GLOBAL_BATCH},
            "optimizer": {"name": "adam", "lr": 1e-3}, "loop": {"epochs": 1, "log_every_n_steps": 1, **extra}}


# ------------------------------------------------------------------------------ the load worker


def worker(raw_json: str, checkpoint: str, loads: int, out_file: str) -> None:
    """Every rank: ``loads`` Trainer runs resuming from ``checkpoint`` with nothing left to train."""
    from polytrain import validation
    from polytrain.environments import detect_world
    from polytrain.train import trainer as trainer_mod
    from polytrain.train.checkpoints import Restored, RunCheckpoints
    from polytrain.train.trainer import Trainer

    class TimedRestore(RunCheckpoints):
        seconds: list[float] = []

        def _restore(self, resume: str, accept_changed_data: bool) -> Restored | None:
            self.backend.barrier()
            start = time.perf_counter()
            position = super()._restore(resume, accept_changed_data)
            self.backend.barrier()
            TimedRestore.seconds.append(time.perf_counter() - start)
            return position

    trainer_mod.RunCheckpoints = TimedRestore  # the Trainer makes its checkpoints object with it

    world = detect_world()
    raw = json.loads(raw_json)
    group = world.size > 1 and raw["backend"] != "mpi"
    if group:  # one process group for every run (a backend only starts one when none exists)
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=world.rank, world_size=world.size,
                                timeout=datetime.timedelta(seconds=300))
    times = []
    for _ in range(loads):
        spec = validation.from_dict({**raw, "output": tempfile.mkdtemp(prefix="polytrain-ckpt-io-")})
        TimedRestore.seconds.clear()
        Trainer(spec, world, show_progress=False, resume=checkpoint).fit()
        if len(TimedRestore.seconds) != 1:
            raise SystemExit("the Trainer no longer restores through RunCheckpoints._restore(); update this benchmark")
        times.append(TimedRestore.seconds[0])
    if world.rank == 0:
        Path(out_file).write_text(json.dumps(times))
    if group:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ the driver


def command(name: str, program: list[str]) -> tuple[list[str], dict[str, str]]:
    from polytrain.comm.net import free_port

    nproc, launcher, _ = BACKENDS[name]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "OMPI_MCA_btl_tcp_if_include": "lo",
           "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    if launcher == "mpirun":
        env.pop("MASTER_ADDR", None)
        return [str(BIN / "mpirun"), "--oversubscribe", "-np", str(nproc), sys.executable, *program], env
    if launcher == "python":
        return [sys.executable, *program], env
    return [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", *program], {**env, "MASTER_ADDR": "127.0.0.1"}


def launch(name: str, program: list[str]) -> None:
    cmd, env = command(name, program)
    result = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} … exited {result.returncode}: {result.stderr.strip()[-600:]}")


def measure(name: str, saves: int, loads: int, root: Path) -> dict[str, float]:
    from safetensors import safe_open

    out = root / name
    spec_file = root / f"{name}.json"
    spec_file.write_text(json.dumps(spec_dict(name, str(out), max_steps=saves)))
    launch(name, ["-m", "polytrain.cli", "train", str(spec_file), "--quiet", "--set", "checkpoint.every_n_steps=1",
                  "--set", f"checkpoint.keep_last={saves}"])
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    at = {(e["event"], e["step"]): e["time"] for e in events if e["event"] in ("step", "checkpoint")}
    save_times = [at["checkpoint", k] - at["step", k] for k in range(1, saves + 1)]
    step_times = [at["step", k + 1] - at["checkpoint", k] for k in range(1, saves)]

    newest = out / "checkpoints" / f"step-{saves:08d}"
    files = {p.stem: p.stat().st_size for p in newest.iterdir()}
    with safe_open(str(newest / "optimizer.safetensors"), "np") as f:  # one exp_avg per parameter, ties once
        psi = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k.endswith("/exp_avg"))

    times_file = root / f"{name}-loads.json"
    launch(name, [__file__, "--worker", json.dumps(spec_dict(name, str(root / "unused"), max_steps=saves)),
                  str(newest), str(loads), str(times_file)])
    load_times = json.loads(times_file.read_text())
    return {"psi": psi, "save": statistics.median(save_times), "step": statistics.median(step_times),
            "load": statistics.median(load_times), "bytes": sum(files.values()),
            "model": files["model"], "optimizer": files["optimizer"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated subset of: "
                        + ", ".join(BACKENDS))
    parser.add_argument("--saves", type=int, default=5, help="checkpoints saved (one per step) per backend")
    parser.add_argument("--loads", type=int, default=3, help="restores timed per backend")
    args = parser.parse_args()
    rows: dict[str, dict[str, float] | str] = {}
    with tempfile.TemporaryDirectory(prefix="polytrain-ckpt-io-") as tmp:
        for name in args.backends.split(","):
            try:
                rows[name] = measure(name, args.saves, args.loads, Path(tmp))
            except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError) as exc:
                rows[name] = f"failed: {' '.join(str(exc).split())[:160]}"
    psi = next((r["psi"] for r in rows.values() if isinstance(r, dict)), 0)
    print(f"transformer LM {LM}, vocab {TOKENS['vocab']}, {TOKENS['seq_len']} tokens, Adam, fp32; "
          f"Ψ = {psi / 1e6:.2f} M parameters, 4Ψ = {4 * psi / 2**20:.1f} MiB; median of {args.saves} saves, "
          f"{args.loads} loads")
    print(f"{'backend':9} {'ranks':>5} {'save s':>7} {'load s':>7} {'step s':>7} {'save/step':>9} {'MiB':>6} "
          f"{'size/4Ψ':>8} {'model/4Ψ':>9} {'optim/4Ψ':>9}")
    for name, row in rows.items():
        ranks = BACKENDS[name][0]
        if isinstance(row, str):
            print(f"{name:9} {ranks:5} {row}")
            continue
        base = 4 * row["psi"]
        print(f"{name:9} {ranks:5} {row['save']:7.3f} {row['load']:7.3f} {row['step']:7.3f} "
              f"{row['save'] / row['step']:9.2f} {row['bytes'] / 2**20:6.1f} {row['bytes'] / base:8.3f} "
              f"{row['model'] / base:9.3f} {row['optimizer'] / base:9.3f}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        from polytrain.cli import exit_after_training

        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        exit_after_training()  # not the interpreter's teardown, where gloo's threads may abort the rank
    else:
        main()
