"""Step time of each sharded backend relative to DDP: same model, batch, optimizer, 2 ranks.

Run:  python bench/sharded_step_time.py [--steps N]    (starts 2 ranks per backend under torchrun)

The zoo's transformer LM (d_model 256, 4 blocks, vocab 1024, 64 tokens, ~3.4 M
parameters), Adam, fp32, 8 sequences per rank per step, through polytrain's own
framework adapter and backends (forward, backward, the backend's gradient reduction,
optimizer step). After 3 warm-up steps each rank times every step; the median over the
steps of the slower rank is reported, and its ratio to DDP's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lm_job import BATCH, LM, SEQ, VOCAB, open_lm_job  # bench/, first on sys.path

REPO = Path(__file__).resolve().parents[1]
NPROC, WARMUP = 2, 3
BACKENDS = {
    "ddp": {"backend": "ddp"},
    "fsdp full_shard": {"backend": "fsdp", "fsdp": {"sharding": "full_shard"}},
    "fsdp shard_grad_op": {"backend": "fsdp", "fsdp": {"sharding": "shard_grad_op"}},
    "zero1": {"backend": "deepspeed", "deepspeed": {"stage": 1}},
    "zero2": {"backend": "deepspeed", "deepspeed": {"stage": 2}},
    "zero3": {"backend": "deepspeed", "deepspeed": {"stage": 3}},
}


def worker(name: str, steps: int, out_file: str) -> None:
    job = open_lm_job(BACKENDS[name], prefix="polytrain-steptime-")
    world, backend = job.world, job.backend
    times = [job.step() for _ in range(WARMUP + steps)][WARMUP:]
    gathered = backend.all_gather_object(statistics.median(times))
    if world.rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    backend.teardown()


def launch(name: str, steps: int, out_file: Path) -> float:
    from polytrain.comm.net import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "torchrun"), f"--nproc_per_node={NPROC}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", __file__, "--worker", name, str(steps), str(out_file)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=900)
    return max(json.loads(out_file.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        medians = {name: launch(name, args.steps, Path(tmp) / "times.json") for name in BACKENDS}
    print(f"transformer LM {LM}, vocab {VOCAB}, {SEQ} tokens, {BATCH} sequences/rank, Adam, fp32, {NPROC} ranks, "
          f"median of {args.steps} steps")
    print(f"{'backend':20} {'step ms':>8} {'vs DDP':>7}")
    for name, seconds in medians.items():
        print(f"{name:20} {seconds * 1e3:8.1f} {seconds / medians['ddp']:7.2f}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        from polytrain.cli import exit_after_training

        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        exit_after_training()  # not the interpreter's teardown, where gloo's threads may abort the rank
    else:
        main()
