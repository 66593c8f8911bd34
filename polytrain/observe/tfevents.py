"""TensorBoard event files written directly: the record framing and the few protobuf fields a scalar needs.

An event file is a sequence of records — an 8-byte little-endian length, its masked CRC-32C, the data, the
data's masked CRC-32C — each holding one serialised ``Event`` protobuf: ``wall_time`` (field 1, double), ``step``
(2, varint), ``file_version`` (3, string: the first record) and ``summary`` (5), whose ``value`` entries (1) are
a ``tag`` (1, string) with a ``simple_value`` (2, float). That is all a scalar log needs, so polytrain encodes
it here rather than importing a writer: tensorboardX's package imports PyTorch on import (~3 s of CPU in every
TensorFlow rank, which has no other use for it). TensorFlow's own reader (`summary_iterator`, which checks both
CRCs) reads these files in the tests.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from pathlib import Path


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # CRC-32C (Castagnoli), reflected
        table.append(crc)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> bytes:
    """The record format's masked CRC-32C of ``data``, packed."""
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def record(data: bytes) -> bytes:
    """``data`` framed as one record."""
    header = struct.pack("<Q", len(data))
    return header + masked_crc(header) + data + masked_crc(data)


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # an int64 below zero is its two's complement, ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, scalars: dict[str, float] | None = None,
          file_version: str | None = None) -> bytes:
    """One serialised ``Event``."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _bytes_field(5, values)
    return out


class TensorBoardFile:
    """A TensorBoard event file written in the caller's thread: one event per record, holding its scalars.
    Written to the file's buffer; flushed (and synced) with the first record, then at most every ``flush_s``
    seconds and at ``close`` — no writer queue or threads, which would wake on every scalar and compete with the
    training step for the GIL and the cores."""

    def __init__(self, logdir: Path, flush_s: float = 10.0) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        #: the event file, named as TensorBoard's writers name theirs (time, host) plus the process id
        self.path = logdir / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self._file = self.path.open("ab")
        self._file.write(record(event(time.time(), file_version="brain.Event:2")))
        self.flush_s, self._flushed = flush_s, -math.inf  # the first record is flushed at once

    def write(self, values: dict[str, float], step: int) -> None:
        if values:
            self._file.write(record(event(time.time(), step, values)))
        if time.monotonic() - self._flushed >= self.flush_s:  # a sync: a few ms, not per record
            self.flush()
            self._flushed = time.monotonic()

    def flush(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self.flush()
        finally:
            self._file.close()
