"""``polytrain plan --probe``: the link model measured on the machines the job will use.

`probe_link` starts this file with ``polytrain launch`` on the job's ranks (the launcher and hosts of the
planner's flags); each rank joins the job through `polytrain.torch.Distributed` (``ddp``: gloo on CPU, NCCL on
GPUs) and times all-reduces of one buffer within its node and, on several nodes, across them (the ranks with
its local rank), and copies between the device and host memory. A link's speed is what the planner's ring model
says a rank sends (``2(n-1)/n`` of the buffer per all-reduce) over the best of a few timed repeats; rank 0 prints
``POLYTRAIN_PROBE {"intra": GB/s, "inter": GB/s, "host": GB/s}`` (null where there is nothing to measure) on its
standard output, which the launcher relays from whichever host rank 0 runs on.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from polytrain.errors import SpecError

REPEATS = 5
MARK = "POLYTRAIN_PROBE"


def best_seconds(run: Any, sync: Any) -> float:
    run()  # warm-up: connections, allocations
    sync()
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def all_reduce_speed(group: Any, size: int, nbytes: int, device: Any) -> float:
    import torch
    import torch.distributed as dist

    buffer = torch.ones(nbytes // 4, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = best_seconds(lambda: dist.all_reduce(buffer, group=group), sync)
    return 2 * (size - 1) / size * nbytes / seconds / 1e9


def host_speed(device: Any, nbytes: int) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    on_device = torch.ones(nbytes // 4, device=device)
    on_host = torch.empty(nbytes // 4, pin_memory=True)
    seconds = best_seconds(lambda: on_host.copy_(on_device, non_blocking=True), torch.cuda.synchronize)
    return nbytes / seconds / 1e9


def measure() -> None:
    """One rank's part of the probe (see the module's docstring)."""
    import torch.distributed as dist

    from polytrain.torch import Distributed

    job = Distributed("ddp")
    world, device = job.world, job.device
    nbytes = (256 if device.type == "cuda" else 8) * 2**20
    per_node = world.local_size
    nodes = [list(range(n * per_node, (n + 1) * per_node)) for n in range(world.size // per_node)]
    across = [list(range(local, world.size, per_node)) for local in range(per_node)]
    speeds: dict[str, float | None] = {"intra": None, "inter": None}
    if world.size > 1:  # every rank makes every group, in the same order
        groups = {"intra": [dist.new_group(ranks) for ranks in nodes],
                  "inter": [dist.new_group(ranks) for ranks in across]}
    if per_node > 1:
        speeds["intra"] = all_reduce_speed(groups["intra"][world.rank // per_node], per_node, nbytes, device)
    if len(nodes) > 1:
        speeds["inter"] = all_reduce_speed(groups["inter"][world.rank % per_node], len(nodes), nbytes, device)
    speeds["host"] = host_speed(device, nbytes)
    if world.size > 1:
        job.barrier()
    if world.rank == 0:
        print(f"{MARK} {json.dumps(speeds)}", flush=True)
    job.end()


def probe_link(nproc: int, launcher: str, hosts: str | None, defaults: Any) -> Any:
    """Run the probe under ``polytrain launch --launcher LAUNCHER -np N [-H HOSTS]`` and return a `comms.Link`,
    the ``defaults`` where nothing was measured; a failed probe is a one-line error."""
    from dataclasses import replace

    cmd = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", launcher, "-np", str(nproc),
           *(["-H", hosts] if hosts else []), str(Path(__file__))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    reported = re.search(rf"{MARK} (\{{.*\}})", done.stdout)
    if done.returncode != 0 or reported is None:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SpecError(f"--probe: the probe job failed under {launcher} (exit {done.returncode}): {last}")
    found = json.loads(reported.group(1))
    measured = {key: value * 1e9 for key, value in found.items() if isinstance(value, (int, float)) and value > 0}
    return replace(defaults, **measured)


if __name__ == "__main__":
    measure()
