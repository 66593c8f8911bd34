"""Crash-safe file operations under `polytrain.checkpoint.store`: durable writes, replacing a directory whole,
and the consistent ``model.safetensors`` + ``model.json`` pair.

Replacing a directory (a re-saved step): on Linux ``renameat2(RENAME_EXCHANGE)`` swaps the new directory
and the old one in one step, and the old one (now under the temporary name) is removed. Where the
kernel or file system cannot exchange, the old directory is renamed to ``.replaced-<name>-<pid>-<ms>``,
the new one renamed in, and the old one removed; `recover_replaced` (run whenever checkpoints are listed)
puts a ``.replaced-`` directory back when its step directory is missing (a crash between the two renames)
and drops it when both exist. One whose writer is still alive on this machine is left to that writer.

The model pair: ``model.json`` records the sha256 of ``model.safetensors`` (`DIGEST_KEY`). A write puts
the tensors in ``.model.safetensors.pending``, replaces ``model.json`` (the commit point), then renames
the pending file over ``model.safetensors``. `settle_model` rolls a committed write forward, so a crash
before the commit leaves the old pair and one after it the new pair.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from polytrain.errors import SpecError

DIGEST_KEY = "safetensors_sha256"
MODEL_FILE, MODEL_JSON, PENDING = "model.safetensors", "model.json", ".model.safetensors.pending"
REPLACED = re.compile(r"^\.replaced-(step-\d{8,})-(\d+)-\d+$")

#: file → (identity when it last matched this hash, the hash): each large file is hashed once per process
_HASHED: dict[Path, tuple[tuple[int, int, int, int], str]] = {}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_identity(file: Path) -> tuple[int, int, int, int]:
    """What changes when a file is rewritten or replaced: inode, size, modification and change times."""
    st = file.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def matches(file: Path, digest: str, hasher: Callable[[Path], str] = sha256) -> bool:
    """Whether ``file`` exists and its sha256 is ``digest`` (remembered while the file stays unchanged)."""
    try:
        key, seen = file.resolve(), (file_identity(file), digest)
    except FileNotFoundError:
        return False
    if _HASHED.get(key) == seen:
        return True
    if hasher(file) != digest:
        return False
    _HASHED[key] = seen
    return True


# ---------------------------------------------------------------------------- directories


def _renameat2() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc before 2.28, or another libc
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step; False where the platform or file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_in(tmp: Path, final: Path) -> None:
    """Move the complete directory ``tmp`` to ``final``, replacing a directory already there so that a
    crash at any moment leaves a complete one at ``final`` (or a ``.replaced-`` one `recover_replaced`
    puts back)."""
    root = final.parent
    if not final.exists():
        os.replace(tmp, final)
        fsync_dir(root)
        return
    if exchange(tmp, final):  # ``tmp`` now holds the old directory: a stale temporary if we crash here
        fsync_dir(root)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    aside = root / f".replaced-{final.name}-{os.getpid()}-{int(time.time() * 1e3)}"
    os.replace(final, aside)
    fsync_dir(root)
    try:
        os.replace(tmp, final)
    except BaseException:
        if not final.exists():
            os.replace(aside, final)
        raise
    fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether process ``pid`` (this one included) exists on this machine."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def recover_replaced(root: Path) -> None:
    """Finish replacements that a crash interrupted: put a ``.replaced-`` directory back where its step
    directory is missing, drop it where the new one is in place. Best effort (a read-only root is left)."""
    try:
        for aside in root.glob(".replaced-step-*"):
            m = REPLACED.match(aside.name)
            if not m or not aside.is_dir() or alive(int(m.group(2))):
                continue
            final = root / m.group(1)
            if final.exists():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(aside, final)
                fsync_dir(root)
    except OSError:
        pass


# ---------------------------------------------------------------------------- the model pair


def settle_model(path: Path, digest: str) -> Path | None:
    """The tensor file that ``model.json`` (recording ``digest``) goes with, after rolling a committed
    write forward; None when neither ``model.safetensors`` nor the pending file matches it."""
    tensors, pending = path / MODEL_FILE, path / PENDING
    if matches(tensors, digest):
        return tensors
    if not matches(pending, digest):
        return None
    try:
        os.replace(pending, tensors)
        fsync_dir(path)
    except OSError:  # e.g. a read-only directory: read the committed tensors where they are
        return pending
    return tensors


def write_model_pair(path: Path, tensors: bytes, manifest_text: str) -> None:
    """Write the tensors and ``model.json`` (``manifest_text``, which records the tensors' sha256) so that
    a crash leaves the old pair or the new one, never a mix."""
    path.mkdir(parents=True, exist_ok=True)
    pending = path / PENDING
    if pending.exists():  # a committed write a crash left unfinished: finish it before reusing the name
        try:
            old = json.loads((path / MODEL_JSON).read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and isinstance(old.get(DIGEST_KEY), str):
            settle_model(path, old[DIGEST_KEY])
    write_file(pending, tensors)
    tmp = path / f".{MODEL_JSON}.tmp-{os.getpid()}"
    write_file(tmp, manifest_text.encode())
    fsync_dir(path)
    os.replace(tmp, path / MODEL_JSON)  # the commit point
    fsync_dir(path)
    os.replace(pending, path / MODEL_FILE)
    fsync_dir(path)


def make_writable_dir(path: Path) -> None:
    """Create ``path`` (with its parents) and write and remove a probe file there; OSError if either fails.
    A real probe: ``os.access`` says yes to root even where nothing can be made (e.g. under /proc)."""
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".polytrain-write-test-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def check_writable_dir(field_name: str, path: Path) -> None:
    """Create ``path`` (rank 0, before any work) or fail in one line naming the spec field."""
    try:
        make_writable_dir(path)
    except OSError as exc:
        raise SpecError(f"{field_name}: cannot write to {path} ({exc.strerror or exc}); choose a writable "
                        "directory") from None
