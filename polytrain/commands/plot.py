"""``polytrain plot RUN_DIR [RUN_DIR...] -o out.png``: loss, validation accuracy and throughput of runs.

Reads each run's ``metrics.jsonl`` (what rank 0 wrote), so runs of any framework and backend
overlay in one figure.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polytrain.errors import UserError
from polytrain.observe.metrics import read_records


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    path = run_dir / "metrics.jsonl"
    if not run_dir.exists():
        raise UserError(f"plot: {run_dir} does not exist (give the output directory of a run)")
    if not path.is_file():
        raise UserError(f"plot: {run_dir} has no metrics.jsonl (give the output directory of a run)")
    steps, epochs = [], []
    for event in read_records(path)[0]:  # a line cut short by a crash is skipped
        if event.get("event") == "step" and all(k in event for k in ("step", "loss", "samples_per_s")):
            steps.append(event)
        elif event.get("event") == "epoch" and "epoch" in event:
            epochs.append(event)
    return steps, epochs


def label(run_dir: Path) -> str:
    model = run_dir / "model.json"
    try:
        manifest = json.loads(model.read_text()) if model.is_file() else None
    except (OSError, ValueError):
        manifest = None  # a damaged model.json only costs the label its details
    if isinstance(manifest, dict):
        return f"{run_dir.name} ({manifest.get('framework')}/{manifest.get('backend')}, {manifest.get('world_size')}p)"
    return run_dir.name


def plot(run_dirs: list[Path], output: Path) -> Path:
    runs = [(run_dir, *read_run(run_dir)) for run_dir in run_dirs]  # every run is checked before drawing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_speed) = plt.subplots(1, 3, figsize=(15, 4.2))
    formats = fig.canvas.get_supported_filetypes()
    if output.suffix and output.suffix.lstrip(".").lower() not in formats:
        plt.close(fig)
        raise UserError(f"-o {output}: unknown image format {output.suffix!r} (allowed: {', '.join(sorted(formats))})")
    for run_dir, steps, epochs in runs:
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
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(output, dpi=110)
    except OSError as exc:
        raise UserError(f"-o {output}: cannot write it ({exc.strerror or exc}); give a path in a writable "
                        f"directory") from exc
    finally:
        plt.close(fig)
    return output
