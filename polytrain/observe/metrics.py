"""What rank 0 shows and writes: a progress display per epoch and ``metrics.jsonl``."""

from __future__ import annotations

import csv as csv_module
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar

from polytrain.errors import TrainingFailure
from polytrain.observe import jsonfiles as jsonfiles
from polytrain.observe.tfevents import TensorBoardFile
from polytrain.observe.trackers import SCALAR_TAGS, Trackers, scalars

T = TypeVar("T")

CSV_COLUMNS = ("event", "time", "step", "epoch", "loss", "lr", "samples_per_s", "train_loss", "val_loss",
               "val_accuracy")


class MetricsLog:
    """Rank 0's record of a run: ``metrics.jsonl``, ``metrics.csv`` and TensorBoard events in ``tb/`` (the spec's
    ``logging.csv``/``logging.tensorboard`` switch the last two off), and every record passed on to ``trackers``
    (`polytrain.observe.trackers.Trackers`: W&B, MLflow), which a run sets once they have started.

    Other ranks get a log whose ``path`` is None: every call is a no-op. The files are opened at the first
    record, so a run that writes none (a resumed run that was already complete) leaves them as they were.
    ``metrics.jsonl`` is strict JSON (`polytrain.observe.jsonfiles`: a non-finite number is ``null``); TensorBoard gets
    finite values only, under the tags of `polytrain.observe.trackers.SCALAR_TAGS`. TensorBoard events are written by
    `polytrain.observe.tfevents.TensorBoardFile` (no writer library: the one there was imports PyTorch).

    A write that fails (a full disk, a file too large) is a `TrainingFailure` naming the file, as a failed
    checkpoint write is: the run ends there, and nothing more is written. A line an earlier run left cut short (it
    ended on a full disk) is ended before this run's first, so that the two never run together.
    """

    def __init__(self, path: Path | None, tensorboard: bool = True, csv: bool = True) -> None:
        self.path = path
        self.tensorboard = tensorboard
        self.csv = csv
        self.trackers = Trackers()
        self._file: TextIO | None = None
        self._csv_file: TextIO | None = None
        self._csv: Any = None
        self._tb: Any = None
        self._closed = False
        self._failed = False

    def files(self) -> list[Path]:
        """What this log writes (or would, with every switch on): ``metrics.jsonl``, ``metrics.csv``, ``tb/``."""
        return [] if self.path is None else [self.path, self.path.with_suffix(".csv"), self.path.parent / "tb"]

    @property
    def started(self) -> bool:
        """Whether a record was written (the files are open)."""
        return self._file is not None

    def _open(self, path: Path) -> TextIO:
        self._do(path, lambda: path.parent.mkdir(parents=True, exist_ok=True))
        self._file = self._do(path, lambda: _append(path))
        if self.csv:
            csv_path = path.with_suffix(".csv")
            new_csv = not csv_path.exists()
            self._csv_file = self._do(csv_path, lambda: _append(csv_path, newline=""))
            self._csv = csv_module.DictWriter(self._csv_file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
            if new_csv:
                self._do(csv_path, self._csv.writeheader)
        if self.tensorboard:
            self._tb = self._do(path.parent / "tb", lambda: TensorBoardFile(path.parent / "tb"))
        return self._file

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None or self._closed:
            return
        file = self._file or self._open(self.path)
        record = {"event": event, "time": round(time.time(), 3), **fields}
        line = jsonfiles.dumps(record) + "\n"  # a diverged loss is null, never a bare NaN
        self._do(self.path, lambda: file.write(line))
        if event in SCALAR_TAGS and self._csv is not None:
            self._do(self.path.with_suffix(".csv"), lambda: self._csv.writerow(record))
        if self._tb is not None:  # finite only: TensorBoard refuses NaN/inf
            self._do(self._tb.path, lambda: self._tb.write(scalars(event, fields), int(fields.get("step", 0))))
        self.trackers.record(event, fields)

    def _do(self, path: Path, action: Callable[[], T]) -> T:
        """``action``, writing ``path``: an OSError ends the log, raised as the run's one-line failure."""
        try:
            return action()
        except OSError as exc:
            self._closed = self._failed = True
            raise TrainingFailure(f"output: cannot write {path} ({exc.strerror or exc}); free space or choose "
                                  "another output directory, then resume with --resume auto") from exc

    def close(self) -> None:
        """Close the files; later records are not written. A file that cannot be flushed is the run's failure,
        unless a write already failed (the failure that ended the run was reported)."""
        self._closed, reported = True, self._failed
        failure: TrainingFailure | None = None
        for name, path in (("_file", self.path), ("_csv_file", self.path and self.path.with_suffix(".csv")),
                           ("_tb", self._tb.path if self._tb is not None else None)):
            handle = getattr(self, name)
            setattr(self, name, None)
            if handle is None:
                continue
            try:
                self._do(path, handle.close)
            except TrainingFailure as exc:
                failure = failure or exc
        self._csv = None
        if failure is not None and not reported:
            raise failure


def _append(path: Path, newline: str | None = None) -> TextIO:
    """``path`` opened to append lines (flushed at each), after ending a last line an earlier writer cut short."""
    file = path.open("a", buffering=1, newline=newline)
    try:
        if file.tell() > 0:
            with path.open("rb") as existing:
                existing.seek(-1, os.SEEK_END)
                cut_short = existing.read(1) != b"\n"
            if cut_short:
                file.write("\n")
    except OSError:
        file.close()
        raise
    return file


def read_records(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The records of a ``metrics.jsonl`` from byte ``offset`` on, and the offset after the last one read (to follow
    a run that is still writing: a last line cut short — it lacks its closing brace — is left for the next call). A
    line that is not a JSON object (cut short by a crash) is skipped; a missing file has none."""
    try:
        with path.open("rb") as file:
            file.seek(offset)
            data = file.read()
    except FileNotFoundError:
        return [], offset
    records, used = [], 0
    for line in data.splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not line.endswith(b"\n") and record is None:
            break  # still being written (or cut short): read again next time
        used += len(line)
        if isinstance(record, dict):
            records.append(record)
    return records, offset + used


class Progress:
    """A tqdm bar on a terminal; plain lines otherwise (CI, Slurm logs), at most one every
    ``interval_s`` seconds (``POLYTRAIN_PROGRESS_INTERVAL``, default 10) plus each epoch's last,
    with the same fields as the bar: steps, loss, samples/s and the epoch's ETA.

    ``prefix`` (e.g. ``[rank 1] ``) starts every line: ranks other than 0 print only under
    ``--verbose``, and then say who they are.
    """

    def __init__(self, enabled: bool, stream: TextIO = sys.stderr, prefix: str = "",
                 interval_s: float | None = None) -> None:
        self.enabled = enabled
        self.stream = stream
        self.prefix = prefix
        self.bar: Any = None
        self.tty = enabled and stream.isatty() and not prefix
        if interval_s is None:
            raw = os.environ.get("POLYTRAIN_PROGRESS_INTERVAL", "").strip()
            try:
                interval_s = float(raw) if raw else 10.0
            except ValueError:
                interval_s = 10.0
        self.interval_s = interval_s
        self._last_line = 0.0
        self._epoch_start = 0.0
        self._first_done = 0

    def start_epoch(self, epoch: int, epochs: int, total: int) -> None:
        if not self.enabled:
            return
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", file=self.stream, leave=True,
                            dynamic_ncols=True)
        self.epoch_label = f"epoch {epoch + 1}/{epochs}"
        self.total = total
        self._epoch_start = self._last_line = time.monotonic()
        self._first_done = None

    def update(self, done: int, loss: float | None, samples_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = done
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.0f}", refresh=False)
            self.bar.refresh()
        elif loss is not None:
            now = time.monotonic()
            if self._first_done is None:  # steps before the first report (a resumed epoch) take no time here
                self._first_done, self._epoch_start = done, now
            if done < self.total and now - self._last_line < self.interval_s:
                return
            self._last_line = now
            rate = (done - self._first_done) / (now - self._epoch_start) if now > self._epoch_start else 0.0
            eta = f" ETA {_duration((self.total - done) / rate)}" if done < self.total and rate > 0 else ""
            self.line(f"{self.epoch_label} step {done}/{self.total} loss {loss:.4f} {samples_per_s:.0f} samples/s"
                      f"{eta}")

    def end_epoch(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def line(self, text: str) -> None:
        if self.enabled:
            print(f"{self.prefix}{text}", file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
