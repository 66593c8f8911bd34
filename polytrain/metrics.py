"""What rank 0 shows and writes: a progress display per epoch and ``metrics.jsonl``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (rank 0 only; others get a no-op)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: TextIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Progress:
    """A tqdm bar on a terminal; plain periodic lines otherwise (CI, Slurm logs)."""

    def __init__(self, enabled: bool, stream: TextIO = sys.stderr) -> None:
        self.enabled = enabled
        self.stream = stream
        self.bar: Any = None
        self.tty = enabled and stream.isatty()

    def start_epoch(self, epoch: int, epochs: int, total: int) -> None:
        if not self.enabled:
            return
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", file=self.stream, leave=True,
                            dynamic_ncols=True)
        self.epoch_label = f"epoch {epoch + 1}/{epochs}"
        self.total = total

    def update(self, done: int, loss: float | None, samples_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = done
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.0f}", refresh=False)
            self.bar.refresh()
        elif loss is not None:
            self.line(f"{self.epoch_label} step {done}/{self.total} loss {loss:.4f} {samples_per_s:.0f} samples/s")

    def end_epoch(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)
