"""fp16 with dynamic loss scaling on local, DDP and FSDP; DeepSpeed fp16 where it cannot run.

A gradient overflow is forced in update 20, on rank 1 only: every rank must skip that
update (FSDP's shards agree through ShardedGradScaler's all-reduce of "found inf", DDP's
through its gradient all-reduce), rank 0 must log it, and training must still reach
0.9 validation accuracy on digits. (The first update may overflow on its own too: the
scale starts at 2^16.) This module doubles as the model factory the runs import.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from procs import BIN, check, free_port, loopback_env, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
OVERFLOW_AT = 20
DIGITS = ["data.name=digits", "optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9", "loop.epochs=3",
          "loop.log_every_n_steps=10", "precision=fp16", "model.name=test_precision:overflow_model",
          f"model.params.overflow_at={OVERFLOW_AT}", "model.params.overflow_rank=1"]


def overflow_model(info, overflow_at: int, overflow_rank: int, factor: float = 1e5):  # noqa: ANN001, ANN201
    """A model factory: an MLP whose ``overflow_at``-th training forward on rank ``overflow_rank`` is
    multiplied by ``factor`` (1e5: beyond fp16's 65504; inf: non-finite in any precision)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    class Overflowing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(info.input_shape[0], 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                      nn.Linear(32, info.num_outputs))
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.body(x)
            if self.training:
                self.calls += 1
                rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
                if self.calls == overflow_at and rank == overflow_rank % size:
                    out = out * factor
            return out

    return Overflowing()


def train(out: Path, backend: str, nproc: int, extra: tuple[str, ...] = ()) -> tuple[dict, str]:
    sets = [*DIGITS, f"backend={backend}", f"data.batch_size={32 // nproc}", f"output={out}", *extra]
    args = ["train", "--quiet", *[a for s in sets for a in ("--set", s)]]
    if nproc == 1:
        cmd = [sys.executable, "-m", "polytrain.cli", *args]
    else:
        cmd = [str(BIN / "torchrun"), f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", "-m", "polytrain.cli", *args]
    result = check(run(cmd, env=loopback_env(PYTHONPATH=f"{HERE}:{HERE.parent}")))
    return json.loads((out / "model.json").read_text()), result.stderr


@pytest.mark.parametrize(("backend", "nproc"), [("local", 1), ("ddp", 2), ("fsdp", 2)])
def test_fp16_overflow_is_skipped_everywhere_and_logged(backend: str, nproc: int, tmp_path: Path) -> None:
    manifest, stderr = train(tmp_path, backend, nproc)
    logged = [line for line in stderr.splitlines() if "fp16 gradient overflow" in line]
    assert sum(f"in update {OVERFLOW_AT} of this run: skipped" in line for line in logged) == 1, logged
    assert len(set(manifest["rank_state_digests"])) == 1
    assert manifest["spec"]["precision"] == "fp16" and manifest["backend"] == backend
    assert manifest["val_accuracy"] >= 0.9, manifest["val_accuracy"]


def test_deepspeed_fp16_without_cpu_kernels_is_a_one_line_error(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    if torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_fp16_supported():
        pytest.skip("fp16 runs here")
    sets = ["data.name=digits", "precision=fp16", "backend=deepspeed", f"output={tmp_path}"]
    result = run([sys.executable, "-m", "polytrain.cli", "train", *[a for s in sets for a in ("--set", s)]],
                 env=loopback_env(), timeout=200)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("polytrain: error:")]
    assert errors == ["polytrain: error: precision: fp16 is not supported by DeepSpeed's cpu accelerator here "
                      "(no fp16 kernels on this CPU); use bf16 or fp32, or a GPU"]


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_fp32_nonfinite_gradients_stop_sharded_training(backend: str, tmp_path: Path) -> None:
    """In fp32 the Trainer checks gradients before each update; sharded backends check their shards."""
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    sets = [*DIGITS, "precision=fp32", "model.params.factor=.inf", f"backend={backend}", "data.batch_size=16",
            f"output={tmp_path}", "loop.epochs=1"]
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "polytrain.cli", "train", "--quiet", *[a for s in sets for a in ("--set", s)]]
    result = run(cmd, env=loopback_env(PYTHONPATH=f"{HERE}:{HERE.parent}"))
    assert result.returncode != 0
    assert f"step {OVERFLOW_AT}: the loss or a gradient is NaN/Inf; stopped" in result.stderr, result.stderr[-3000:]
