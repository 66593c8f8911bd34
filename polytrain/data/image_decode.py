"""Decoding image files into one normalised float32 batch — in a reader thread, or in a decoding process.

This module imports only numpy and Pillow (never polytrain, torch or TensorFlow): `polytrain.data.decode_pool`
starts each decoding process by loading this file by path, so a process starts in a fraction of a second
and never re-runs the user's script. The same `Decoder` serves the thread path, so both give identical bytes.

The process side speaks a small protocol over a Unix socket, with no pickle: each message is a 4-byte
little-endian length and a JSON object; the parent may attach a file descriptor (a shared buffer) to a
request. The first message configures the decoder (files, mode, size, normalisation); each later one is
``{"indices": [...]}`` and is answered ``{"ok": n}`` once the batch is in the shared buffer, or
``{"error": ..., "field": ...}`` naming what was wrong with which file.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

_FORMATS = {".png": ("PNG",), ".jpg": ("JPEG",), ".jpeg": ("JPEG",), ".webp": ("WEBP",), ".bmp": ("BMP",),
            ".gif": ("GIF",), ".tif": ("TIFF",), ".tiff": ("TIFF",)}  # skip probing every other format
_HEADER = struct.Struct("<I")


class ImageProblem(Exception):
    """A file that cannot be used; ``field`` is the spec field to name (``path`` for the tree, or ``image_size``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _open(data: bytes, name: str) -> Image.Image:
    """Pillow's open of an encoded image, trying the format ``name``'s suffix names first (a PNG named .jpg
    still opens). The caller reads a file in one call: Pillow's own reads are many small ones under the GIL."""
    buffer = io.BytesIO(data)
    try:
        return Image.open(buffer, formats=_FORMATS.get(name[name.rfind("."):].lower()))
    except UnidentifiedImageError:
        return Image.open(buffer)


class Decoder:
    """Image files (or encoded images) → ``(n, C*H*W)`` float32, each image converted to ``mode``, resized to (height, width) when
    ``resize`` (else it must be ``reference``'s size), scaled per channel: ``pixel * scale + offset``."""

    def __init__(self, files: Sequence[str], mode: str, height: int, width: int, resize: bool,
                 scale: Sequence[float], offset: Sequence[float], reference: tuple[str, int, int] | None,
                 field: str = "path") -> None:
        self.files, self.mode, self.height, self.width, self.resize = list(files), mode, height, width, resize
        self.channels = 1 if mode == "L" else 3
        self.scale = np.asarray(scale, dtype=np.float32)
        self.offset = np.asarray(offset, dtype=np.float32)
        self.reference, self.field = reference, field

    @property
    def sample_floats(self) -> int:
        return self.channels * self.height * self.width

    def pixels(self, i: int) -> np.ndarray:
        """Image file ``i`` as uint8 (H, W, C)."""
        path = str(self.files[i])
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            raise ImageProblem(self.field, f"cannot read image {path}: {exc}") from exc
        return self.decode(data, path)

    def decode(self, data: bytes, name: str) -> np.ndarray:
        """An encoded image (``name`` says where it came from, in messages) as uint8 (H, W, C)."""
        try:
            with _open(data, name) as image:
                if self.reference is not None and image.size != (self.width, self.height):
                    ref, (w, h) = self.reference[0], image.size
                    raise ImageProblem("image_size", f"images differ in size ({ref} is {self.height}x{self.width}, "
                                       f"{name} is {h}x{w}, height x width); set data.image_size: [height, width]")
                if image.mode != self.mode:  # convert() copies even when the mode is already right
                    image = image.convert(self.mode)
                if self.resize and image.size != (self.width, self.height):
                    image = image.resize((self.width, self.height), Image.Resampling.BILINEAR)
                pixels = np.asarray(image)
        except ImageProblem:
            raise
        except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for a corrupt file
            raise ImageProblem(self.field, f"cannot decode image {name}: {type(exc).__name__}: {exc}") from exc
        return pixels.reshape(self.height, self.width, self.channels)

    def batch(self, indices: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """Image files at ``indices`` as flat (C, H, W) float32 rows, written into ``out`` when given."""
        pixels = np.empty((len(indices), self.height, self.width, self.channels), dtype=np.uint8)
        for k, i in enumerate(indices):
            pixels[k] = self.pixels(int(i))
        return self.normalise(pixels, out)

    def normalise(self, pixels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 (n, H, W, C) → flat (C, H, W) float32 rows ``pixel * scale + offset``, into ``out`` when given."""
        n = len(pixels)
        x = (np.empty((n, self.channels, self.height, self.width), dtype=np.float32) if out is None
             else out[:n * self.sample_floats].reshape(n, self.channels, self.height, self.width))
        for c in range(self.channels):
            np.multiply(pixels[..., c], self.scale[c], out=x[:, c], dtype=np.float32)
            x[:, c] += self.offset[c]
        return x.reshape(n, self.sample_floats)


# --- the decoding process ---------------------------------------------------------------------------------------

def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """One message: its length, then its JSON (``fds`` ride along with the length)."""
    body = json.dumps(message).encode()
    header = _HEADER.pack(len(body))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(body)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and any descriptors that came with it; (None, []) when the other end has gone."""
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    while header and len(header) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(header))
        if not more:
            return None, fds
        header += more
    if not header:
        return None, fds
    (length,) = _HEADER.unpack(header)
    body = bytearray()
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


def serve(fd: int) -> None:
    """Answer requests on the socket ``fd`` until the parent closes it (or dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    sock = socket.socket(fileno=fd)
    config, _ = receive(sock)
    if config is None:
        return
    decoder = Decoder(**config)
    buffer: mmap.mmap | None = None
    while True:
        request, fds = receive(sock)
        if request is None:
            return
        if fds:
            if buffer is not None:
                buffer.close()
            buffer = mmap.mmap(fds[0], request["bytes"])
            for extra in fds:
                os.close(extra)
        assert buffer is not None
        out = np.frombuffer(buffer, dtype=np.float32)
        try:
            decoder.batch(request["indices"], out)
            reply: dict[str, Any] = {"ok": len(request["indices"])}
        except ImageProblem as problem:
            reply = {"error": str(problem), "field": problem.field}
        finally:
            del out  # the buffer may be replaced by the next request: hold no view of it
        send(sock, reply)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
