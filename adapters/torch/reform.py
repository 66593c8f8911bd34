"""Re-forming torch.distributed's default gloo group in the same process, for an elastic worker.

The driver's store (`polytrain.comm.membership`) publishes membership versions; version N's process group
lives on it under ``polytrain/elastic/pg/N``. A worker re-forms in place (docs/DESIGN.md, "The elastic
driver"; measured facts in the research notes on re-forming gloo):

1. `prepare` once, before any group: imports that would otherwise pin the first group for ever
   (``torch.distributed.nn``'s defaults hold ``group.WORLD``), ``gc.freeze`` so later collections are short,
   and an exit hook that destroys a group still formed (else gloo's threads abort the exit: code 134).
2. `init` (membership, assignment): the default group of that version, rank and size.
3. On a failed collective (`is_peer_loss`): drop every holder of the group (DDP/FSDP wrappers, engines,
   optimizer wrappers, Work handles, the exception and its traceback), then `release`: destroy the group,
   clear the DTensor caches that keep a DeviceMesh (and its group) alive, ``gc.collect``. Only when the last
   reference goes does gloo close its sockets, which is what frees peers still blocked on this rank.
4. ``membership.leave(N)``, ``membership.next(N)``, `init` again.

Only gloo (CPU) groups are formed here; on CUDA the NCCL path belongs to the caller (``hvd.elastic``).
"""

from __future__ import annotations

import atexit
import gc
import os
from datetime import timedelta
from typing import Any

from polytrain.comm.membership import PREFIX, Assignment, Membership, group_prefix

#: gloo's and c10d's texts for a peer that died or stopped answering (see `is_peer_loss`).
PEER_LOSS_TEXTS = (
    "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Broken pipe",
    "Socket Timeout", "wait timeout after", "Connection refused", "ECONNRESET", "Read error",
)
DEFAULT_GROUP_TIMEOUT_S = 30.0
_prepared = False


def group_timeout_s(env: Any = None) -> float:
    """The process group's timeout: ``HOROVOD_GLOO_TIMEOUT_SECONDS`` when set, else 30 s. It bounds how long a
    survivor can sit in a collective whose peer stopped answering without closing its sockets."""
    env = os.environ if env is None else env
    raw = env.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "").strip()
    try:
        return float(raw) if raw else DEFAULT_GROUP_TIMEOUT_S
    except ValueError:
        return DEFAULT_GROUP_TIMEOUT_S


def prepare() -> None:
    """The imports that must precede the first group, and ``gc.freeze`` of what exists so far (idempotent)."""
    global _prepared
    if _prepared:
        return
    import torch.distributed.nn  # noqa: F401  (its functions' group=WORLD defaults would pin the first group)

    gc.collect()
    gc.freeze()
    atexit.register(_release_at_exit)
    _prepared = True


def _release_at_exit() -> None:
    """Destroy a group still formed at exit while the interpreter is whole: a worker that returns an exit code
    with its group alive otherwise leaves gloo's threads running into finalisation, and the process aborts
    ("terminate called without an active exception", exit code 134) instead of exiting with its code."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def init(membership: Membership, assignment: Assignment, timeout_s: float | None = None) -> None:
    """Form the default gloo group of ``assignment.version`` on the driver's store, as its rank and size."""
    import torch.distributed as dist

    prepare()
    if dist.is_initialized():
        release()
    store = dist.PrefixStore(f"{PREFIX}/{group_prefix(assignment.version)}", membership.store)
    seconds = group_timeout_s() if timeout_s is None else timeout_s
    dist.init_process_group("gloo", store=store, rank=assignment.rank, world_size=assignment.size,
                            timeout=timedelta(seconds=seconds))


def clear_dtensor_caches() -> None:
    """Drop the DTensor caches that keep an old DeviceMesh, hence its process group, alive (FSDP2)."""
    import torch

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    try:
        from torch.distributed.tensor import DTensor, _collective_utils, _redistribute
    except ImportError:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cached = getattr(propagator, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    for owner, name in ((_redistribute, "_gen_transform_infos"),
                        (getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh")):
        cached = getattr(owner, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    planner = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if planner is not None:
        planner()


def release() -> None:
    """Let go of the default group completely: destroy it, clear DTensor caches, collect garbage. The caller
    must have dropped its own holders first (wrappers, engines, Work handles, the exception)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if "torch.distributed.tensor" in __import__("sys").modules:
        clear_dtensor_caches()
    gc.collect()


def next_round(membership: Membership, version: int, final: bool = False) -> Assignment | None:
    """Steps 3-4 after the holders are dropped: release the group, leave round ``version``, wait for the driver's
    next; this worker's assignment there, None when it is left out (``final``: `Membership.next`'s). Raises
    `JobEnded` when the driver ended the job instead (each caller says it in its own way)."""
    release()
    membership.leave(version)
    return membership.next(version, final=final)


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` (from a collective or a group's init) means a peer died or stopped answering, so the
    group must be re-formed: gloo's RuntimeError texts, c10d's DistError family (store waits included)."""
    try:
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover - older torch
        DistError = ()  # type: ignore[assignment]  # noqa: N806
    if DistError and isinstance(exc, DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(part in text for part in PEER_LOSS_TEXTS)
