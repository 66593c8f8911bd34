"""torch.compile under DDP: step time compiled vs eager after warm-up, and the time compiling takes.

Run:  python bench/compile.py [--steps N] [--mode default|reduce-overhead|max-autotune]
      (starts 2 ranks under torchrun, twice: with an empty inductor cache, then with that cache filled)

The zoo's transformer LM (d_model 256, 8 heads, 4 blocks, vocab 1024, 64 tokens, ~3.4 M parameters),
Adam, fp32, 8 sequences per rank per step, through polytrain's framework adapter and the ddp backend with
``compile: {enabled: true}`` (the DDP module compiled in place: dynamo splits the graph at DDP's
gradient buckets). Compile time: the wall time of the first step (it compiles the forward and backward
graphs) less a compiled step after warm-up. Step times: after 3 warm-up steps, compiled steps and eager
steps alternate in the same processes (eager: ``torch.compiler.set_stance("force_eager")`` on the same
model, which is plain DDP), so a busy spell on a shared machine falls on both; each rank's median, then
the slower rank's, and the ratio.
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


def worker(mode: str, steps: int, out_file: str) -> None:
    import torch

    job = open_lm_job({"backend": "ddp", "compile": {"enabled": True, "mode": mode}}, prefix="polytrain-compile-")
    world, backend, step = job.world, job.backend, job.step

    first = step()  # compiles
    for _ in range(WARMUP):
        step()
        with torch.compiler.set_stance("force_eager"):
            step()
    compiled, eager = [], []
    for _ in range(steps):
        compiled.append(step())
        with torch.compiler.set_stance("force_eager"):
            eager.append(step())
    mine = {"first": first, "compiled": statistics.median(compiled), "eager": statistics.median(eager)}
    gathered = backend.all_gather_object(mine)
    if world.rank == 0:
        Path(out_file).write_text(json.dumps(gathered))
    backend.teardown()


def launch(mode: str, steps: int, out_file: Path, cache: Path) -> dict[str, float]:
    from polytrain.comm.net import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    cmd = [str(Path(sys.executable).parent / "torchrun"), f"--nproc_per_node={NPROC}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", __file__, "--worker", mode, str(steps), str(out_file)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=1800)
    ranks = json.loads(out_file.read_text())
    return {key: max(r[key] for r in ranks) for key in ("first", "compiled", "eager")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mode", default="default", choices=("default", "reduce-overhead", "max-autotune"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "inductor"
        runs = {label: launch(args.mode, args.steps, Path(tmp) / "times.json", cache)
                for label in ("empty inductor cache", "filled inductor cache")}
    print(f"transformer LM {LM}, vocab {VOCAB}, {SEQ} tokens, {BATCH} sequences/rank, Adam, fp32, ddp, {NPROC} ranks "
          f"(gloo, CPU), compile mode {args.mode}, median of {args.steps} steps of each after {WARMUP} warm-up")
    print(f"{'run':22} {'compile s':>9} {'eager ms':>9} {'compiled ms':>11} {'compiled/eager':>14}")
    for label, r in runs.items():
        print(f"{label:22} {r['first'] - r['compiled']:9.1f} {r['eager'] * 1e3:9.1f} {r['compiled'] * 1e3:11.1f} "
              f"{r['compiled'] / r['eager']:14.2f}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        from polytrain.cli import exit_after_training

        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        exit_after_training()  # not the interpreter's teardown, where gloo's threads may abort the rank
    else:
        main()
