"""ZeRO-Infinity: DeepSpeed's optimizer state and partitioned parameters in files on an NVMe drive.

``deepspeed: {stage: 3, offload_optimizer: nvme, offload_param: nvme, nvme_path: DIR, aio: {...}}``. DeepSpeed
writes the files itself, through its async I/O op (``async_io``, built once against libaio and kept by versions,
`load_aio_op`); polytrain owns where they go and that they go away:

- the folder: ``<nvme_path>/polytrain-<digest of the output directory and a key of this job's own>``, so no two
  jobs ever share one, not even two with the same output; DeepSpeed makes ``zero_stage_3/optimizer/rank<R>`` and
  ``zero_stage_3/<dtype>params/rank<R>`` under it. Every rank of the job holds a shared lock on it while it lives
  (`polytrain.adapters.torch.swap_folders`): at start-up a live job of the same output refuses this one (one line,
  exit code 2) before anything is touched, and a killed one's folder is removed;
- before the engine is built, on every rank: the folder can be made and written with direct I/O (DeepSpeed opens
  with ``O_DIRECT``), the drive has room for what this node's ranks will write (`needed_bytes`) and the op loads;
  what fails is one line naming the path on every rank. Each rank removes its own files at the end of the run,
  also a failed one, and the last to let go of the lock removes the folder;
- a write that fails mid-run (the drive full, read-only, or the files made read-only) is one line naming the
  path and the last complete checkpoint, exit code 1: DeepSpeed itself only fails an assertion.

What a DeepSpeed user can tune stays in ``deepspeed.config.zero_optimization.offload_*`` (``buffer_count``,
``max_in_cpu``, ``pipeline_read``...). Only tensors of at least ``max(1 MiB, aio.block_size)`` go to the drive
(DeepSpeed's rule); smaller ones stay in host memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import math
import os
import platform
import secrets
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polytrain.adapters.torch.swap_folders import claim, hold, job_folder, rank_files, remove
from polytrain.errors import BackendUnavailableError, SpecError, TrainingFailure
from polytrain.spec.tables import TrainSpec

PROBE = ".polytrain-probe"
ALIGN = 4096  # a direct-I/O write's alignment
OP_CACHE = Path.home() / ".cache" / "polytrain" / "deepspeed_ops"  # built ops, by versions (`load_aio_op`)
MARGIN = 1.1  # room over the estimate: DeepSpeed pads each swapped tensor to its I/O alignment


def offload_section(spec: TrainSpec, key: str, on_gpu: bool, folder: Path | None = None) -> dict[str, Any] | None:
    """``zero_optimization.offload_optimizer`` / ``offload_param`` for the spec's device (None: no offload);
    ``folder``: the job's (`prepare`), by default the keyless `job_folder`."""
    ds = spec.deepspeed
    device = ds.optimizer_device if key == "offload_optimizer" else ds.param_device
    if not device:
        return None
    section: dict[str, Any] = {"device": device, "pin_memory": on_gpu}
    if device == "nvme":
        section["nvme_path"] = str(folder or job_folder(spec))
    return section


def aio_section(spec: TrainSpec) -> dict[str, Any] | None:
    """DeepSpeed's ``aio`` table from ``deepspeed.aio`` (None without an nvme offload)."""
    from polytrain.spec import schema as schema

    return schema.plain(spec.deepspeed.aio) if spec.deepspeed.uses_nvme else None


def needed_bytes(spec: TrainSpec, numel: int, world_size: int) -> int:
    """What one rank writes to the drive, at most: its ZeRO-3 partition of the fp32 master weights, of their
    gradients and of the optimizer's state (offload_optimizer: nvme), and of the parameters in their training dtype
    (offload_param: nvme)."""
    from polytrain.plan.memory import Precision, optimizer_state_bytes

    precision = Precision(spec.precision, optimizer_state_bytes(spec.optimizer.name, spec.optimizer.momentum))
    part = math.ceil(numel / world_size)
    per_element = 0
    if spec.deepspeed.optimizer_device == "nvme":
        per_element += 4 + 4 + precision.optimizer_state
    if spec.deepspeed.param_device == "nvme":
        per_element += precision.low
    return int(per_element * part * MARGIN) + ALIGN


def load_aio_op() -> None:
    """DeepSpeed's async I/O op (and the pinned-memory op it needs), loaded before DeepSpeed asks for it.

    DeepSpeed builds it on first use (JIT, a few minutes on two cores), in a build folder whose commands name the
    virtual environment's paths, so every new checkout would build it again. The built libraries are kept in
    `OP_CACHE` under the torch, DeepSpeed, Python and accelerator versions they were built for, and loaded from
    there into DeepSpeed's table of loaded ops; only a missing entry is built.
    """
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from deepspeed.ops.op_builder.builder import OpBuilder

    builder = AsyncIOBuilder()
    if builder.NAME in OpBuilder._loaded_ops:
        return
    if not builder.is_compatible(verbose=False):
        raise BackendUnavailableError(
            "deepspeed.offload_optimizer/offload_param: nvme needs DeepSpeed's async I/O op, which builds against "
            "libaio: install Debian's libaio-dev (scripts/setup.sh --all does, as root) or your system's "
            "libaio-devel, then run again")
    cached = OP_CACHE / op_key()
    names = ("pin_memory", builder.NAME)  # the pinned-memory op first: the async I/O op uses its symbols
    if all((cached / f"{name}.so").is_file() for name in names):
        for name in names:
            found = importlib.util.spec_from_file_location(name, cached / f"{name}.so")
            assert found is not None and found.loader is not None
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
            OpBuilder._loaded_ops[name] = module
            if name == "pin_memory":  # as DeepSpeed loads it: its symbols global, for the async I/O op
                sys._deepspeed_pin_memory_op_module = module  # type: ignore[attr-defined]
                ctypes.CDLL(str(cached / f"{name}.so"), mode=ctypes.RTLD_GLOBAL)
        return
    builder.load(verbose=False)
    cached.mkdir(parents=True, exist_ok=True)
    for name in names:
        built = Path(OpBuilder._loaded_ops[name].__file__)
        partial = cached / f".{name}.so.{os.getpid()}"
        shutil.copyfile(built, partial)
        partial.replace(cached / f"{name}.so")


def op_key() -> str:
    """The versions a built op is good for."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    return (f"torch{torch.__version__}-deepspeed{deepspeed.__version__}-py{sys.version_info[0]}.{sys.version_info[1]}"
            f"-{get_accelerator().device_name()}-{platform.machine()}")


def keep_parameter_dtype() -> None:
    """Make ZeRO-3 give its parameter swapper the parameters' own dtype on every accelerator.

    ``Init._set_dtype`` (DeepSpeed 0.19.8) reads ``dtype or fp16 if fp16_supported() else bf16 if ...``: operator
    precedence drops the dtype the engine passes wherever fp16 is unsupported (the CPU accelerator), so the swapper
    is made for bf16 and every parameter partition it takes to the drive is silently rounded to bf16 in an fp32
    run (measured: losses 6e-5 off the run without offload after 23 steps). With a dtype given, it is kept.
    """
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._set_dtype
    if getattr(original, "keeps_dtype", False):
        return

    def set_dtype(self: Any, ds_config: Any, dtype: Any) -> None:
        original(self, ds_config, dtype)
        if dtype is not None:
            self.dtype = dtype

    set_dtype.keeps_dtype = True  # type: ignore[attr-defined]
    Init._set_dtype = set_dtype


def problem(folder: Path, need: int) -> str:
    """Why ``folder`` cannot take ``need`` bytes written with direct I/O ("" when it can)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create {folder} ({exc.strerror or exc}); choose a writable directory"
    try:
        create_probe(folder, getattr(os, "O_DIRECT", 0))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return (f"{folder} is on a filesystem without direct I/O (O_DIRECT), which DeepSpeed's async I/O "
                    "needs; choose a directory on a local drive")
        return f"cannot write to {folder} ({exc.strerror or exc}); choose a writable directory"
    free = free_bytes(folder)
    if free < need:
        return (f"{free / 2**20:.1f} MiB free under {folder}, but this node's ranks write about "
                f"{need / 2**20:.1f} MiB there; free space or choose another drive")
    return ""


def create_probe(folder: Path, flags: int = 0) -> None:
    """Make (with ``flags``) and remove a file in ``folder``; raises the OSError that stops it."""
    probe = folder / f"{PROBE}-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | flags, 0o600))
    finally:
        probe.unlink(missing_ok=True)


def prepare(backend: Any, numel: int) -> Path:
    """Before ``deepspeed.initialize``, on every rank (collective): this job's folder made and locked on every node,
    a live job of the same output refusing this one before anything is touched and a killed one's files removed
    (`claim`), then the folder checked; a problem on any rank is the same one line on all of them. Returns the
    folder (this rank holds its lock until `remove`)."""
    spec, world = backend.spec, backend.world
    load_aio_op()
    keep_parameter_dtype()
    key = backend.broadcast_object(secrets.token_hex(8) if world.rank == 0 else None)
    folder = job_folder(spec, str(key))
    try:
        _agree(backend, claim(folder, spec) if world.local_rank == 0 else "")
        found = ""
        if world.local_rank != 0:
            try:
                hold(folder, None)
            except OSError as exc:
                found = f"cannot write to {folder} ({exc.strerror or exc}); choose a writable directory"
        _agree(backend, found or problem(folder, needed_bytes(spec, numel, world.size) * world.local_size))
        backend.barrier()
    except BaseException:
        remove(folder, world.rank)  # this job's own folder, nothing else
        raise
    return folder


def _agree(backend: Any, found: str) -> None:
    """Every rank learns every rank's problem (``found``: "" for none); the first is one line on each."""
    for rank, text in enumerate(backend.all_gather_object(found)):
        if text:
            raise SpecError(f"deepspeed.nvme_path: {text} (rank {rank})")


@contextlib.contextmanager
def failures_named(spec: TrainSpec, folder: Path | None, rank: int) -> Iterator[None]:
    """Around DeepSpeed's calls that swap tensors: a drive that no longer takes this rank's writes is one line
    (`write_failure`), not DeepSpeed's failed assertion."""
    try:
        yield
    except (AssertionError, RuntimeError, OSError) as exc:
        named = None if folder is None else write_failure(spec, folder, rank)
        if named is None:
            raise
        raise named from exc


@contextlib.contextmanager
def swapped_in(optimizer: Any, index: int) -> Iterator[None]:
    """ZeRO-3 sub-group ``index``'s fp32 partition and optimizer state in memory for the block, written back to the
    drive after it (state made there, e.g. on a resume before the first step, is then swapped like DeepSpeed's
    own); nothing to do for a sub-group kept in memory."""
    swappable = getattr(optimizer, "_swappable_optimizer_subgroup", None)
    if swappable is None or not swappable(index):
        yield
        return
    optimizer._optimizer_states_and_gradient_swap_in(index)
    try:
        yield
    finally:
        optimizer._optimizer_states_and_gradient_swap_out(index)


def write_failure(spec: TrainSpec, folder: Path, rank: int) -> TrainingFailure | None:
    """The one-line failure for an exception raised while DeepSpeed swapped tensors, when the cause is this rank's
    files that can no longer be written (None: something else went wrong)."""
    reason = ""
    for path in [*rank_files(folder, rank), folder]:
        try:
            if path.is_dir():
                create_probe(path)
            else:
                os.close(os.open(path, os.O_WRONLY))
        except OSError as error:
            reason = error.strerror or str(error)
            break
    if not reason and free_bytes(folder) < ALIGN:
        reason = os.strerror(errno.ENOSPC)
    return failure(spec, folder, reason) if reason else None


def check_room(spec: TrainSpec, folder: Path | None) -> None:
    """After each step: a drive that filled up during it may have cut DeepSpeed's writes short (its async I/O does
    not look at what a completed write wrote), so the run stops before reading them back and before its next
    checkpoint."""
    if folder is not None and free_bytes(folder) < ALIGN:
        raise failure(spec, folder, os.strerror(errno.ENOSPC))


def free_bytes(folder: Path) -> int:
    """Room left on the drive for unprivileged writes (what ``df`` calls available: blocks a filesystem reserves
    for root are not counted, also for root)."""
    return shutil.disk_usage(folder).free


def failure(spec: TrainSpec, folder: Path, reason: str) -> TrainingFailure:
    from polytrain.checkpoint.store import complete_checkpoints

    kept = complete_checkpoints(spec.checkpoint_dir)
    previous = f"the last checkpoint {kept[-1]} is intact" if kept else "no checkpoint was written yet"
    return TrainingFailure(
        f"deepspeed.nvme_path: cannot write the offloaded state under {folder} ({reason}); {previous}; free space "
        "or make it writable, then resume with --resume auto")
