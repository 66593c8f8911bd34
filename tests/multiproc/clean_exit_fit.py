"""A user's script as the issue reported it: ``polytrain.fit`` on the digits under a launcher, then inference.

Run by tests/multiproc/test_clean_exit.py. After ``fit`` returns it checks that nothing polytrain started
is still running in this process — no polytrain thread, no torch.distributed group, and none of the native
threads of a gloo process group or a TCPStore (which would otherwise run on into interpreter finalisation) —
then predicts on the CPU with the model ``fit`` handed back and with the script's own module, and prints
``RESULT`` with the numbers the test compares.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn

import polytrain
from polytrain.environments import detect_world
from polytrain.errors import OwnLoopError

#: thread names of a gloo process group (its work loop and its device's event loop) and of a TCPStore server
NATIVE = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def native_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(name for name in names if name.startswith(NATIVE))


def main(output: str, backend: str) -> None:
    bunch = load_digits()
    x, y = (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    spec = {"seed": 0, "backend": backend, "output": output, "data": {"global_batch_size": 64, "val_fraction": 0.2},
            "optimizer": {"name": "adam", "lr": 0.01}, "loop": {"epochs": 1, "max_steps": 3}}
    result = polytrain.fit(spec, model=model, train_data=(x, y), show_progress=False)
    left = [t.name for t in threading.enumerate() if t.name.startswith("polytrain")]
    assert not left, f"polytrain threads alive after fit: {left}"
    assert not dist.is_initialized(), "torch.distributed is still initialised after fit"
    assert not native_threads(), f"process group or store threads alive after fit: {native_threads()}"
    trained = result.model
    assert isinstance(trained, nn.Module) and all(p.device.type == "cpu" for p in trained.parameters())
    with torch.no_grad():
        predicted = trained(torch.from_numpy(x)).argmax(dim=1).numpy()
        try:  # ddp trained the script's module in place; fsdp sharded it, and hands back a new one
            agree = str(bool((model(torch.from_numpy(x)).argmax(dim=1).numpy() == predicted).all()))
        except OwnLoopError as exc:
            agree = "refused" if "sharded across the ranks by fsdp" in str(exc) else str(exc)
    digest = float(sum(p.detach().double().sum() for p in trained.parameters()))
    say(f"RESULT rank {detect_world().rank} steps {result.global_step} same {trained is model} "
        f"agree {agree} accuracy {(predicted == y).mean():.6f} weights {digest:.9e}")


def say(line: str) -> None:
    """One write per line: the ranks share the launcher's pipe (print's two writes interleave)."""
    sys.stdout.flush()
    os.write(1, f"{line}\n".encode())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ddp")
