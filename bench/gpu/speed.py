"""The speed section's runners: the same transformer, data, batch, optimizer and bf16 autocast under
polytrain's Trainer, a hand-written loop, Lightning's Trainer and Accelerate.

Each runner marks the time every ``window`` steps (after ``torch.cuda.synchronize()``; polytrain's
Trainer measures its own logging windows, samples/s in ``metrics.jsonl``); the first windows
(``warmup_steps``) are dropped and the median of the others is the step time. Lightning and
Accelerate are imported here only, and a runner whose library is missing returns ``skip``.
"""

from __future__ import annotations

import importlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.arith import median_step, window_step_times
from bench.gpu.cases import SpeedConfig

RUNNERS = ("hand", "polytrain", "lightning", "accelerate", "hand-compile", "polytrain-compile")
LABELS = {"hand": "hand-written loop", "polytrain": "polytrain Trainer", "lightning": "Lightning Trainer",
          "accelerate": "Accelerate", "hand-compile": "hand-written loop, compiled",
          "polytrain-compile": "polytrain Trainer, compile.enabled"}
#: torch.compile's runners: on CUDA only (on the CPU, inductor's C++ build would take minutes of the dry run)
COMPILED = ("hand-compile", "polytrain-compile")


def _data(cfg: SpeedConfig) -> Any:
    from polytrain import validation
    from polytrain.data import load_dataset

    spec = validation.from_dict(cfg.spec(tempfile.gettempdir()))
    return load_dataset(spec.data, seed=spec.seed)


def _model(cfg: SpeedConfig, device: Any) -> Any:
    import torch

    from polytrain.adapters.torch.transformer import build_transformer
    from polytrain.data.source import DatasetInfo
    from polytrain.spec.zoo import TransformerParams

    torch.manual_seed(0)
    params = TransformerParams(d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers)
    info = DatasetInfo(input_shape=(cfg.seq_len,), num_outputs=cfg.vocab, task="next_token")
    return build_transformer(params, info).to(device)


def _optimizer(model: Any, cfg: SpeedConfig) -> Any:
    import torch

    # what polytrain's `optimizer: {name: adamw, lr}` makes: torch's AdamW, defaults, no weight decay
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def _loss(out: Any, y: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _mark(marks: list[float], device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    marks.append(time.perf_counter())


def _result(marks: list[float], cfg: SpeedConfig, **extra: Any) -> dict[str, Any]:
    times = window_step_times(marks, cfg.window, cfg.warmup_steps // cfg.window)
    step = median_step(times)
    return {"step_s": step, "samples_per_s": cfg.batch / step, "windows": times, **extra}


def hand(cfg: SpeedConfig, compiled: bool = False) -> dict[str, Any]:
    import torch

    device = _device()
    data = _data(cfg)
    model = _model(cfg, device)
    if compiled:
        model.compile()  # in place, as polytrain's compile.enabled does it (the warm-up steps absorb compilation)
    optimizer = _optimizer(model, cfg)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    marks: list[float] = []
    _mark(marks, device)
    model.train()
    for step in range(cfg.total_steps):
        idx = order[step * cfg.batch:(step + 1) * cfg.batch]
        xb, yb = x[idx].to(device), y[idx].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            out = model(xb)
        _loss(out, yb).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % cfg.window == 0:
            _mark(marks, device)
    return _result(marks, cfg, params=sum(p.numel() for p in model.parameters()))


def polytrain_trainer(cfg: SpeedConfig, compiled: bool = False) -> dict[str, Any]:
    from polytrain import validation
    from polytrain.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="polytrain-gpu-speed-") as out:
        Trainer(validation.from_dict(cfg.spec(out, compiled=compiled)), show_progress=False).fit()
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if r.get("event") == "step" and r["step"] % cfg.window == 0]
    times = [cfg.batch / r["samples_per_s"] for r in windows][cfg.warmup_steps // cfg.window:]
    step = median_step(times)
    return {"step_s": step, "samples_per_s": cfg.batch / step, "windows": times}


def _loader(cfg: SpeedConfig) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = _data(cfg)
    dataset = TensorDataset(torch.from_numpy(data.x_train), torch.from_numpy(data.y_train))
    return DataLoader(dataset, batch_size=cfg.batch, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(0))


def lightning(cfg: SpeedConfig) -> dict[str, Any]:
    try:
        import lightning as L
    except ImportError:
        try:
            import pytorch_lightning as L
        except ImportError:
            return {"skip": "lightning (or pytorch_lightning) is not installed"}
    device = _device()
    marks: list[float] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model(cfg, "cpu")

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return _loss(self.model(x), y)

        def configure_optimizers(self) -> Any:
            return _optimizer(self.model, cfg)

    class Marks(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            _mark(marks, device)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if (batch_idx + 1) % cfg.window == 0:
                _mark(marks, device)

    accelerator = "gpu" if device.type == "cuda" else "cpu"
    # one process, no cluster: named, so that Lightning does not probe for MPI (its MPIEnvironment.detect()
    # calls MPI_Init through mpi4py, which aborts the process where no MPI launcher started it)
    environments = importlib.import_module(f"{L.__name__.split('.')[0]}.pytorch.plugins.environments"
                                           if L.__name__.startswith("lightning") else
                                           "pytorch_lightning.plugins.environments")
    trainer = L.Trainer(accelerator=accelerator, devices=1, precision="bf16-mixed", max_steps=cfg.total_steps,
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[Marks()], plugins=[environments.LightningEnvironment()])
    trainer.fit(Module(), _loader(cfg))
    return _result(marks, cfg, version=getattr(L, "__version__", "?"))


def accelerate(cfg: SpeedConfig) -> dict[str, Any]:
    try:
        from accelerate import Accelerator
        from accelerate import __version__ as version
    except ImportError:
        return {"skip": "accelerate is not installed"}
    device = _device()
    accelerator = Accelerator(mixed_precision="bf16", cpu=device.type == "cpu")
    model = _model(cfg, "cpu")
    model, optimizer, loader = accelerator.prepare(model, _optimizer(model, cfg), _loader(cfg))
    marks: list[float] = []
    _mark(marks, device)
    model.train()
    for step, (xb, yb) in enumerate(loader):
        if step == cfg.total_steps:
            break
        accelerator.backward(_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % cfg.window == 0:
            _mark(marks, device)
    return _result(marks, cfg, version=version)


MEASURE = {"hand": hand, "polytrain": polytrain_trainer, "lightning": lightning, "accelerate": accelerate,
           "hand-compile": lambda cfg: hand(cfg, compiled=True),
           "polytrain-compile": lambda cfg: polytrain_trainer(cfg, compiled=True)}


def measure(runner: str, config: dict[str, Any]) -> dict[str, Any]:
    """One runner's step time on ``config`` (a `SpeedConfig` as a dict)."""
    return MEASURE[runner](SpeedConfig(**config))
