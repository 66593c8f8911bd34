"""polytrain's Horovod shim against real Horovod 0.28.1, DDP, raw gloo and raw MPI, 2 ranks under mpirun.

Run:  python bench/horovod_compat.py [--steps N] [--max-mib M]

It starts itself under ``mpirun -np 2`` once per implementation — real Horovod when it
imports (on MPI under mpirun, on gloo under ``horovodrun --gloo``); the shim as it runs
under mpirun (data and metadata records over MPI, see polytrain.horovod.torch.mpi),
the same without its metadata check, and the shim kept on gloo (``HOROVOD_CPU_OPERATIONS=gloo``,
what it does under torchrun) — and prints:

* step time of the same 6.3 M-parameter MLP (SGD, batch 64 per rank) with
  (a) ``horovod.torch.DistributedOptimizer``, (b) the shim's, (c) DDP; targets (b)/(a) <= 0.9
  and (b)/(c) <= 1.05;
* allreduce bus bandwidth (bytes / time x 2(n-1)/n) of real Horovod, the shim, raw
  ``torch.distributed.all_reduce`` on gloo (measured in the gloo launch, where no MPI runs
  beside it) and raw ``mpi4py`` ``Allreduce``, 4 KiB .. 256 MiB; target shim >= 0.97 x gloo
  from 1 MiB;
* 1,000 tensors of 4 KiB: one grouped (fused) allreduce against 1,000 single ones.

Each figure is the median over repetitions of the slower rank; within one launch the
compared variants (shim vs DDP, shim vs raw gloo/MPI) take turns, so that load from other
processes hits them alike. Figures on a busy 2-core host move a lot between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SIZES_KIB = [4, 64, 1024, 16 * 1024, 256 * 1024]


# ----------------------------------------------------------------------------- one rank

def make_model():
    """1024 -> 2048 -> 1024 -> 2048: 6.3 M parameters."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 2048))


def timed(fns: dict, repeats: int, barrier) -> dict[str, float]:
    """Median seconds of each of ``fns`` over ``repeats`` runs; the functions take turns, so that
    load from other processes on a shared host hits them alike. Every run starts on all ranks at once."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def training_step(hvd, ddp: bool = False):
    import torch

    model = make_model()
    x, y = torch.randn(64, 1024), torch.randn(64, 2048)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             named_parameters=model.named_parameters())

    def step():
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    for _ in range(3):
        step()
    return step


def bandwidths(allreduces: dict, barrier, max_kib: int) -> dict[str, dict[str, float]]:
    """GB/s of bus bandwidth per implementation and message size."""
    import torch

    out: dict[str, dict[str, float]] = {name: {} for name in allreduces}
    for kib in [s for s in SIZES_KIB if s <= max_kib]:
        tensor = torch.ones(kib * 256)
        for fn in allreduces.values():
            fn(tensor)
        fns = {name: (lambda f=fn, t=tensor: f(t)) for name, fn in allreduces.items()}
        for name, seconds in timed(fns, 20 if kib <= 1024 else 5, barrier).items():
            out[name][str(kib)] = kib * 1024 / seconds * 2 * (2 - 1) / 2 / 1e9
    return out


def small_tensors(hvd, barrier) -> dict[str, float]:
    import torch

    tensors = [torch.ones(1024) for _ in range(1000)]

    def one_by_one():
        for i, t in enumerate(tensors):
            hvd.allreduce(t, name=f"small.{i}", op=hvd.Sum)

    return {"grouped": timed({"g": lambda: hvd.grouped_allreduce(tensors, name="small", op=hvd.Sum)}, 5, barrier)["g"],
            # median of 3: the first round teaches the shim's prediction (and Horovod's response cache) the names
            "one_by_one": timed({"s": one_by_one}, 3, barrier)["s"]}


def worker(mode: str, steps: int, max_kib: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import polytrain.horovod.torch as hvd

    hvd.init()
    result: dict[str, object] = {"impl": hvd.IMPL, "mode": mode}
    steps_to_time = {"step": training_step(hvd)}
    allreduces = {"bandwidth": lambda t: hvd.allreduce(t, op=hvd.Sum),
                  "bandwidth_inplace": lambda t: hvd.allreduce_(t, op=hvd.Sum)}
    if mode in ("shim", "shim-gloo"):
        steps_to_time["ddp_step"] = training_step(hvd, ddp=True)
        allreduces["gloo_bandwidth"] = dist.all_reduce
    if mode == "shim" and hvd.mpi_enabled():
        from mpi4py import MPI

        comm = MPI.COMM_WORLD.Dup()
        allreduces["mpi_bandwidth"] = lambda t: comm.Allreduce(MPI.IN_PLACE, t.numpy(), op=MPI.SUM)
    result["mpi_enabled"] = hvd.mpi_enabled()
    result.update(timed(steps_to_time, steps, hvd.barrier))
    result.update(bandwidths(allreduces, hvd.barrier, max_kib))
    result["small"] = small_tensors(hvd, hvd.barrier)
    path = Path(out_dir) / f"{mode}.rank{hvd.rank()}.json"
    path.write_text(json.dumps(result))
    # free the DDP model while every rank's collectives are done: freed at exit, its reducer joined gloo's threads
    # with the GIL held while a gloo thread waited for the GIL (the bench hung there in 1 run of 3)
    hvd.barrier()
    steps_to_time.clear()
    import gc

    gc.collect()
    hvd.shutdown()


# ----------------------------------------------------------------------------- driver

def launch(mode: str, steps: int, max_kib: int, out_dir: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX", "MASTER_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo",
               POLYTRAIN_HOROVOD_IMPL="horovod" if mode.startswith("horovod") else "shim",
               POLYTRAIN_HOROVOD_METADATA_CHECK="0" if mode == "shim-nocheck" else "1")
    if mode == "shim-gloo":
        env["HOROVOD_CPU_OPERATIONS"] = "gloo"
    worker = [sys.executable, __file__, "--worker", mode, "--steps", str(steps), "--max-mib", str(max_kib // 1024),
              "--out", out_dir]
    if mode == "horovod-gloo":  # real Horovod on gloo over TCP, like the shim: horovodrun's gloo mode
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", "--network-interface", "lo",
               *worker]
    else:
        cmd = [str(BIN / "mpirun"), "--oversubscribe", "--map-by", "slot", "-np", "2", *worker]
    subprocess.run(cmd, env=env, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    return [json.loads((Path(out_dir) / f"{mode}.rank{r}.json").read_text()) for r in range(2)]


def slower(ranks: list[dict], *keys: str) -> float:
    def get(d: dict) -> float:
        for key in keys:
            d = d[key]
        return float(d)
    return max(get(r) for r in ranks)


def report(runs: dict[str, list[dict]]) -> None:
    shim, on_gloo, real = runs["shim"], runs["shim-gloo"], runs.get("horovod")
    over = "MPI" if shim[0]["mpi_enabled"] else "gloo"
    b, c = slower(shim, "step"), slower(shim, "ddp_step")
    b_gloo, c_gloo = slower(on_gloo, "step"), slower(on_gloo, "ddp_step")
    print("step time, 6.3 M-parameter MLP, batch 64 per rank (ms, slower rank)")
    if real:
        a = slower(real, "step")
        print(f"  (a) Horovod on MPI {a * 1e3:8.1f}   (b) shim on {over} {b * 1e3:8.1f}   (c) DDP {c * 1e3:8.1f}")
        print(f"  (b)/(a) = {b / a:.3f} (target <= 0.9)   (b)/(c) = {b / c:.3f} (target <= 1.05)")
    else:
        print(f"  (b) shim on {over} {b * 1e3:8.1f}   (c) DDP {c * 1e3:8.1f}   (Horovod not installed)")
        print(f"  (b)/(c) = {b / c:.3f} (target <= 1.05)")
    if "horovod-gloo" in runs:
        a_gloo = slower(runs["horovod-gloo"], "step")
        print(f"  (a') Horovod on gloo (horovodrun --gloo) {a_gloo * 1e3:8.1f}")
    print(f"  shim kept on gloo (as under torchrun) {b_gloo * 1e3:8.1f}   DDP in that launch {c_gloo * 1e3:8.1f}   "
          f"ratio {b_gloo / c_gloo:.3f}" + (f"   vs (a') {b_gloo / a_gloo:.3f}" if "horovod-gloo" in runs else ""))
    if "shim-nocheck" in runs:
        print(f"  shim on {over} without metadata check {slower(runs['shim-nocheck'], 'step') * 1e3:8.1f}")
    print("allreduce bus bandwidth (GB/s, the slower rank's). hvd.allreduce copies its input; allreduce_ (shim_),")
    print("raw gloo (torch.distributed.all_reduce, measured in the shim-on-gloo launch) and raw MPI (mpi4py")
    print(f"Allreduce) work in place. shim = on {over}; shim-gloo = HOROVOD_CPU_OPERATIONS=gloo")
    print(f"  {'size':>8} {'Horovod':>8} {'shim':>8} {'shim_':>8} {'raw MPI':>8} {'shim-gloo_':>10} {'raw gloo':>8} "
          f"{'shim_/gloo':>10} {'shim_/MPI':>9} {'shim-gloo_/gloo':>15}")

    def bw(ranks, key, k):
        return min(float(r[key][k]) for r in ranks) if ranks and key in ranks[0] else float("nan")

    for kib in shim[0]["bandwidth"]:
        g, m = bw(on_gloo, "gloo_bandwidth", kib), bw(shim, "mpi_bandwidth", kib)
        mine, mine_gloo = bw(shim, "bandwidth_inplace", kib), bw(on_gloo, "bandwidth_inplace", kib)
        size = f"{kib} KiB" if int(kib) < 1024 else f"{int(kib) // 1024} MiB"
        print(f"  {size:>8} {bw(real, 'bandwidth', kib):8.3f} {bw(shim, 'bandwidth', kib):8.3f} {mine:8.3f} {m:8.3f} "
              f"{mine_gloo:10.3f} {g:8.3f} {mine / g:10.3f} {mine / m:9.3f} {mine_gloo / g:15.3f}")
    print("1,000 tensors of 4 KiB (ms): grouped vs one by one")
    for name, ranks in runs.items():
        grouped, single = slower(ranks, "small", "grouped"), slower(ranks, "small", "one_by_one")
        print(f"  {name:>13}: grouped {grouped * 1e3:9.1f}   one by one {single * 1e3:9.1f}   "
              f"x{single / grouped:.0f}")
    if "shim-nocheck" in runs:
        checked, unchecked = (slower(runs[m], "small", "one_by_one") for m in ("shim", "shim-nocheck"))
        print(f"  one by one, shim with its metadata check / without: {checked / unchecked:.3f} (target <= 1.5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.max_mib * 1024, args.out)
        return
    sys.path.insert(0, str(REPO))
    from polytrain.horovod.common import _import_error

    modes = ["shim", "shim-gloo", "shim-nocheck"] + (["horovod", "horovod-gloo"] if _import_error("horovod.torch") is None else [])
    with tempfile.TemporaryDirectory() as out_dir:
        runs = {mode: launch(mode, args.steps, args.max_mib * 1024, out_dir) for mode in modes}
    report(runs)


if __name__ == "__main__":
    main()
