"""Run torch's own context parallel (ring attention over a ``cp`` DeviceMesh) on this machine's CPU with gloo, the
way a model would use it (its input sharded along the sequence, SDPA inside), and report what happened.

Each rank writes ``OUT.RANK.json``: {"ran": bool, "error": type and torch's message, "op": the aten op named}."""

from __future__ import annotations

import json
import re
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    batch, seq, heads, dim = 2, 8 * dist.get_world_size(), 2, 4
    x = torch.randn(batch, seq, heads * dim)
    qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)
    record: dict[str, object] = {"ran": False}
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            local = x.shape[1]
            q, k, v = qkv(x).view(batch, local, 3, heads, dim).permute(2, 0, 3, 1, 4)
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        record["ran"] = True
    except Exception as exc:  # noqa: BLE001 - what torch raised is the finding
        message = " ".join(str(exc).split())
        found = re.search(r"aten\.[\w.]+", message)
        record.update(error=f"{type(exc).__name__}: {message}", op=found.group(0) if found else None)
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
