"""One rank of one GPU-check job, in a process of its own: ``python -m bench.gpu.worker JOB.json RANK``.

``train`` jobs run the backend's training runs one after the other through polytrain's `Trainer`
(a callback reads where the weights and the optimizer state live; a user loss makes one chosen
update's loss infinite); ``memory`` jobs build the backend's model and take a census of model state
after the second backward (like ``bench/sharded_memory.py``) and the CUDA allocator's peak; ``speed``
jobs time one runner of `bench.gpu.speed`. Each
rank writes ``rank<N>.json`` after every run, so a crash or a time-out keeps what finished.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from polytrain.train.callbacks import Callback, RunInfo
from polytrain.world import World


class InjectInf:
    """A per-sample loss: the built-in one, made infinite in training call ``at`` on the chosen rank."""

    __name__ = "inject_inf"

    def __init__(self, base: Any, at: int, active: bool) -> None:
        self.base, self.at, self.active, self.calls = base, at, active, 0

    def __call__(self, out: Any, y: Any) -> Any:
        value = self.base(out, y)
        if out.requires_grad:  # a training micro-step (evaluation runs without gradients)
            self.calls += 1
            if self.active and self.calls == self.at:
                value = value * float("inf")
        return value


def _local(t: Any) -> Any:
    """The tensor that holds a parameter's bytes here: a DTensor's shard, DeepSpeed's partition, or itself."""
    return getattr(t, "ds_tensor", None) if hasattr(t, "ds_tensor") else getattr(t, "_local_tensor", t)


def placement(framework: Any) -> dict[str, list[str]]:
    """Devices and dtypes of the model's parameters and of the optimizer's state tensors."""
    import torch

    params = [_local(p) for p in framework.model.parameters()]
    optimizer = framework.optimizer
    while getattr(optimizer, "optimizer", optimizer) is not optimizer:  # DeepSpeed's and Horovod's wrappers
        optimizer = optimizer.optimizer
    state = [_local(v) for slots in getattr(optimizer, "state", {}).values() for v in slots.values()
             if torch.is_tensor(v) and v.ndim > 0]
    return {"param_devices": sorted({p.device.type for p in params if p is not None}),
            "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params if p is not None}),
            "state_devices": sorted({t.device.type for t in state})}


class Probe(Callback):
    """Reads the Trainer's framework adapter when training starts and ends."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.start: dict[str, list[str]] = {}
        self.end: dict[str, list[str]] = {}

    def on_train_start(self, run: RunInfo) -> None:
        self.start = placement(self.trainer.framework)

    def on_train_end(self, run: RunInfo, result: Any) -> None:
        self.end = placement(self.trainer.framework)


class Tee(io.TextIOBase):
    """Writes through to a stream and keeps a copy (the run's stderr: polytrain's overflow lines)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_run(run: dict[str, Any], world: World, device: str) -> dict[str, Any]:
    import torch

    from polytrain import registry, validation
    from polytrain.adapters.torch.objectives import LOSSES
    from polytrain.protocols import UserCode
    from polytrain.train.trainer import Trainer

    raw, user = dict(run["raw"]), None
    if run.get("inject_at"):
        base = LOSSES["next_token" if raw["model"]["name"] == "transformer" else "cross_entropy"]
        user = UserCode(loss=InjectInf(base, run["inject_at"], active=world.rank == world.size - 1))
        raw["loss"] = "fit:inject_inf"
    spec = validation.from_dict(raw)
    probe = Probe()
    trainer = Trainer(spec, world, show_progress=False, callbacks=[probe],
                      framework_factory=lambda s, w, b: registry.create_framework(s, w, b, user=user))
    probe.trainer = trainer
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tee, started = Tee(sys.stderr), time.perf_counter()
    with contextlib.redirect_stderr(tee):
        result = trainer.fit()
    records = _records(Path(spec.output) / "metrics.jsonl")
    return {"val_accuracy": result.val_accuracy, "seconds": time.perf_counter() - started,
            "start": probe.start, "end": probe.end, "backend_label": trainer.backend.label,
            "steps": [r for r in records if r.get("event") == "step"],
            "nonfinite": [r for r in records if r.get("event") == "nonfinite"],
            "overflow_lines": [line for line in tee.kept.getvalue().splitlines()
                               if "fp16 gradient overflow" in line],
            "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}


def memory_run(raw: dict[str, Any], world: World, device: str) -> dict[str, Any]:
    import numpy as np
    import torch

    from bench.sharded_memory import census, classify
    from polytrain import registry, validation
    from polytrain.data.source import DatasetInfo

    spec = validation.from_dict(raw)
    tokens = spec.data.tokens
    backend = registry.create_backend(spec, world)
    backend.setup()
    try:
        fw = registry.create_framework(spec, world, backend)
        cuda = device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        before = census()
        fw.build(DatasetInfo(input_shape=(tokens.seq_len,), num_outputs=tokens.vocab, task="next_token"))
        module = backend.unwrap(fw.model)
        psi = sum(getattr(p, "ds_numel", None) or p.numel() for p in module.parameters())
        rng = np.random.default_rng(world.rank)
        batch = spec.data.batch_size
        x, y = (rng.integers(0, tokens.vocab, (batch, tokens.seq_len)) for _ in range(2))
        sizes: dict[str, Any] = {}
        for step in range(2):
            fw.train_micro_step(x, y, 1.0 / batch, sync=True)
            if step == 1:
                sizes = classify(fw, backend, before)
                if cuda:
                    torch.cuda.synchronize()
                    sizes["allocated"] = torch.cuda.memory_allocated() - base
            fw.optimizer_step(1e-3, None)
        if cuda:
            torch.cuda.synchronize()
            sizes["peak"] = torch.cuda.max_memory_allocated() - base
        sizes["psi"] = psi
        sizes["param_devices"] = placement(fw)["param_devices"]
        return sizes
    finally:
        backend.teardown()


def _error(exc: BaseException) -> dict[str, Any]:
    text = " ".join(str(exc).split())
    return {"error": f"{type(exc).__name__}: {text[:300]}", "traceback": traceback.format_exc()[-3000:]}


def _start_group(job: dict[str, Any], world: World) -> bool:
    """The process group the check starts itself (``job['process_group']``), before polytrain's setup."""
    kind = job.get("process_group")
    if not kind:
        return False
    import datetime

    import torch.distributed as dist

    dist.init_process_group(kind, init_method=f"tcp://127.0.0.1:{job['group_port']}", rank=world.rank,
                            world_size=world.size, timeout=datetime.timedelta(seconds=120))
    return True


def main(job_path: str, rank: int) -> None:
    job = json.loads(Path(job_path).read_text())
    out = Path(job["out_dir"]) / f"rank{rank}.json"
    nproc = int(job["nproc"])
    if job["device"] == "cuda":
        import torch

        torch.cuda.set_device(0)  # every rank on the one device
    results: list[dict[str, Any]] = []
    out.write_text(json.dumps(results))
    started = False
    try:
        started = _start_group(job, World(rank=rank, size=nproc))
        for i, item in enumerate(job["runs"]):
            world = World(rank=rank, size=nproc, local_rank=0, local_size=1, node_rank=rank, num_nodes=nproc,
                          master_addr="127.0.0.1", master_port=int(job["ports"][i]), launcher="gpu-check")
            try:
                if job["kind"] == "train":
                    record = train_run(item, world, job["device"])
                elif job["kind"] == "memory":
                    record = memory_run(item["raw"], world, job["device"])
                elif job["kind"] == "ownloop":
                    from bench.gpu.own_loop import loop_run

                    record = loop_run(item["backend"], item["precision"], world, item.get("spec"))
                else:
                    from bench.gpu.speed import measure

                    record = measure(item["runner"], item["config"])
            except Exception as exc:  # noqa: BLE001 - the table says which run failed and why
                record = _error(exc)
            results.append({"name": item["name"], **record})
            out.write_text(json.dumps(results, default=str))
            if "error" in record and job.get("stop_on_error"):
                break  # the other rank is likely stuck or failed alike: the later runs would only wait
    except Exception as exc:  # noqa: BLE001 - a process group that would not start
        results.append({"name": "process group", **_error(exc)})
        out.write_text(json.dumps(results, default=str))
    finally:
        if started:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


if __name__ == "__main__":
    from polytrain.cli import exit_after_training

    main(sys.argv[1], int(sys.argv[2]))
    exit_after_training()  # not the interpreter's teardown, where gloo's threads may abort the rank
