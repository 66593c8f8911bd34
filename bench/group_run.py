"""Running a bench's launcher command so that a timeout leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def run_group(cmd: list[str], env: dict[str, str], timeout: float, what: str, cwd: Path) -> tuple[int, str]:
    """Run ``cmd`` in a session of its own; past ``timeout`` kill its whole process group (torchrun's workers
    too, which killing torchrun alone would leave behind). Returns the exit code and the output."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        sys.exit(f"{Path(sys.argv[0]).name}: {what}: not done after {timeout:.0f} s (--timeout); killed")
    return proc.returncode, out
