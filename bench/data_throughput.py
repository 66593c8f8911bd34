"""Samples/s of polytrain's file readers against torch's DataLoader (2 workers) and tf.data (AUTOTUNE), reading
the same image folder and the same Parquet file.

Run:  python bench/data_throughput.py [--images 3000] [--size 64] [--rows 400000] [--rounds 3] [--data DIR]
                                      [--kinds images,augmented,parquet]

It writes (once, into --data or a temporary folder) a class-per-folder tree of RGB JPEGs (--size, 64x64) made from
scikit-learn's bundled digits, and a Parquet file of 64 float32 features per row (one fixed-size list
column) and an integer label, in row groups of 10,000 rows. Each reader then reads a full epoch in a
fresh process (so one framework's threads or forked workers never share a process with another's),
two epochs a process, ``--rounds`` processes a reader, interleaved; the fastest epoch counts. What each does per sample is the same: decode, scale to [0, 1],
normalise, batch (64 images, 256 rows), shuffled; "augmented" images also get the usual training augmentation, a
random crop of the image padded by 4 black pixels and a random horizontal flip (polytrain's ``data.augment``;
by hand in the DataLoader's Dataset; ``tf.pad``, ``tf.image.random_crop`` and ``random_flip_left_right`` in
tf.data):

- polytrain: `polytrain.data.images` / `polytrain.data.parquet` sources read through the Trainer's
  `polytrain.data.prefetch.Prefetcher` (2 threads, 2 steps ahead) over `epoch_plan`; images are decoded in two
  processes (``data.worker_kind: auto``); "polytrain threads" decodes them in the two reader threads instead;
- DataLoader: a map-style Dataset decoding with Pillow for the images; for Parquet the usual
  IterableDataset that hands each worker its share of row groups, shuffled within each; 2 worker processes;
- tf.data: ``read_file`` + ``decode_jpeg`` mapped with AUTOTUNE for the images; for Parquet (tf.data has
  no Parquet reader without tensorflow-io) row groups read by pyarrow inside ``from_generator``,
  interleaved with AUTOTUNE.

Prints samples/s of each and polytrain's ratio against the faster of DataLoader and tf.data (target >= 1.0).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

IMAGE_BATCH, ROW_BATCH, WIDTH, ROW_GROUP = 64, 256, 64, 10_000
PAD = 4  # augmented: the random crop's padding (black) on each side
KINDS = ("images", "augmented", "parquet")
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def make_images(root: Path, count: int, size: int) -> None:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    for i in range(count):
        k = i % len(digits.images)
        grey = Image.fromarray((digits.images[k] * 255 / 16).astype(np.uint8)).resize((size, size), Image.BILINEAR)
        tint = rng.uniform(0.5, 1.0, size=3)
        rgb = (np.asarray(grey, dtype=np.float32)[..., None] * tint).astype(np.uint8)
        folder = root / f"class{digits.target[k]}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rgb, "RGB").save(folder / f"{i:06d}.jpg", quality=90)


def make_parquet(path: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    schema = pa.schema([("x", pa.list_(pa.float32(), WIDTH)), ("label", pa.int64())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            features = pa.FixedSizeListArray.from_arrays(pa.array(rng.standard_normal(n * WIDTH, dtype=np.float32)),
                                                         WIDTH)
            labels = pa.array(rng.integers(0, 10, size=n))
            writer.write_table(pa.Table.from_arrays([features, labels], schema=schema), row_group_size=ROW_GROUP)


# --- the readers: each returns the number of samples it read in one epoch -------------------------------------

def polytrain_reader(kind: str, data: Path, worker_kind: str = "auto") -> Callable[[int], int]:
    from polytrain.data.plan import epoch_plan
    from polytrain.spec.tables import DataSpec

    augment = None
    if kind in ("images", "augmented"):
        from polytrain.data.images import open_images
        from polytrain.spec.tables import AugmentSpec
        extra = {} if worker_kind == "auto" else {"worker_kind": worker_kind}  # (a release without the field)
        if kind == "augmented":
            extra["augment"] = AugmentSpec(crop_padding=PAD, horizontal_flip=True)
        spec = DataSpec(name="images", path=str(data / "images"), mean=MEAN, std=STD, val_fraction=0.0, **extra)
        opened = open_images(spec, 0)
        source, batch, augment = opened.train, IMAGE_BATCH, opened.augment
    else:
        from polytrain.data.parquet import open_parquet
        spec = DataSpec(name="parquet", path=str(data / "table.parquet"), features=("x",), label="label",
                        val_fraction=0.0)
        source, batch = open_parquet(spec, 0).train, ROW_BATCH
    try:
        from polytrain.data.prefetch import Prefetcher
        prefetcher = Prefetcher(workers=spec.workers, depth=spec.prefetch, seed=0, augment=augment)
    except ImportError:  # before the prefetcher landed: the same reading, by hand
        prefetcher = None

    def epoch(e: int) -> int:
        plans = epoch_plan(len(source), seed=0, epoch=e, global_batch=batch, world_size=1, rank=0, accum=1,
                           order=source.order(0, e))
        seen = 0
        if prefetcher is not None:
            for _, batches in prefetcher.steps(source, enumerate(plans), e):
                seen += sum(len(x) for x, _ in batches)
            return seen
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(2) as pool:
            pending: deque = deque()
            for plan in plans:
                pending.append(pool.submit(source.read, plan.micro_batches[0]))
                if len(pending) > 2:
                    seen += len(pending.popleft().result()[0])
            return seen + sum(len(p.result()[0]) for p in pending)

    return epoch


def torch_reader(kind: str, data: Path) -> Callable[[int], int]:
    import pyarrow.parquet as pq
    import torch
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

    scale = 1.0 / (255.0 * np.asarray(STD, np.float32))
    offset = -np.asarray(MEAN, np.float32) / np.asarray(STD, np.float32)

    class Folder(Dataset):
        def __init__(self, root: Path) -> None:
            classes = sorted(d.name for d in root.iterdir() if d.is_dir())
            self.items = [(p, c) for c, name in enumerate(classes) for p in sorted((root / name).glob("*.jpg"))]

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int):
            path, label = self.items[i]
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB"))
            if kind == "augmented":  # on the uint8 pixels: pad with black, crop at random, flip half
                h, w, _ = pixels.shape
                padded = np.zeros((h + 2 * PAD, w + 2 * PAD, 3), np.uint8)
                padded[PAD:PAD + h, PAD:PAD + w] = pixels
                dy, dx = np.random.randint(0, 2 * PAD + 1, size=2)
                pixels = padded[dy:dy + h, dx:dx + w]
                if np.random.rand() < 0.5:
                    pixels = pixels[:, ::-1]
            x = (pixels.astype(np.float32) * scale + offset).transpose(2, 0, 1).reshape(-1)
            return torch.from_numpy(np.ascontiguousarray(x)), label

    class RowGroups(IterableDataset):
        def __init__(self, path: Path) -> None:
            self.path, self.epoch = path, 0
            self.groups = pq.ParquetFile(path).metadata.num_row_groups

        def __iter__(self):
            info = get_worker_info()
            rng = np.random.default_rng([0, self.epoch])
            mine = rng.permutation(self.groups)[info.id::info.num_workers] if info else range(self.groups)
            handle = pq.ParquetFile(self.path)
            for g in mine:
                table = handle.read_row_group(int(g))
                x = table.column("x").combine_chunks().flatten().to_numpy().reshape(-1, WIDTH)
                y = table.column("label").to_numpy()
                order = rng.permutation(len(y))
                for start in range(0, len(y), ROW_BATCH):
                    take = order[start:start + ROW_BATCH]
                    yield torch.from_numpy(x[take]), torch.from_numpy(y[take])

    if kind != "parquet":
        loader = DataLoader(Folder(data / "images"), batch_size=IMAGE_BATCH, shuffle=True, num_workers=2,
                            persistent_workers=True)
    else:
        loader = DataLoader(RowGroups(data / "table.parquet"), batch_size=None, num_workers=2,
                            persistent_workers=True)

    def epoch(e: int) -> int:
        return sum(len(x) for x, _ in loader)

    return epoch


def tf_reader(kind: str, data: Path) -> Callable[[int], int]:
    import tensorflow as tf

    auto = tf.data.AUTOTUNE
    if kind != "parquet":
        root = data / "images"
        classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        items = [(str(p), c) for c, name in enumerate(classes) for p in sorted((root / name).glob("*.jpg"))]
        mean, std = tf.constant(MEAN), tf.constant(STD)

        def load(path, label):
            pixels = tf.image.decode_jpeg(tf.io.read_file(path), channels=3)
            if kind == "augmented":
                shape = tf.shape(pixels)
                padded = tf.pad(pixels, [[PAD, PAD], [PAD, PAD], [0, 0]])
                pixels = tf.image.random_flip_left_right(tf.image.random_crop(padded, shape))
            return (tf.cast(pixels, tf.float32) / 255.0 - mean) / std, label

        dataset = (tf.data.Dataset.from_tensor_slices(([p for p, _ in items], [c for _, c in items]))
                   .shuffle(len(items)).map(load, num_parallel_calls=auto).batch(IMAGE_BATCH).prefetch(auto))
    else:
        import pyarrow.parquet as pq

        path = str(data / "table.parquet")
        groups = pq.ParquetFile(path).metadata.num_row_groups

        def rows(g):
            table = pq.ParquetFile(path).read_row_group(int(g))
            x = table.column("x").combine_chunks().flatten().to_numpy().reshape(-1, WIDTH)
            y = table.column("label").to_numpy()
            order = np.random.default_rng(int(g)).permutation(len(y))
            for start in range(0, len(y), ROW_BATCH):
                take = order[start:start + ROW_BATCH]
                yield x[take], y[take]

        signature = (tf.TensorSpec((None, WIDTH), tf.float32), tf.TensorSpec((None,), tf.int64))
        dataset = (tf.data.Dataset.range(groups).shuffle(groups)
                   .interleave(lambda g: tf.data.Dataset.from_generator(rows, args=(g,), output_signature=signature),
                               cycle_length=2, num_parallel_calls=auto).prefetch(auto))

    def epoch(e: int) -> int:
        return sum(int(x.shape[0]) for x, _ in dataset)

    return epoch


def polytrain_threads_reader(kind: str, data: Path) -> Callable[[int], int]:
    """Images decoded in the two reader threads (``data.worker_kind: threads``), for comparison."""
    return polytrain_reader(kind, data, "threads")


READERS = {"polytrain": polytrain_reader, "polytrain threads": polytrain_threads_reader, "DataLoader": torch_reader,
           "tf.data": tf_reader}


def run_one(reader: str, kind: str, data: Path) -> None:
    """In a fresh process: two epochs, print the faster one's samples/s as JSON."""
    epoch = READERS[reader](kind, data)
    best, samples = float("inf"), 0
    for e in range(2):
        start = time.perf_counter()
        samples = epoch(e)
        best = min(best, time.perf_counter() - start)
    print(json.dumps({"samples": samples, "per_s": samples / best}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--size", type=int, default=64, help="image height and width (pixels)")
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each reader (the best counts)")
    parser.add_argument("--data", type=Path, default=None, help="where to write the data (default: a temporary folder)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="what to read (default: %(default)s)")
    parser.add_argument("--run", nargs=3, metavar=("READER", "KIND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_one(args.run[0], args.run[1], Path(args.run[2]))
        return
    kinds = [k for k in args.kinds.split(",") if k]
    if not set(kinds) <= set(KINDS):
        sys.exit(f"--kinds: expected some of {','.join(KINDS)}, got {args.kinds}")
    with tempfile.TemporaryDirectory() as scratch:
        data = args.data or Path(scratch)
        if not (data / "images").exists():
            make_images(data / "images", args.images, args.size)
        if "parquet" in kinds and not (data / "table.parquet").exists():
            make_parquet(data / "table.parquet", args.rows)
        rates: dict[str, dict[str, float]] = {kind: {} for kind in kinds}
        for _ in range(args.rounds):  # rounds interleave the readers: a busy moment of the machine hits all of them
            for kind in rates:
                for reader in READERS:
                    if reader == "polytrain threads" and kind == "parquet":
                        continue
                    done = subprocess.run([sys.executable, __file__, "--run", reader, kind, str(data)],
                                          capture_output=True, text=True, check=False)
                    if done.returncode != 0:
                        print(f"{kind:8s} {reader:10s} failed: {done.stderr.strip().splitlines()[-1:]}")
                        continue
                    rate = json.loads(done.stdout.strip().splitlines()[-1])["per_s"]
                    rates[kind][reader] = max(rate, rates[kind].get(reader, 0.0))
        for kind, best in rates.items():
            line = "  ".join(f"{name} {rate:>10,.0f}/s" for name, rate in best.items())
            others = [best[r] for r in ("DataLoader", "tf.data") if r in best]
            ratio = f"  polytrain / faster of the two: {best['polytrain'] / max(others):.2f}x" \
                if others and "polytrain" in best else ""
            print(f"{kind:9s} {line}{ratio}")


if __name__ == "__main__":
    main()
