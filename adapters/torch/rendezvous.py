"""Where the ranks of a PyTorch job meet: the rendezvous store (scoped to this restart of the job), what the
start-up line says about where it listens, and one-line errors when the ranks do not meet."""

from __future__ import annotations

import datetime
import os
import re
import types
from pathlib import Path

import torch.distributed as dist

from polytrain.comm.net import ancestor_listening_on, listening_socket, listening_sockets, store_bind
from polytrain.environments import restart_count
from polytrain.world import World


def rendezvous_store(world: World, timeout: datetime.timedelta) -> dist.Store:
    """The TCPStore the process group meets in, with keys scoped to this (re)start of the job.

    Under torchrun the elastic agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``) and keeps it
    across worker restarts; without a per-restart prefix, restarted workers would read the dead
    workers' addresses. Elsewhere rank 0 hosts it at the World's master address and port, listening only
    on the address the master names here (`polytrain.comm.net.store_bind`; TCPStore alone would listen on every
    interface).
    """
    global _groups
    _groups += 1
    hosting = world.rank == 0 and not uses_agent_store()
    listen_fd = None
    bind = store_bind(str(world.master_addr), world.local_size == world.size).address if hosting else None
    if bind is not None:
        listen_fd = listening_socket(bind, int(world.master_port), max(128, world.size)).fileno()
    store = dist.TCPStore(str(world.master_addr), int(world.master_port), world.size, is_master=hosting,
                          timeout=timeout, master_listen_fd=listen_fd)
    return dist.PrefixStore(store_prefix(), store)


def uses_agent_store() -> bool:
    """Under torchrun the elastic agent hosts the rendezvous store, not rank 0."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def listen_address(world: World) -> str:
    """Where this job's rendezvous listens (for the start-up log). Under torchrun, what its agent (the ancestor
    listening on MASTER_PORT) really listens on, read from /proc: its c10d rendezvous (``--rdzv_endpoint``) and
    the agent store, each bound by torchrun to every interface; where /proc cannot tell, the agent store alone."""
    if uses_agent_store():
        agent = ancestor_listening_on(int(world.master_port))
        if agent is None:
            return (f"{world.master_addr}:{world.master_port}, torchrun's agent store (torchrun binds it to every "
                    f"interface; polytrain does not control it)")
        return _torchrun_listeners(agent, int(world.master_port))
    bind = store_bind(str(world.master_addr), world.local_size == world.size)
    where = f"{bind.address}:{world.master_port}" if bind.address else f"all interfaces, port {world.master_port}"
    return f"{where} ({bind.why})"


def _torchrun_listeners(agent: int, master_port: int) -> str:
    """Every socket torchrun's agent process ``agent`` listens on, each with what it is."""
    sockets = listening_sockets(agent)
    rendezvous, flag = _rendezvous_port(agent, [port for _, port in sockets if port != master_port])

    def role(port: int) -> str:
        if port == master_port:
            return "torchrun's agent store, MASTER_PORT"
        return f"torchrun's c10d rendezvous, {flag}" if port == rendezvous else "torchrun's own"

    ordered = sorted(sockets, key=lambda item: (item[1] != rendezvous, item[1] != master_port, item[1]))
    parts = [f"{f'{host}:{port}' if host else f'all interfaces, port {port}'} ({role(port)})" for host, port in ordered]
    listed = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    them = "it" if len(parts) == 1 else "them"
    return f"{listed}; torchrun binds {them}, polytrain does not control {them}"


def _rendezvous_port(agent: int, others: list[int]) -> tuple[int | None, str]:
    """The port of torchrun's ``--rdzv_endpoint`` (its command line's; 29400 when it names none), or with
    ``--standalone`` (a port torchrun picks) the one other port its agent listens on; and that flag."""
    try:
        args = Path(f"/proc/{agent}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None, ""
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in ("--rdzv_endpoint", "--rdzv-endpoint"):
            value = value if equals else (args[i + 1] if i + 1 < len(args) else "")
            host, colon, port = value.rpartition(":")
            return (int(port) if colon and port.isdigit() else 29400), "--rdzv_endpoint"
        if arg == "--":
            break
    return (others[0] if "--standalone" in args and len(others) == 1 else None), "--standalone"


def rendezvous_error(exc: BaseException, world: World, timeout_s: float) -> Exception:
    """One line saying why the ranks did not meet at the master, and what to check."""
    from polytrain.errors import RendezvousError

    where = f"{world.master_addr}:{world.master_port}"
    text = str(exc)
    if "address already in use" in text.lower() or "EADDRINUSE" in text:
        return RendezvousError(
            f"rendezvous: rank {world.rank} cannot listen on MASTER_PORT {world.master_port} at {world.master_addr}: "
            "the port is in use by another process; choose another MASTER_PORT (polytrain launch picks a free one)")
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        return RendezvousError(
            f"rendezvous: only {joined.group(1)} of {joined.group(2)} ranks reached the master {where} within "
            f"{timeout_s:g} s (reliability.startup_timeout_s); check that every rank was started and that they agree "
            f"on the world size (-np / WORLD_SIZE={world.size})")
    if "timed out" in text.lower() or "connect" in text.lower():
        return RendezvousError(
            f"rendezvous: rank {world.rank} cannot reach the master at {where} within {timeout_s:g} s "
            "(reliability.startup_timeout_s); check MASTER_ADDR/MASTER_PORT, that rank 0 is running, and that "
            "the port is open between the hosts")
    return RendezvousError(f"rendezvous at {where} failed: {text.strip().splitlines()[0][:200]}")


def import_before_group() -> None:
    """Import ``torch.distributed.nn`` while no process group exists.

    Its functions take ``group=group.WORLD`` as a default argument, evaluated once, when the module is first
    imported. DDP's constructor imports it (through ``torch.distributed._shard``): imported while our group
    exists, those defaults hold that group for the life of the interpreter, `dist.destroy_process_group` only
    forgets it, and its gloo threads and TCPStore server run on into interpreter finalisation — where a gloo
    thread releasing a tensor aborts the process (SIGABRT after a finished run). Imported first, they hold None.
    (`let_go_of` cannot reach such a default: it sits in a tuple. FSDP's gradient scaler is another: the fsdp
    backend imports it first.)
    """
    import torch.distributed.nn  # noqa: F401


def store_prefix() -> str:
    """Keys of this (re)start of the job and of the process group its ranks are forming now:
    ``polytrain/restart_<n>`` for a process's first, ``.../group_<k>`` for its k-th. Every rank starts its groups
    in the same order, so the k-th group of every rank meets under the same keys, and none reads the addresses of
    a group that ended (a script that calls `polytrain.fit` twice, or starts `Distributed` after another ended,
    under torchrun, whose agent keeps one store for the whole job)."""
    base = f"polytrain/restart_{restart_count()}"
    return base if _groups <= 1 else f"{base}/group_{_groups}"


_groups = 0  # the rendezvous stores this process has made (`rendezvous_store`), one per process group


def live_groups() -> list[dist.ProcessGroup]:
    """Every process group of this process (the default one first), to hand to `let_go_of` once destroyed."""
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def let_go_of(groups: list[dist.ProcessGroup]) -> None:
    """After ``groups`` were destroyed: every object that still holds one in an attribute or a list drops it, so
    each group ends now — its gloo worker threads joined while the interpreter is alive — and not when the
    script's last reference to a model goes, which for FSDP2's reference cycles is often interpreter shutdown,
    where a worker freeing a tensor aborts the process (SIGABRT after a finished run). The holders are what a
    script keeps after `end()`: FSDP2's mesh infos, a DeepSpeed engine and its optimizer and parameters, a
    sharded gradient scaler. Module globals are left as they are, and so are tuples (see `import_before_group`);
    a reference held in C++ (DDP's reducer) is the backend's to drop. ``groups`` is emptied.
    """
    if not groups:
        return
    import gc

    ended = {id(group) for group in groups}
    for holder in gc.get_referrers(*groups):
        if holder is groups or isinstance(holder, (type, types.ModuleType, types.FrameType)):
            continue
        # an instance's attributes: its __dict__, or (Python 3.11+, a dict never asked for) the instance itself
        attributes = holder if isinstance(holder, dict) else getattr(holder, "__dict__", None)
        if isinstance(attributes, dict) and "__builtins__" not in attributes:
            for key, value in list(attributes.items()):
                if id(value) in ended:
                    attributes[key] = None
        elif isinstance(holder, list):
            for index, value in enumerate(holder):
                if id(value) in ended:
                    holder[index] = None
    groups.clear()
