"""``hvd.init()`` and the topology queries, on torch.distributed.

`init` reads the World the launcher left (`polytrain.environments.detect_world`), agrees on a
rendezvous address where the launcher does not give one (horovodrun's gloo mode through
its HTTP key-value server, MPI launchers through ``polytrain.environments.ensure_master``),
starts one torch.distributed process group (gloo for CPU tensors, plus NCCL for CUDA
tensors when there is a GPU) and keeps its key-value store for stall reports and join.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from polytrain.comm.mpi_transport import mpi_installed
from polytrain.comm.net import free_port, keep_gloo_on_loopback, route_address
from polytrain.environments import detect_world, ensure_master
from polytrain.horovod.common import HorovodSettings, Topology, topology_from_records, topology_from_world
from polytrain.horovod.torch import elastic_world
from polytrain.horovod.torch import process_sets as ps_module
from polytrain.horovod.torch.mpi import open_engine
from polytrain.horovod.torch.runtime import Runtime, runtime
from polytrain.horovod.torch.runtime import basics as _basics
from polytrain.observe.timeline import NULL, Timeline, write_chrome_trace
from polytrain.world import World

is_initialized, size, rank, local_size = _basics.is_initialized, _basics.size, _basics.rank, _basics.local_size
local_rank, cross_size, cross_rank, is_homogeneous = (_basics.local_rank, _basics.cross_size, _basics.cross_rank,
                                                      _basics.is_homogeneous)
#: whether the shim can use MPI at all (mpi4py is importable)
mpi_built = mpi_installed


def select_backend(cuda_available: bool, nccl_available: bool) -> str:
    """The torch.distributed backend: gloo for CPU tensors, and NCCL for CUDA tensors when usable.

    A composite backend keeps CPU collectives (metrics, objects, metadata) working in GPU jobs.
    """
    if cuda_available and nccl_available:
        return "cpu:gloo,cuda:nccl"
    return "gloo"


_init_count = 0


# ----------------------------------------------------------------------------- rendezvous

def _horovodrun_master(world: World, env: dict[str, str]) -> World:
    """Under ``horovodrun --gloo``: rank 0 publishes a torch master in horovodrun's HTTP KV store."""
    server = f"http://{env['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{env['HOROVOD_GLOO_RENDEZVOUS_PORT']}"
    url = f"{server}/polytrain/torch-master-{_init_count}"
    if world.rank == 0:
        addr = route_address(env["HOROVOD_GLOO_RENDEZVOUS_ADDR"])
        value = f"{addr}:{free_port(addr)}".encode()
        request = urllib.request.Request(url, data=value, method="PUT")
        urllib.request.urlopen(request, timeout=30).close()
    else:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    value = response.read()
                break
            except urllib.error.HTTPError as exc:
                if exc.code != 404 or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    addr, port = value.decode().rsplit(":", 1)
    return World(**{**world.__dict__, "master_addr": addr, "master_port": int(port)})


def agree_master(world: World, env: dict[str, str]) -> World:
    """``world`` with a master address and port every rank agrees on.

    horovodrun's gloo mode names only its own HTTP server: rank 0 publishes a master
    there. MPI launchers agree over MPI (``polytrain.environments.ensure_master``).
    """
    if world.size == 1:
        return world
    if not world.master_known and "HOROVOD_GLOO_RENDEZVOUS_PORT" in env and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env:
        return _horovodrun_master(world, env)
    return ensure_master(world)  # known master: unchanged, or exact node ranks under an MPI launcher


# ----------------------------------------------------------------------------- init / shutdown

def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start the shim (Horovod's ``hvd.init``); a second call does nothing.

    ``comm`` may be a list of global ranks (only the full list is supported: every process
    of the launch takes part) or an mpi4py communicator spanning the launch.
    ``process_sets`` is a list of `ProcessSet` objects to register now, or ``"dynamic"``.
    """
    global _init_count
    if _basics.current is not None:
        return
    env = dict(os.environ)
    settings = HorovodSettings.from_env(env)
    _init_count += 1
    world = agree_master(detect_world(env), env)
    _check_comm(comm, world)
    backend = select_backend(torch.cuda.is_available(), dist.is_nccl_available())
    owns_group = not dist.is_initialized()
    elastic = owns_group and elastic_world.membership() is not None
    if elastic:  # polytrain's elastic driver started this worker: its group is formed on the driver's store
        elastic_world.check_supported(backend == "nccl")
        store = elastic_world.form()
        world, backend = elastic_world.world(world), "gloo"
    elif owns_group:
        if world.size == 1:
            store = dist.HashStore()
        else:  # rank 0 (or torchrun's agent) hosts it; on a loopback master it and gloo listen on loopback only
            from polytrain.adapters.torch.backend import rendezvous_store

            keep_gloo_on_loopback(world.master_addr)
            store = rendezvous_store(world, dist.constants.default_pg_timeout)
        from polytrain.adapters.torch.backend import import_before_group

        import_before_group()  # else a group made now could never end (see there)
        # Keys of one start never meet those of an earlier one: torchrun keeps its store across
        # restarts, and elastic.run re-initialises in the same process.
        store = dist.PrefixStore(f"polytrain-hvd/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_init_count}", store)
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=world.rank,
                                world_size=world.size)
    else:  # the script (or a Trainer's backend) started torch.distributed itself: reuse it
        store = dist.distributed_c10d._get_default_store()
        backend = str(dist.get_backend())
        world = elastic_world.world(world)  # under the elastic driver: the version the group was formed for
    records = torch.tensor([world.node_rank, world.local_rank, world.local_size], dtype=torch.int64)
    gathered = torch.empty(world.size * 3, dtype=torch.int64)
    if world.size > 1:
        dist.all_gather_single(gathered, records)
    else:
        gathered = records
    topology = topology_from_records(gathered.view(-1, 3).tolist(), world.rank)
    state = _basics.current = Runtime(world=world, topology=topology, settings=settings,
                                      store=dist.PrefixStore("hvd", store), backend=backend, owns_group=owns_group,
                                      mpi=open_engine(env, world.size))
    ps_module.setup_global(state)
    if settings.timeline:
        start_timeline(settings.timeline)
    if process_sets is not None and not isinstance(process_sets, str):
        for process_set in process_sets:
            ps_module.add_process_set(process_set)


def _check_comm(comm: Any, world: World) -> None:
    if comm is None:
        return
    if isinstance(comm, (list, tuple)):
        if comm and sorted(comm) != list(range(world.size)):
            raise ValueError(f"hvd.init(comm={list(comm)}) must list every rank 0..{world.size - 1}: "
                             "polytrain's shim runs on all processes of the launch (use process sets)")
        return
    size = getattr(comm, "Get_size", None)
    if size is None or size() != world.size:
        raise ValueError("hvd.init(comm=...) must be a list of ranks or an mpi4py communicator "
                         "spanning every process of the launch")


def shutdown() -> None:
    """Stop the shim and its process group (Horovod's ``hvd.shutdown``)."""
    state, _basics.current = _basics.current, None
    if state is None:
        return
    state.handles.clear()
    if state.timeline_file and not state.broken:
        _write_timeline(state)
    ps_module.reset(state)
    if state.mpi is not None and not state.broken:
        state.mpi.close()
    if state.owns_group and dist.is_initialized() and not state.broken:
        # Nothing of the shim holds the group after this, so it ends here (its gloo threads joined) while the
        # interpreter is whole: a gloo thread left running into finalisation aborts the process when it next
        # needs the GIL ("terminate called without an active exception").
        dist.destroy_process_group()


@atexit.register
def _exit_cleanly() -> None:
    """Skip the process group's destructor when a collective was abandoned: it would wait forever."""
    if _basics.current is not None and _basics.current.broken:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    shutdown()


# ----------------------------------------------------------------------------- queries

def topology_estimate(world: World | None = None) -> Topology:
    """The topology the launcher describes, before any process exchange (for tools and tests)."""
    return topology_from_world(world or detect_world())


def mpi_threads_supported() -> bool:
    """True when the shim moves data over MPI (it needs MPI_THREAD_MULTIPLE for that)."""
    if not mpi_enabled():
        raise ValueError("Horovod MPI is not enabled; Please make sure it's installed and enabled.")
    return True


def mpi_enabled() -> bool:
    """Whether this job's CPU collectives run on MPI (see `mpi`)."""
    return is_initialized() and runtime().mpi is not None


def gloo_enabled() -> bool:
    return is_initialized() and "gloo" in runtime().backend


def gloo_built() -> bool:
    return dist.is_gloo_available()


def nccl_built() -> bool:
    return dist.is_nccl_available() and torch.cuda.is_available()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every collective (and each DistributedOptimizer bucket) until `stop_timeline` or
    ``hvd.shutdown()``, then write all ranks' records into ``file_path`` as one Chrome trace
    (Horovod's ``HOROVOD_TIMELINE`` does this from ``hvd.init()``). ``mark_cycles`` has no meaning
    here: the shim has no background cycle."""
    state = runtime()
    if state.timeline_file is not None:
        return
    state.timeline = Timeline(state.world.rank)
    state.timeline_file = file_path
    if state.world.size > 1:  # line the ranks' clocks up at a common moment
        dist.barrier()
    state.timeline.reset_origin()


def stop_timeline() -> None:
    """Stop recording and write the timeline (collective: every rank must call it)."""
    state = runtime()
    if state.timeline_file is not None:
        _write_timeline(state)


def _write_timeline(state: Runtime) -> None:
    """Each rank puts its events in the store; rank 0 collects them and writes the file.

    Through the store rather than a collective: at shutdown the ranks need not be in step,
    and a rank that is already gone only leaves its track out (after a 30 s wait).
    """
    events, path = state.timeline.events, state.timeline_file
    state.timeline, state.timeline_file = NULL, None
    key = f"timeline/{_init_count}"
    try:
        state.store.set(f"{key}/{state.world.rank}", json.dumps(events))
        if state.world.rank != 0:
            return
        everyone = {0: events}
        for rank in range(1, state.world.size):
            try:
                state.store.wait([f"{key}/{rank}"], timedelta(seconds=30))
                everyone[rank] = json.loads(state.store.get(f"{key}/{rank}"))
            except RuntimeError:
                print(f"[polytrain.horovod] timeline: rank {rank} sent no events", file=sys.stderr)
        write_chrome_trace(path, everyone, metadata={"source": "polytrain.horovod.torch",
                                                     "world_size": state.world.size})
    except RuntimeError as exc:  # the store went away with rank 0
        print(f"[polytrain.horovod] timeline not written: {str(exc).splitlines()[0]}", file=sys.stderr)


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "is_homogeneous", "start_timeline", "stop_timeline", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
]
