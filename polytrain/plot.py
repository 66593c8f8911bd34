"""``polytrain plot RUN_DIR [RUN_DIR...] -o out.png``: loss, validation accuracy and throughput of runs.

Reads each run's ``metrics.jsonl`` (what rank 0 wrote), so runs of any framework and backend
overlay in one figure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polytrain.errors import UserError


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"plot: {run_dir} has no metrics.jsonl (give the output directory of a run)")
    steps, epochs = [], []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        (steps if event.get("event") == "step" else epochs if event.get("event") == "epoch" else []).append(event)
    return steps, epochs


def label(run_dir: Path) -> str:
    model = run_dir / "model.json"
    if model.is_file():
        manifest = json.loads(model.read_text())
        return f"{run_dir.name} ({manifest.get('framework')}/{manifest.get('backend')}, {manifest.get('world_size')}p)"
    return run_dir.name


def plot(run_dirs: list[Path], output: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_speed) = plt.subplots(1, 3, figsize=(15, 4.2))
    for run_dir in run_dirs:
        steps, epochs = read_run(run_dir)
        name = label(run_dir)
        ax_loss.plot([e["step"] for e in steps], [e["loss"] for e in steps], label=name)
        accurate = [e for e in epochs if e.get("val_accuracy") is not None]
        ax_acc.plot([e["epoch"] + 1 for e in accurate], [e["val_accuracy"] for e in accurate], marker="o", label=name)
        ax_speed.plot([e["step"] for e in steps], [e["samples_per_s"] for e in steps], label=name)
    for ax, title, xlabel in ((ax_loss, "training loss", "step"), (ax_acc, "validation accuracy", "epoch"),
                              (ax_speed, "throughput (samples/s, all ranks)", "step")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    ax_loss.set_yscale("log")
    ax_acc.legend(fontsize=8)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
