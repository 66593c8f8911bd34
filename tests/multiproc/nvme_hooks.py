"""Callbacks for the ZeRO-Infinity tests (``callbacks=[nvme_hooks:Files]``, tests/multiproc on PYTHONPATH).

`Files` records, on every rank, the offloaded files DeepSpeed wrote for it (under ``deepspeed.nvme_path``) when
training starts and when it ends, to ``<output>/nvme-rank<R>.json``: the test sees that tensors really went to
the drive and how much. `Freeze` (a `Files`) makes this rank's files immutable (``chattr +i``: not even root may
write them) once the checkpoint of step ``$NVME_FREEZE_STEP`` is written: the next swap-out fails, as on a drive
gone read-only. `Fill` fills the drive instead, `Kill` kills rank 1 mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from polytrain.callbacks import Callback, RunInfo


def offloaded(run: RunInfo) -> dict[str, int]:
    """This rank's offloaded files (relative to nvme_path) and their sizes."""
    root = Path(str(run.spec.deepspeed.nvme_path))
    return {str(p.relative_to(root)): p.stat().st_size
            for p in sorted(root.glob(f"polytrain-*/zero_stage_3/*/rank{run.rank}/*")) if p.is_file()}


class Files(Callback):
    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def _write(self, run: RunInfo, when: str) -> None:
        self.seen[when] = offloaded(run)
        (run.output / f"nvme-rank{run.rank}.json").write_text(json.dumps(self.seen))

    def on_train_start(self, run: RunInfo) -> None:
        self._write(run, "start")

    def on_train_end(self, run: RunInfo, result: Any) -> None:
        self._write(run, "end")


class Freeze(Files):
    def on_checkpoint(self, run: RunInfo, step: int, path: Path) -> None:
        if step == int(os.environ["NVME_FREEZE_STEP"]):
            root = Path(str(run.spec.deepspeed.nvme_path))
            files = [str(root / name) for name in offloaded(run)]
            subprocess.run(["chattr", "+i", *files], check=True)


class Kill(Files):
    """Rank 1 dies (SIGKILL, nothing cleaned up) at the end of step ``$NVME_KILL_STEP``."""

    def on_step_end(self, run: RunInfo, step: int, logs: Any) -> None:
        if run.rank == 1 and step == int(os.environ["NVME_KILL_STEP"]):
            os.kill(os.getpid(), signal.SIGKILL)


class Fill(Files):
    """Once the checkpoint of step ``$NVME_FILL_STEP`` is written, fills the drive under nvme_path (a small tmpfs
    the test mounts) with a file of zeros until no byte is left."""

    def on_checkpoint(self, run: RunInfo, step: int, path: Path) -> None:
        if step == int(os.environ["NVME_FILL_STEP"]):
            chunk = b"\0" * 2**16
            with open(Path(str(run.spec.deepspeed.nvme_path)) / "filler", "wb", buffering=0) as out:
                try:
                    while True:
                        out.write(chunk)
                except OSError:
                    pass  # full


class Rival(Files):
    """Rank 0, as training starts: runs a second job ($NVME_RIVAL: ``{"cmd": [...], "env": {...}}``, the test's) with
    this job's output and nvme_path, and writes to ``<output>/rival.json`` its exit code and stderr and every file
    under nvme_path before and after it."""

    def on_train_start(self, run: RunInfo) -> None:
        super().on_train_start(run)
        if run.rank != 0:
            return
        root = Path(str(run.spec.deepspeed.nvme_path))

        def listing() -> dict[str, int]:
            return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}

        rival = json.loads(os.environ["NVME_RIVAL"])
        before = listing()
        done = subprocess.run(rival["cmd"], env=rival["env"], capture_output=True, text=True, timeout=400)
        (run.output / "rival.json").write_text(json.dumps({"code": done.returncode, "stderr": done.stderr,
                                                           "before": before, "after": listing()}))
