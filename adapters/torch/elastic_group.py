"""A torch backend's process group under polytrain's elastic driver: formed on the driver's store for this
worker's membership version, and re-formed in the same process when a peer is lost (issue 51).

`form` replaces the usual rendezvous in `TorchBackend.setup` for an elastic worker (its World's master is the
driver's store, which no rank may bind). `regroup` is a worker's reset: the wrapper over the old group is dropped
(the backend's own teardown), the group released, the driver told, the next round awaited and its
group formed; the backend's World and data shard become the new round's. The driver alone decides who is in a
round (`polytrain.comm.membership`); the group itself is `polytrain.adapters.torch.reform`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from polytrain.comm.membership import Assignment, JobEnded, Membership
from polytrain.errors import TrainingFailure
from polytrain.protocols import DataShard


def world_of(assignment: Assignment, world: Any) -> Any:
    """``world`` (a `polytrain.world.World`) at ``assignment``'s rank and size."""
    return dataclasses.replace(world, rank=assignment.rank, size=assignment.size, local_rank=assignment.local_rank,
                               local_size=assignment.local_size, node_rank=assignment.cross_rank,
                               num_nodes=assignment.cross_size)


def _adopt(backend: Any, membership: Membership, assignment: Assignment) -> None:
    from polytrain.adapters.torch import reform

    reform.init(membership, assignment, timeout_s=backend.spec.reliability.collective_timeout_s)
    backend.membership, backend.assignment = membership, assignment
    backend._owns_group = True
    backend.world = world_of(assignment, backend.world)
    backend.data_shard = DataShard(assignment.size, assignment.rank)


def form(backend: Any) -> bool:
    """Form the default gloo group of this worker's spawn version on the driver's store; False when this process
    is no elastic worker (the backend meets its peers as usual)."""
    membership = Membership.from_env()
    if membership is None:
        return False
    assignment = membership.assignment(membership.version)
    if assignment is None:
        raise TrainingFailure(f"slot {membership.slot} is not in membership version {membership.version} of the "
                              "elastic driver")
    _adopt(backend, membership, assignment)
    return True


def reform(backend: Any, final: bool = False) -> Assignment:
    """Leave this round and join the next one: release the group (every holder already dropped), tell the driver,
    wait for its next membership version, form that group (a round whose group cannot form because a peer of it
    died is left in turn, for the one after). A worker the driver left out exits 0 (SystemExit);
    a job the driver ended raises its line (exit 0 when it ended well). ``final``: a final round is formed too
    (the caller writes its commit there, `Assignment.final`), else it is the job's end."""
    from polytrain.adapters.torch import reform as groups

    membership, version = backend.membership, backend.assignment.version
    backend._owns_group = False
    while True:
        try:
            assignment = groups.next_round(membership, version, final=final)
        except JobEnded as ended:
            if ended.ok:
                raise SystemExit(0) from None
            raise TrainingFailure(f"the elastic driver ended the job: {ended.line}") from None
        if assignment is None:  # removed from the job: its exit is no failure
            raise SystemExit(0)
        try:
            _adopt(backend, membership, assignment)
            return assignment
        except Exception as exc:  # a peer of the new round died before its group formed: leave it for the next
            if not groups.is_peer_loss(exc):
                raise
            version = assignment.version


def regroup(framework: Any, backend: Any, final: bool = False) -> Assignment:
    """A torch framework's reset after a lost peer: its wrapper over the old group dropped, the group re-formed
    at the driver's next membership version (`reform`), the same module and optimizer wrapped again over it —
    or, where the backend bound the module to the old group (``binds_module_to_group``: fsdp), a fresh one of the
    same classes and a fresh optimizer (``framework.fresh_module``). The caller loads its commit afterwards (the
    wrap's own broadcast of rank 0's weights, or a fresh module's uninitialised ones, are then replaced)."""
    kept = None
    if not backend.binds_module_to_group:
        kept = backend.unwrap(framework.model), backend.unwrap_optimizer(framework.optimizer)
        kept[1].zero_grad(set_to_none=True)  # a failed step's partial gradients
    framework.model = framework.optimizer = None
    backend.teardown()  # the wrapper lets go of the group (DDP's reducer holds it), and the group is destroyed
    assignment = reform(backend, final)
    module, optimizer = kept if kept is not None else framework.fresh_module()
    framework.model, framework.optimizer = backend.wrap(module, optimizer)
    if backend.spec.compile.enabled:
        backend.compile_model(framework.model, backend.spec.compile.mode)
    framework.world = backend.world
    return assignment
