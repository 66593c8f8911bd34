"""The shim's process group under polytrain's elastic driver (`polytrain.launchers.elastic`): formed in place.

A worker the driver started (`polytrain.comm.membership`) meets its peers on the driver's store, not through a
rendezvous of its own: ``hvd.init`` forms the default gloo group of the worker's current membership version
(`form`), and ``hvd.elastic.run`` moves the same process to the next version when a peer is lost or the
driver's hosts changed (`next_round`): the group released (`polytrain.adapters.torch.reform`), the driver
told, its next version awaited, and ``hvd.init`` forms that one. A worker the driver leaves out exits 0; a job
the driver ended exits with the driver's line and code. Rank 0 reads the driver's host updates
(`hosts_change`); the ranks agree on them at a commit, in the all-reduce the commit makes.

Only gloo (CPU) groups are formed here: on CUDA tensors the shim's NCCL group is not re-formed in place
(`check_supported` says so in one line).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from polytrain.comm.membership import ADDED, Assignment, JobEnded, Membership

#: every DistributedOptimizer of the process: a re-form sets each up again (`hvd.elastic.run`'s restart)
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_membership: Membership | None = None
_assignment: Assignment | None = None
_hosts_seen = 0.0
_checked_env = False


def membership() -> Membership | None:
    """This process's client of the driver's store (made once); None when no elastic driver started it."""
    global _membership, _checked_env
    if not _checked_env:
        _membership, _checked_env = Membership.from_env(), True
    return _membership


def check_supported(cuda: bool) -> None:
    if cuda:
        raise RuntimeError("hvd.init under polytrain's elastic driver: the shim re-forms gloo (CPU) groups in "
                           "place; a CUDA job runs elastic on real Horovod (POLYTRAIN_HOROVOD_IMPL=horovod)")


def form() -> Any:
    """Form the default gloo group of this worker's current membership version (an elastic worker's: see
    `membership`); a store for the shim's own keys (process sets, stall records)."""
    global _assignment, _hosts_seen
    from polytrain.adapters.torch import reform

    member = membership()
    assert member is not None
    if _assignment is None:
        _assignment = member.assignment(member.version)
        if _assignment is None:
            raise RuntimeError(f"slot {member.slot} is not in membership version {member.version} of the elastic "
                               "driver")
    reform.init(member, _assignment)
    _hosts_seen = (member.hosts_update() or (0.0, 0))[0]
    from torch.distributed import PrefixStore

    return PrefixStore(f"polytrain-hvd/elastic/{_assignment.version}", member.store)


def active() -> bool:
    return _assignment is not None


def adopt(assignment: Assignment) -> None:
    """The group of ``assignment`` was formed by someone else (a Trainer's horovod backend under the driver):
    ``hvd.init`` joins it as that assignment's rank, size and local ranks (the environment is the spawn-time one)."""
    global _assignment
    _assignment = assignment


def world(base: Any) -> Any:
    """``base`` (the launcher's World) at the current assignment's ranks and size."""
    from polytrain.adapters.torch.elastic_group import world_of

    return world_of(_assignment, base) if _assignment is not None else base


def hosts_change() -> int:
    """What the driver's hosts did since this version's group was formed (ask on rank 0 only): 0 nothing,
    1 hosts removed only, 2 hosts added (maybe removed too)."""
    member = membership()
    if member is None or _assignment is None:
        return 0
    update = member.hosts_update()
    if update is None or update[0] <= _hosts_seen:
        return 0
    return 2 if update[1] & ADDED else 1


def next_round() -> None:
    """Leave this version (the shim shut down, every holder of the group dropped), release the group, and wait
    for the driver's next version: ``hvd.init`` forms it. Left out of it: exit 0. The job ended: its line."""
    global _assignment
    from polytrain.adapters.torch import reform

    member, old = membership(), _assignment
    assert member is not None and old is not None
    try:
        following = reform.next_round(member, old.version)
    except JobEnded as ended:
        if not ended.ok:
            print(f"polytrain: the elastic driver ended the job: {ended.line}", file=sys.stderr, flush=True)
        raise SystemExit(ended.code) from None
    if following is None:  # removed from the job (its host blacklisted or not listed): no failure
        raise SystemExit(0)
    _assignment = following


def release(optimizer: Any) -> None:
    """``optimizer`` (a DistributedOptimizer) reduces no more: its hooks removed, out of `LIVE` (a Trainer's
    elastic re-form wraps the inner optimizer anew)."""
    for hook in optimizer._hooks:
        hook.remove()
    optimizer._hooks.clear()
    optimizer._reset_step()
    LIVE.discard(optimizer)
