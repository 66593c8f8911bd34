"""Decoding image files into one normalised float32 batch — in a reader thread, or in a decoding process — with
the training batches' seeded crop and flip applied to the decoded uint8 pixels (`augment_pixels`).

This module imports only numpy and Pillow (never polytrain, torch or TensorFlow): `polytrain.data.decode_pool`
starts each decoding process by loading this file by path, so a process starts in a fraction of a second
and never re-runs the user's script. The same `Decoder` serves the thread path, so both give identical bytes.

The process side speaks a small protocol over a Unix socket, with no pickle: each message is a 4-byte
little-endian length and a JSON object; the parent may attach a file descriptor (a shared buffer) to a
request. The first message configures the decoder (files, mode, size, normalisation, augmentation); each later
one is ``{"indices": [...]}`` (with ``"draws"``, three numbers per sample, for an augmented batch) and is
answered ``{"ok": n}`` once the batch's uint8 (n, H, W, C) pixels are in the shared buffer, or
``{"error": ..., "field": ...}`` naming what was wrong with which file. The parent normalises them: a quarter of
the bytes cross, and the decoding process spends its time decoding.
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


def crops(draws: np.ndarray, padding: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sample's three uniform draws → (row, column) of its crop window in the image padded by ``padding``,
    and whether it is flipped."""
    offsets = (draws[:, :2] * (2 * padding + 1)).astype(np.int64)
    return offsets[:, 0], offsets[:, 1], draws[:, 2] < 0.5


def augment_pixels(pixels: np.ndarray, draws: np.ndarray, padding: int, flip: bool,
                   out: np.ndarray | None = None) -> np.ndarray:
    """uint8 (n, H, W, C) images, each cropped (H, W) at random from itself padded by ``padding`` black pixels and,
    with ``flip``, mirrored left-right at random, by its row of ``draws`` (`crops`). Pixel for pixel what padding
    the normalised image with the normalised black and cropping it gives, but on a quarter of the bytes, with no
    padded copy and while the image is still in the decoding worker. Into ``out`` (same shape) when given."""
    n, h, w, _ = pixels.shape
    dy, dx, flips = crops(draws, padding)
    if out is None:
        out = np.zeros_like(pixels)
    else:
        out[...] = 0
    for k in range(n):
        target = out[k, :, ::-1] if flip and flips[k] else out[k]  # writing through a mirrored view flips
        top, left = int(dy[k]) - padding, int(dx[k]) - padding  # the window's corner in the image
        y0, y1, x0, x1 = max(top, 0), min(top + h, h), max(left, 0), min(left + w, w)
        target[y0 - top:y1 - top, x0 - left:x1 - left] = pixels[k, y0:y1, x0:x1]
    return out


def normalise(pixels: np.ndarray, scale: np.ndarray, offset: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 (n, H, W, C) → flat (C, H, W) float32 rows ``pixel * scale + offset``, into ``out`` when given."""
    n, h, w, c = pixels.shape
    x = np.empty((n, c, h, w), dtype=np.float32) if out is None else out[:n * c * h * w].reshape(n, c, h, w)
    for channel in range(c):
        np.multiply(pixels[..., channel], scale[channel], out=x[:, channel], dtype=np.float32)
        x[:, channel] += offset[channel]
    return x.reshape(n, c * h * w)


class Decoder:
    """Image files (or encoded images) → ``(n, C*H*W)`` float32, each image converted to ``mode``, resized to (height, width) when
    ``resize`` (else it must be ``reference``'s size), scaled per channel: ``pixel * scale + offset``; training
    batches cropped from the image padded by ``crop_padding`` and flipped (``horizontal_flip``) by their draws."""

    def __init__(self, files: Sequence[str], mode: str, height: int, width: int, resize: bool,
                 scale: Sequence[float], offset: Sequence[float], reference: tuple[str, int, int] | None,
                 field: str = "path", crop_padding: int = 0, horizontal_flip: bool = False) -> None:
        self.files, self.mode, self.height, self.width, self.resize = list(files), mode, height, width, resize
        self.channels = 1 if mode == "L" else 3
        self.scale = np.asarray(scale, dtype=np.float32)
        self.offset = np.asarray(offset, dtype=np.float32)
        self.reference, self.field = reference, field
        self.crop_padding, self.horizontal_flip = crop_padding, horizontal_flip

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

    def pixel_batch(self, indices: Sequence[int], draws: np.ndarray | None = None,
                    out: np.ndarray | None = None) -> np.ndarray:
        """Image files at ``indices`` as uint8 (n, H, W, C), augmented by ``draws`` when given, into ``out`` (a
        flat uint8 buffer) when given."""
        shape = (len(indices), self.height, self.width, self.channels)
        target = None if out is None else out[:int(np.prod(shape))].reshape(shape)
        augmenting = self.augments(draws)
        pixels = target if target is not None and not augmenting else np.empty(shape, dtype=np.uint8)
        for k, i in enumerate(indices):
            pixels[k] = self.pixels(int(i))
        return self.augment(pixels, draws, target) if augmenting else pixels

    def augments(self, draws: np.ndarray | None) -> bool:
        return draws is not None and bool(self.crop_padding or self.horizontal_flip)

    def augment(self, pixels: np.ndarray, draws: np.ndarray | None, out: np.ndarray | None = None) -> np.ndarray:
        """``pixels`` cropped and flipped by ``draws`` (None: as they are), into ``out`` when given."""
        if not self.augments(draws):
            return pixels
        assert draws is not None
        return augment_pixels(pixels, draws, self.crop_padding, self.horizontal_flip, out)

    def batch(self, indices: Sequence[int], draws: np.ndarray | None = None) -> np.ndarray:
        """Image files at ``indices`` as flat (C, H, W) float32 rows, augmented by ``draws`` when given."""
        return self.normalise(self.pixel_batch(indices, draws))

    def normalise(self, pixels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """uint8 (n, H, W, C) → flat (C, H, W) float32 rows ``pixel * scale + offset``, into ``out`` when given."""
        return normalise(pixels, self.scale, self.offset, out)


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
        out = np.frombuffer(buffer, dtype=np.uint8)
        draws = request.get("draws")
        try:
            decoder.pixel_batch(request["indices"], None if draws is None else np.asarray(draws, np.float64), out)
            reply: dict[str, Any] = {"ok": len(request["indices"])}
        except ImageProblem as problem:
            reply = {"error": str(problem), "field": problem.field}
        finally:
            del out  # the buffer may be replaced by the next request: hold no view of it
        send(sock, reply)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
