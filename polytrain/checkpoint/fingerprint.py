"""What a run's data was, in a form a checkpoint's manifest can keep, and what changed since.

A checkpoint's position (epoch, step in the epoch) indexes the epoch's permutation of the training
samples, and the train/validation split is a seeded permutation of the samples too: both are only
meaningful for the same samples. `fingerprint` records what is cheap to read and changes when the data
does — the number of training and validation samples; every file a source reads, with its size and
modification time (and its row-group count for Parquet); a digest of a few samples of in-memory arrays —
and `changes` says in words what differs between two fingerprints, or None when nothing does.

Contents: a file copied without keeping its times (to node-local storage, say) is the same data with a new
modification time. So each file also gets a digest of its contents (`content_digest`): the whole file up to
`WHOLE` bytes; a larger one by `BLOCKS` blocks of `BLOCK` bytes spread evenly from its first to its last byte,
and for Parquet its whole footer (every row group's place, size, row count and statistics). Where the size
and row groups match and only the time differs, equal contents are the same data (`changes` says nothing).
Reading is bounded: at most about ``BLOCKS * BLOCK`` bytes a file for at most `LISTED` files (more files: that
many of them, evenly chosen, go into one digest), whatever the data's size; a same-size edit of a large file
between the sampled blocks is not seen (its position still names the same samples). A checkpoint written
before contents were recorded has none: a new time alone is still a change there.

A file rewritten in place with the same size and time is not seen (the counts still are). The samples of a
user's dataset object are not read: its ``__getitem__`` may be random (augmentation), which would make every
resume look like new data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from polytrain.data.source import ArraySource, Data, Source, Subset
from polytrain.spec.tables import DataSpec

#: files listed one by one in a fingerprint (more are recorded as a count, a total size and a digest)
LISTED = 256
_SAMPLES = 16  # in-memory arrays: samples read into the digest, evenly spaced
WHOLE = 512 * 1024  # a file up to this size is hashed whole
BLOCK, BLOCKS = 64 * 1024, 8  # a larger one by these blocks
FOOTER_MAX = 16 * 2**20  # a Parquet footer larger than this is sampled like the rest


def _root(source: Source) -> Source:
    while isinstance(source, Subset):
        source = source.parent
    return source


def _source_files(source: Source) -> list[tuple[Path, int | None]]:
    """The files a file-backed source reads, with the row-group count of each (Parquet) or None: its
    ``paths`` (CSV, Parquet), ``files`` (image folders) or ``path`` (token file)."""
    paths = getattr(source, "paths", None)
    if paths is None and all(isinstance(f, Path) for f in getattr(source, "files", None) or [None]):
        paths = getattr(source, "files", None)
    if paths is None and isinstance(getattr(source, "path", None), Path):
        paths = [source.path]  # type: ignore[attr-defined]
    if not paths:
        return []
    groups = getattr(source, "groups", None)  # Parquet: (file index, row group) of every row group
    counts = np.bincount([f for f, _ in groups], minlength=len(paths)) if groups is not None else None
    return [(Path(p), None if counts is None else int(counts[i])) for i, p in enumerate(paths)]


def content_digest(path: Path, size: int, parquet: bool = False) -> str:
    """A digest of ``path``'s contents (``size`` bytes): whole up to `WHOLE`, else sampled (see the module)."""
    h = hashlib.sha256(f"{size}|".encode())
    with open(path, "rb") as f:
        if size <= WHOLE:
            h.update(f.read())
            return h.hexdigest()[:32]
        for k in range(BLOCKS):
            f.seek(k * (size - BLOCK) // (BLOCKS - 1))
            h.update(f.read(BLOCK))
        if parquet:
            f.seek(size - 8)
            tail = f.read(8)
            length = int.from_bytes(tail[:4], "little")
            if tail[4:] == b"PAR1" and length <= min(FOOTER_MAX, size - 8):
                f.seek(size - 8 - length)
                h.update(f.read(length))
    return h.hexdigest()[:32]


def _describe_files(files: list[tuple[Path, int | None]]) -> dict[str, Any]:
    listed = []
    for path, row_groups in files:
        st = path.stat()
        entry: dict[str, Any] = {"file": str(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
        if row_groups is not None:
            entry["row_groups"] = row_groups
        listed.append(entry)
    digest = hashlib.sha256("\n".join(
        f"{e['file']}\0{e['bytes']}\0{e['mtime_ns']}\0{e.get('row_groups')}" for e in listed).encode()).hexdigest()
    out: dict[str, Any] = {"files": len(listed), "bytes": sum(e["bytes"] for e in listed), "digest": digest[:32]}
    chosen = np.unique(np.linspace(0, len(listed) - 1, min(len(listed), LISTED)).astype(np.int64)).tolist()
    contents = {listed[i]["file"]: content_digest(Path(listed[i]["file"]), listed[i]["bytes"],
                                                  "row_groups" in listed[i]) for i in chosen}
    if len(listed) <= LISTED:
        out["listed"], out["contents"] = listed, contents
    else:  # names, sizes and row groups of every file, the contents of the chosen ones: no times
        out["content"] = hashlib.sha256("\n".join(
            f"{e['file']}\0{e['bytes']}\0{e.get('row_groups')}\0{contents.get(e['file'])}" for e in listed
        ).encode()).hexdigest()[:32]
    return out


def _sample_digest(source: Source) -> str | None:
    """A digest of a few samples of in-memory arrays (read as the Trainer reads them); None for other sources."""
    if not isinstance(_root(source), ArraySource) or not len(source):
        return None
    x, y = source.read(np.unique(np.linspace(0, len(source) - 1, _SAMPLES).astype(np.int64)))
    h = hashlib.sha256()
    for array in (np.ascontiguousarray(x), np.ascontiguousarray(y)):
        h.update(f"{array.dtype}{array.shape}".encode())
        h.update(array.tobytes())
    return h.hexdigest()[:32]


def fingerprint(spec: DataSpec, data: Data) -> dict[str, Any]:
    """What ``data`` (opened from ``spec``) is: sample counts, the files read, digests of in-memory samples."""
    out: dict[str, Any] = {"train": len(data.train), "val": len(data.val), "files": {}, "samples": {}}
    train_root, val_root = _root(data.train), _root(data.val)
    sides = [("path", train_root)] + ([("val_path", val_root)] if val_root is not train_root else [])
    for field, root in sides:
        files = _source_files(root)
        given = getattr(spec, field, None)
        if not files and given and Path(given).is_file():  # e.g. an .npz read into memory
            files = [(Path(given), None)]
        if files:
            out["files"][field] = _describe_files(files)
    for side, source in (("train", data.train), ("val", data.val)):
        digest = _sample_digest(source)
        if digest is not None:
            out["samples"][side] = digest
    return out


def _size(n: int) -> str:
    return f"{n:,} bytes"


def _file_change(field: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    if old.get("digest") == new.get("digest"):
        return None
    if "listed" in old and "listed" in new:
        before = {e["file"]: e for e in old["listed"]}
        after = {e["file"]: e for e in new["listed"]}
        gone, added = sorted(set(before) - set(after)), sorted(set(after) - set(before))
        if gone or added:
            parts = [f"no longer {', '.join(gone[:3])}" if gone else "", f"new {', '.join(added[:3])}" if added else ""]
            return f"data.{field}: {old['files']} → {new['files']} files ({'; '.join(p for p in parts if p)})"
        for name, was in before.items():
            now = after[name]
            if was.get("row_groups") != now.get("row_groups"):
                return f"data.{field}: {name} has {now['row_groups']} row groups, was {was['row_groups']}"
            if was["bytes"] != now["bytes"]:
                return f"data.{field}: {name} is {_size(now['bytes'])}, was {_size(was['bytes'])}"
            if was["mtime_ns"] != now["mtime_ns"] and not _same_content(old.get("contents", {}).get(name),
                                                                        new.get("contents", {}).get(name)):
                return f"data.{field}: {name} was modified since (same size, {_size(now['bytes'])})"
        return None  # the same files; any new time is a copy of the same contents
    if old.get("files") != new.get("files"):
        return f"data.{field}: {old.get('files')} → {new.get('files')} files"
    if old.get("bytes") != new.get("bytes"):
        return f"data.{field}: its files hold {_size(new['bytes'])}, were {_size(old['bytes'])}"
    if _same_content(old.get("content"), new.get("content")):
        return None
    return f"data.{field}: a file was modified since (same names and sizes)"


def _same_content(old: str | None, new: str | None) -> bool:
    """Whether both digests of contents are there (checkpoints before them have none) and equal."""
    return old is not None and old == new


def changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """What differs from ``old`` to ``new`` (both from `fingerprint`), in words, or None."""
    found = []
    for field in sorted({*old.get("files", {}), *new.get("files", {})}):
        was, now = old.get("files", {}).get(field), new.get("files", {}).get(field)
        if was is None or now is None:
            found.append(f"data.{field}: {'no files read before' if was is None else 'no files read now'}")
        elif (change := _file_change(field, was, now)) is not None:
            found.append(change)
    if old.get("samples") != new.get("samples"):
        found.append("the in-memory samples differ")
    if (old.get("train"), old.get("val")) != (new.get("train"), new.get("val")):
        found.append(f"training samples {old.get('train')} → {new.get('train')}, "
                     f"validation samples {old.get('val')} → {new.get('val')}")
    elif found:
        found.append(f"the same counts ({new.get('train')} training, {new.get('val')} validation samples)")
    return "; ".join(found) or None


# ---------------------------------------------------------------------------- a record read back from a manifest


class RecordError(ValueError):
    """A data record (a manifest's ``dataset``) that is not what `fingerprint` writes; names the field."""


def _bad(field: str, allowed: str, value: Any) -> RecordError:
    return RecordError(f"{field} must be {allowed}, not {json.dumps(value, default=str)[:40]}")


def _whole(field: str, value: Any, minimum: int | None = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise _bad(field, "a whole number" + ("" if minimum is None else f" ≥ {minimum}"), value)


def _text(field: str, value: Any) -> None:
    if not isinstance(value, str):
        raise _bad(field, "text", value)


def _object(field: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _bad(field, "an object", value)
    return value


def check_record(field: str, record: Any) -> None:
    """Raise `RecordError` (naming the field under ``field``) unless ``record`` has the shape `fingerprint` gives
    it, as far as `changes` reads it."""
    record = _object(field, record)
    for side in ("train", "val"):
        if side in record:
            _whole(f"{field}.{side}", record[side])
    for key, digest in _object(f"{field}.samples", record.get("samples", {})).items():
        _text(f"{field}.samples.{key}", digest)
    for name, files in _object(f"{field}.files", record.get("files", {})).items():
        where = f"{field}.files.{name}"
        files = _object(where, files)
        for key in ("files", "bytes"):
            _whole(f"{where}.{key}", files.get(key))
        for key in ("digest", "content"):
            if key in files or key == "digest":
                _text(f"{where}.{key}", files.get(key))
        for name, digest in _object(f"{where}.contents", files.get("contents", {})).items():
            _text(f"{where}.contents[{name!r}]", digest)
        if "listed" not in files:
            continue
        if not isinstance(files["listed"], list):
            raise _bad(f"{where}.listed", "a list", files["listed"])
        for i, entry in enumerate(files["listed"]):
            entry = _object(f"{where}.listed[{i}]", entry)
            _text(f"{where}.listed[{i}].file", entry.get("file"))
            for key in ("bytes", "mtime_ns", "row_groups"):
                if key in entry or key != "row_groups":
                    _whole(f"{where}.listed[{i}].{key}", entry.get(key), None if key == "mtime_ns" else 0)
