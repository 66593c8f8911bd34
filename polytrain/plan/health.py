"""``polytrain doctor``'s part on every rank (`polytrain.commands.doctor` starts this file with ``polytrain launch``).

Each rank joins the job through `polytrain.torch.Distributed` (``ddp``: gloo on CPU, NCCL on GPUs), then, the
ranks in step between measurements:

- its device's matrix-multiply rate, sustained over a fixed wall time (a rank whose CPU share is cut shows it,
  where the best of a few short repeats could fall inside its quota);
- host↔device copies where there is a device (`probe.host_speed`, what ``plan --probe`` measures);
- each link of the ring, one at a time (the others wait): ping-pongs of one float (latency: half the best round
  trip) and of a buffer (bandwidth: both ways over the best round trip);
- one all-reduce over the whole job (`probe.all_reduce_speed`, ``plan --probe``'s own measurement);
- what the ranks must agree on: library versions, the ``NCCL_*``/``GLOO_*`` variables, the clock (each rank's
  against rank 0's, from the exchange with the shortest round trip: `clock_offsets`), free disk under the paths
  named (``--path``).

The records are gathered to rank 0 as JSON in byte tensors (nothing is unpickled), which prints
``POLYTRAIN_DOCTOR [records]`` on its standard output for the launcher to relay.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from polytrain.plan.probe import all_reduce_speed, host_speed

MARK = "POLYTRAIN_DOCTOR"
GEMM_SECONDS = 0.6  # sustained: a cgroup quota (cpu.max's period is 100 ms) shows in the rate
LATENCY_REPEATS, BANDWIDTH_REPEATS, CLOCK_REPEATS = 20, 3, 5


def gemm_rate(device: Any, seconds: float = GEMM_SECONDS) -> float:
    """Matrix-multiply FLOP/s, sustained over ``seconds``; on the CPU with one thread (ranks on one host compare
    alike, and no OpenMP worker spins on after the last multiply, eating a starved rank's CPU time)."""
    import torch

    if device.type == "cuda":
        return _sustained_mm(device, 2048, seconds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _sustained_mm(device, 256, seconds)
    finally:
        torch.set_num_threads(threads)


def _sustained_mm(device: Any, n: int, seconds: float) -> float:
    import torch

    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b, out=out)  # warm-up
    sync()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(a, b, out=out)
        count += 1
        if device.type == "cuda" and count % 8 == 0:
            sync()
    sync()
    return 2 * n**3 * count / (time.perf_counter() - started)


def ring_links(size: int) -> list[tuple[int, int]]:
    """The links measured: each rank with the next, once per pair."""
    if size < 2:
        return []
    return [(0, 1)] if size == 2 else [(r, (r + 1) % size) for r in range(size)]


def ping_pong(peer: int, first: bool, payload: Any, repeats: int) -> float:
    """The best round trip of ``payload`` to ``peer`` and back; ``first``: this rank sends first."""
    import torch.distributed as dist

    def once() -> None:
        if first:
            dist.send(payload, peer)
            dist.recv(payload, peer)
        else:
            dist.recv(payload, peer)
            dist.send(payload, peer)

    once()  # warm-up: the pair's connection
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - started)
    return best


def measure_links(rank: int, size: int, device: Any, nbytes: int) -> dict[int, dict[str, float]]:
    """This rank's measured links (as the first of each pair): peer → bandwidth (GB/s) and latency (µs)."""
    import torch
    import torch.distributed as dist

    mine: dict[int, dict[str, float]] = {}
    small, big = torch.zeros(1, device=device), torch.zeros(nbytes // 4, device=device)
    for a, b in ring_links(size):
        dist.barrier()
        if rank not in (a, b):
            continue
        peer, first = (b, True) if rank == a else (a, False)
        latency = ping_pong(peer, first, small, LATENCY_REPEATS) / 2
        round_trip = ping_pong(peer, first, big, BANDWIDTH_REPEATS)
        if first:
            mine[b] = {"gbs": 2 * nbytes / round_trip / 1e9, "latency_us": latency * 1e6}
    dist.barrier()
    return mine


def clock_offsets(rank: int, size: int, repeats: int = CLOCK_REPEATS) -> dict[str, dict[str, float]]:
    """On rank 0, every other rank's clock against its own: each pair exchanges its times ``repeats`` times and
    the exchange with the shortest round trip gives the offset (the other's time minus the round trip's middle)
    and its uncertainty (half that round trip). A slow or starved rank answers late, which widens the
    uncertainty but does not move the estimate. Other ranks get {}."""
    import torch
    import torch.distributed as dist

    box, found = torch.zeros(1, dtype=torch.float64), {}
    for peer in range(1, size):
        if rank == 0:
            best: tuple[float, float] | None = None
            for _ in range(repeats):
                sent = time.time()
                box[0] = sent
                dist.send(box, peer)
                dist.recv(box, peer)
                back = time.time()
                sample = (back - sent, float(box[0]) - (sent + back) / 2)
                best = sample if best is None or sample < best else best
            assert best is not None
            found[str(peer)] = {"offset_s": best[1], "uncertainty_s": best[0] / 2}
        elif rank == peer:
            for _ in range(repeats):
                dist.recv(box, 0)
                box[0] = time.time()
                dist.send(box, 0)
    return found


def free_gb(path: str) -> float | None:
    """Free space on the file system that holds ``path`` (or its nearest existing parent)."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free / 1e9
    except OSError:
        return None


def versions() -> dict[str, str]:
    import numpy
    import torch

    from polytrain.version import __version__

    found = {"python": platform.python_version(), "polytrain": __version__, "torch": torch.__version__,
             "numpy": numpy.__version__}
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return found


def gather_json(record: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """Every rank's ``record`` on every rank: JSON bytes in tensors, never a pickle."""
    import torch
    import torch.distributed as dist

    data = torch.tensor(list(json.dumps(record).encode()), dtype=torch.uint8)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([data.numel()], dtype=torch.int64))
    longest = int(max(length.item() for length in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(parts, padded)
    return [json.loads(bytes(part[:int(n.item())].tolist())) for part, n in zip(parts, lengths)]


def measure(paths: list[str], gemm_seconds: float = GEMM_SECONDS) -> None:
    """One rank's part (see the module's docstring)."""
    import torch.distributed as dist

    from polytrain.torch import Distributed

    job = Distributed("ddp")
    world, device = job.world, job.device
    nbytes = (64 if device.type == "cuda" else 2) * 2**20
    record: dict[str, Any] = {"rank": world.rank, "host": socket.gethostname(), "device": str(device)}
    if world.size > 1:
        dist.barrier()  # every rank measures its device at the same time, under the same load
    record["gemm_gflops"] = gemm_rate(device, gemm_seconds) / 1e9
    copy = host_speed(device, nbytes)
    record["host_copy_gbs"] = copy
    if world.size > 1:
        record["links"] = {str(peer): value for peer, value in measure_links(world.rank, world.size, device,
                                                                               nbytes).items()}
        record["allreduce_gbs"] = all_reduce_speed(None, world.size, nbytes, device)
        record["clock_offsets"] = clock_offsets(world.rank, world.size)
    record["versions"] = versions()
    record["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "GLOO_"))}
    record["free_gb"] = {path: free_gb(path) for path in paths}
    records = gather_json(record, world.size) if world.size > 1 else [record]
    if world.rank == 0:
        print(f"{MARK} {json.dumps(records)}", flush=True)
    job.end()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="polytrain doctor's measurements on one rank")
    parser.add_argument("--path", action="append", default=[], help="a folder whose free space to report")
    parser.add_argument("--gemm-seconds", type=float, default=GEMM_SECONDS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    measure(args.path, args.gemm_seconds)


if __name__ == "__main__":
    main()
