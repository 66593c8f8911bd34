"""The side channel the ranks of a job share beside their collectives: where each posts its progress and heartbeat
(for the stall watchdog, `polytrain.observe.watchdog`) and how far it is in the `polytrain.comm.settle.settled` exchanges (for
the ranks that wait for one still at its own part).

`StoreBoard` keeps it in a torch.distributed Store: the one the torch process group met in (`progress_board` of the
torch backends), or one rank 0 hosts for backends without one (`hosted_store_board`: MPI, TensorFlow's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

#: What a rank posts as its arrival when it leaves the job (its watchdog closes): no one waits for it any more.
LEFT = 2**62


class PeerBoard(Protocol):
    """Where the ranks post their progress: any key-value store reachable from a thread.

    ``arrive``/``arrivals``: how many `polytrain.comm.settle.settled` exchanges each rank has done its own part of
    (`LEFT` once it has left the job)."""

    def publish(self, rank: int, seq: int, text: str, beat: int = 0) -> None: ...

    def read(self, ranks: Iterable[int]) -> dict[int, tuple[int, str]]: ...

    def beats(self, ranks: Iterable[int]) -> dict[int, int]: ...

    def arrive(self, rank: int, count: int) -> None: ...

    def arrivals(self, ranks: Iterable[int]) -> dict[int, int]: ...


class StoreBoard:
    """A `PeerBoard` on a torch.distributed Store (keys ``progress/<rank>`` and ``settled/<rank>``)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def publish(self, rank: int, seq: int, text: str, beat: int = 0) -> None:
        self.store.set(f"progress/{rank}", f"{seq}|{beat}|{text}")

    def _entries(self, ranks: Iterable[int]) -> dict[int, tuple[int, int, str]]:
        out = {}
        for rank in ranks:
            if not self.store.check([f"progress/{rank}"]):
                continue
            seq, beat, text = self.store.get(f"progress/{rank}").decode().split("|", 2)
            out[rank] = (int(seq), int(beat), text)
        return out

    def read(self, ranks: Iterable[int]) -> dict[int, tuple[int, str]]:
        return {rank: (seq, text) for rank, (seq, _, text) in self._entries(ranks).items()}

    def beats(self, ranks: Iterable[int]) -> dict[int, int]:
        return {rank: beat for rank, (_, beat, _) in self._entries(ranks).items()}

    def arrive(self, rank: int, count: int) -> None:
        self.store.set(f"settled/{rank}", str(count))

    def arrivals(self, ranks: Iterable[int]) -> dict[int, int]:
        return {rank: int(self.store.get(f"settled/{rank}").decode()) for rank in ranks
                if self.store.check([f"settled/{rank}"])}


def hosted_store_board(world: Any, broadcast_object: Callable[[Any], Any]) -> StoreBoard | None:
    """A `StoreBoard` for backends without a store of their own (MPI, TensorFlow's): rank 0 hosts a
    TCPStore on a free port — on loopback when every rank is on this host, else on the address the other
    hosts reach (`polytrain.comm.net.board_address`), never every interface — and sends its address with the
    backend's own ``broadcast_object``. Collective: every rank calls it. None without torch
    (the stall warning then names no ranks).

    The ranks post their progress there from the watchdog's thread, so a rank waiting inside a
    collective that cannot say who is missing still learns which ranks are behind.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    import datetime

    from polytrain.comm.net import board_address, listening_socket

    timeout = datetime.timedelta(seconds=3)
    endpoint, listener = None, None
    if world.rank == 0:
        try:
            host = "127.0.0.1" if world.local_size == world.size else board_address(world.master_addr)
            if host is not None:
                listener = listening_socket(host, 0, max(128, world.size))
                endpoint = (host, listener.getsockname()[1])
        except OSError:  # no address to offer: every rank goes on without a board
            endpoint, listener = None, None
    endpoint = broadcast_object(endpoint)
    if endpoint is None:
        return None
    if listener is not None:
        store = dist.TCPStore(endpoint[0], endpoint[1], world.size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    else:
        store = dist.TCPStore(endpoint[0], endpoint[1], is_master=False, timeout=timeout, wait_for_workers=False)
    return StoreBoard(dist.PrefixStore("polytrain/watchdog", store))
