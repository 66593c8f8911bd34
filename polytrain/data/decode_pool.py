"""Image decoding processes: where Pillow's per-image Python work would hold the GIL of the training process.

Measured (``bench/data_throughput.py``, 64x64 JPEGs): two reader threads decode no faster than one, because
opening, converting and wrapping each small image runs Python code under the GIL; two processes decode
nearly twice as fast. Each process is started with ``python -c`` loading `polytrain.data.image_decode` by
path (numpy and Pillow only: no framework import, no re-run of the user's script, no fork of a process that
runs threads), gets the file list once, and then writes each requested batch of uint8 pixels, cropped and
flipped already for an augmented training batch, into a shared memory buffer (``memfd``) it was handed; the
reply is a short JSON line. The reading thread normalises them into float32 straight from that buffer.
Nothing is pickled.

A process ends when its socket closes: on `DecodePool.close`, on garbage collection, or when the training
process dies in any way (the kernel closes the socket), so none is ever left behind.
"""

from __future__ import annotations

import mmap
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polytrain.data import image_decode
from polytrain.data.image_decode import ImageProblem, receive, send

_BOOT = ("import importlib.util as u, sys; s = u.spec_from_file_location('polytrain_image_decode', sys.argv[1]); "
         "m = u.module_from_spec(s); s.loader.exec_module(m); m.serve(int(sys.argv[2]))")


class DecoderGone(RuntimeError):
    """A decoding process ended without being asked to."""


@dataclass
class _Process:
    proc: subprocess.Popen[bytes]
    sock: socket.socket
    buffer: mmap.mmap | None = None
    capacity: int = 0
    dead: bool = field(default=False)


def _shared_buffer(size: int) -> tuple[int, mmap.mmap]:
    """A descriptor of ``size`` bytes of memory another process can map, and this process's map of it."""
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None:
        fd = memfd("polytrain-images", getattr(os, "MFD_CLOEXEC", 0))
    else:  # pragma: no cover - not Linux
        fd = os.dup(tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None).fileno())
    os.ftruncate(fd, size)
    return fd, mmap.mmap(fd, size)


def _stop(processes: list[_Process]) -> None:
    for p in processes:
        p.sock.close()  # the process sees the end of its socket and returns
    for p in processes:
        try:
            p.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()
        if p.buffer is not None:
            try:
                p.buffer.close()
            except BufferError:  # a view of it is still alive somewhere: the map goes with it
                pass
    processes.clear()


class DecodePool:
    """``processes`` decoding processes for one image tree; `read` is thread-safe (one request per process)."""

    def __init__(self, config: dict[str, Any], processes: int) -> None:
        self.config, self.count = config, max(1, processes)
        self.shape = (config["height"], config["width"], 1 if config["mode"] == "L" else 3)
        self.scale = np.asarray(config["scale"], dtype=np.float32)
        self.offset = np.asarray(config["offset"], dtype=np.float32)
        self._processes: list[_Process] = []
        self._idle: queue.SimpleQueue[_Process] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.gone = ""
        self._finalizer = weakref.finalize(self, _stop, self._processes)

    def _start(self) -> None:
        with self._lock:
            if self._processes:
                return
            for _ in range(self.count):
                parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    proc = subprocess.Popen([sys.executable, "-c", _BOOT, image_decode.__file__, str(child.fileno())],
                                            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
                finally:
                    child.close()
                process = _Process(proc, parent)
                self._processes.append(process)
                send(parent, self.config)
                self._idle.put(process)

    def read(self, indices: np.ndarray, draws: np.ndarray | None = None) -> np.ndarray:
        """The images at ``indices``, ``(n, C*H*W)`` float32, augmented by ``draws`` (`image_decode.crops`) when
        given; `ImageProblem` for a bad file."""
        if self._finalizer.alive and not self._processes:
            self._start()
        elif not self._finalizer.alive:
            raise DecoderGone("the image decoding processes were closed")
        process = self._idle.get()
        n = len(indices)
        try:
            if process.dead:  # one process ended: every later read says so instead of waiting for it
                raise DecoderGone(self.gone)
            size = n * int(np.prod(self.shape))
            need = max(1, size)
            request: dict[str, Any] = {"indices": [int(i) for i in indices]}
            if draws is not None:
                request["draws"] = draws.tolist()  # JSON keeps every float exactly
            fds: tuple[int, ...] = ()
            if need > process.capacity:
                fd, buffer = _shared_buffer(need)
                if process.buffer is not None:
                    process.buffer.close()
                process.buffer, process.capacity, fds = buffer, need, (fd,)
                request["bytes"] = need
            try:
                send(process.sock, request, fds)
                reply, _ = receive(process.sock)
            except OSError:
                reply = None
            finally:
                for fd in fds:
                    os.close(fd)
            if reply is None:
                process.dead = True
                code = process.proc.poll()
                self.gone = (f"an image decoding process (pid {process.proc.pid}) ended"
                             + (f" with code {code}" if code is not None else ""))
                raise DecoderGone(self.gone)
            if "error" in reply:
                raise ImageProblem(reply["field"], reply["error"])
            assert process.buffer is not None
            pixels = np.frombuffer(process.buffer, dtype=np.uint8, count=size).reshape(n, *self.shape)
            return image_decode.normalise(pixels, self.scale, self.offset)
        finally:
            self._idle.put(process)

    def pids(self) -> list[int]:
        return [p.proc.pid for p in self._processes]

    def close(self) -> None:
        self._finalizer()
