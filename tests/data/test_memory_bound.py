"""Bounded memory: a full epoch over a Parquet file and a token file several times larger than what the reading
may take, each in a fresh subprocess that reports how far its resident memory rose above its baseline.

The baseline is taken after the imports and after opening the source (footers, label statistics, the
vocabulary scan); the high-water mark (VmHWM) is then reset through /proc/self/clear_refs where the kernel
allows it, so the peak is the reading's alone. The batches are read by 2 threads, a few steps ahead, as the
prefetcher reads them. Page cache is not resident memory of the process; pages of a memory map it touches are,
which is why the token file is read with pread (see polytrain/data/token_file.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

PARQUET_ROWS, WIDTH, ROW_GROUP = 1_300_000, 64, 10_000  # ~400 MiB: 130 row groups of ~3 MiB
TOKENS, SEQ_LEN = 100_000_000, 255  # 200 MB of uint16, 390k windows

STATUS = r"""
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # MiB
"""

READER = STATUS + r"""
import json, os, resource, sys, time
from concurrent.futures import ThreadPoolExecutor
from collections import deque

import numpy as np

from polytrain.data.plan import epoch_plan
from polytrain.spec.tables import DataSpec

kind, path = sys.argv[1], sys.argv[2]

if kind == "parquet":
    from polytrain.data.parquet import open_parquet as opener
    spec = DataSpec(name="parquet", path=path, features=("x",), label="label", val_fraction=0.0, shuffle_window=4)
else:
    from polytrain.data.token_file import open_token_file as opener
    spec = DataSpec(name="token_file", path=path, seq_len=int(sys.argv[3]), val_fraction=0.0)
data = opener(spec, 0)
source = data.train
baseline = status("VmRSS")
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM: the peak from here on is the reading's
    reset = True
except OSError:
    reset = False
start, samples, checksum = time.perf_counter(), 0, 0.0
order = source.order(0, 0)
plans = epoch_plan(len(source), seed=0, epoch=0, global_batch=256, world_size=1, rank=0, accum=1, order=order)
pending = deque()
with ThreadPoolExecutor(2) as pool:
    for plan in plans:
        pending.append(pool.submit(source.read, plan.micro_batches[0]))
        while len(pending) > 4:
            x, y = pending.popleft().result()
            samples += len(x)
            checksum += float(y.ravel()[0])
    while pending:
        x, y = pending.popleft().result()
        samples += len(x)
peak = status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"baseline_mb": baseline, "peak_mb": peak, "growth_mb": peak - baseline, "samples": samples,
                  "n": len(source), "seconds": time.perf_counter() - start, "hwm_reset": reset}))
"""


@pytest.fixture(scope="module")
def big_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    schema = pa.schema([("x", pa.list_(pa.float32(), WIDTH)), ("label", pa.int64())])
    with pq.ParquetWriter(root / "big.parquet", schema, compression="none") as writer:
        for start in range(0, PARQUET_ROWS, 100_000):
            values = rng.random(100_000 * WIDTH, dtype=np.float32)
            features = pa.FixedSizeListArray.from_arrays(pa.array(values), WIDTH)
            labels = pa.array(np.arange(start, start + 100_000) % 10)
            writer.write_table(pa.Table.from_arrays([features, labels], schema=schema), row_group_size=ROW_GROUP)
    with open(root / "big.bin", "wb") as f:
        for start in range(0, TOKENS, 10_000_000):
            (np.arange(start, start + 10_000_000) % 50_000).astype(np.uint16).tofile(f)
    files = {"parquet": root / "big.parquet", "token_file": root / "big.bin"}
    yield files
    for path in files.values():  # pytest keeps the last runs' temporary folders: not these 600 MiB
        path.unlink()


def read_epoch(kind: str, path: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", READER, kind, str(path), str(SEQ_LEN)], capture_output=True,
                          text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["parquet", "token_file"])
@pytest.mark.slow
def test_an_epoch_reads_a_file_larger_than_its_memory(big_files: dict[str, Path], kind: str) -> None:
    size_mb = big_files[kind].stat().st_size / 2**20
    report = read_epoch(kind, big_files[kind])
    print(f"{kind}: file {size_mb:.0f} MiB, baseline {report['baseline_mb']:.0f} MiB, peak {report['peak_mb']:.0f} "
          f"MiB, growth {report['growth_mb']:.0f} MiB ({report['growth_mb'] / size_mb:.1%} of the file), "
          f"{report['samples']} samples in {report['seconds']:.1f} s")
    assert report["samples"] == report["n"]
    assert report["growth_mb"] < size_mb / 3


TRAINER = STATUS + r"""
import json, sys, time


from polytrain import validation
from polytrain.train.trainer import Trainer
from polytrain.world import World

path, out = sys.argv[1], sys.argv[2]
mlp = {"name": "mlp", "params": {"hidden_sizes": [8]}}
warm_up = validation.from_dict({"backend": "local", "model": mlp, "loop": {"epochs": 1}, "output": out + "/warm-up"})
Trainer(warm_up, World(), show_progress=False).fit()  # every import and lazy start-up happens here, not below
spec = validation.from_dict({
    "backend": "local", "model": mlp,
    "data": {"name": "parquet", "path": path, "features": ["x"], "label": "label", "val_fraction": 0.01,
             "batch_size": 4096},
    "optimizer": {"name": "sgd", "lr": 0.01}, "loop": {"epochs": 1, "log_every_n_steps": 100}, "output": out})
baseline = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM: the peak from here on is the training run's
start = time.perf_counter()
result = Trainer(spec, World(), show_progress=False).fit()
print(json.dumps({"baseline_mb": baseline, "peak_mb": status("VmHWM"), "steps": result.global_step,
                  "seconds": time.perf_counter() - start}))
"""


@pytest.mark.slow
def test_training_on_a_file_larger_than_its_memory(big_files: dict[str, Path], tmp_path: Path) -> None:
    """The whole Trainer (prefetcher, model, optimizer, evaluation) over an epoch of the 400 MiB Parquet file,
    after a warm-up run on digits has paid every import: its resident memory rises by less than three quarters of
    the file, while it trains on every row. Measured: 186-193 MiB here, 201 once in CI (the evaluation of a 1 %
    split, scattered over every row group, is about 40 of it; glibc's per-thread arenas about 20: 169 MiB with
    MALLOC_ARENA_MAX=1). A reader that held the file would rise by 400 MiB or more: the bound sits ~100 MiB from
    both (half the file, the bound until 2026-12-03, was within what the allocator's arenas move)."""
    pytest.importorskip("torch")
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("the kernel does not let this process reset its memory high-water mark")
    size_mb = big_files["parquet"].stat().st_size / 2**20
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", TRAINER, str(big_files["parquet"]), str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    growth = report["peak_mb"] - report["baseline_mb"]
    print(f"training: file {size_mb:.0f} MiB, baseline {report['baseline_mb']:.0f} MiB, peak {report['peak_mb']:.0f} "
          f"MiB, growth {growth:.0f} MiB ({growth / size_mb:.1%} of the file), {report['steps']} steps in "
          f"{report['seconds']:.1f} s")
    assert report["steps"] == -(-round(PARQUET_ROWS * 0.99) // 4096)  # every training row, once
    assert growth < size_mb * 3 / 4
