"""Slow storage for tests/multiproc/test_slow_storage.py, loaded by putting this directory on PYTHONPATH.

Each checkpoint file written under ``$SLOW_WRITE_UNDER`` — its tensors and manifest (``*.safetensors``,
``*.json``, and their temporary names: checkpoints and the final model) — takes ``$SLOW_WRITE_S`` seconds longer to reach the disk:
``os.fsync`` sleeps first, a stand-in for network storage. With ``SLOW_WRITE_KILL=1`` the process SIGKILLs
itself there instead (a writer that dies mid-write). Other files (the metrics logs) and directories are not
slowed; nothing is without ``SLOW_WRITE_UNDER``.
"""

import os
import signal
import time

_UNDER = os.environ.get("SLOW_WRITE_UNDER")

if _UNDER:
    _fsync = os.fsync

    def _slow_fsync(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        name = os.path.basename(path)
        checkpoint_file = ".safetensors" in name or (".json" in name and ".jsonl" not in name)  # temporary names too
        if path.startswith(_UNDER) and checkpoint_file and os.path.isfile(path):
            if os.environ.get("SLOW_WRITE_KILL") == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(float(os.environ.get("SLOW_WRITE_S", "4")))
        _fsync(fd)

    os.fsync = _slow_fsync
