"""Every kind of failing op, each followed by proof that the ranks are still in step.

Run by every rank of a 2-rank job (torchrun: gloo; mpirun: MPI carries the data). For each
error kind the worker records which exception this rank got (``errors``), then checks
(``checks``) that the next collective, a process-set add/use/remove and a
DistributedOptimizer step still work. A rank that fell a collective behind would get wrong
numbers or a mismatch there, not a pass. It also exercises the ops Horovod's own suite
showed missing (reducescatter, alltoall dtypes, join with other ops, sparse allreduce).
"""

import warnings

import torch
from reporting import report

import polytrain.horovod.torch as hvd

hvd.init()
r, n = hvd.rank(), hvd.size()
checks, errors = {}, {}
steps = [0]


def check(name, ok, detail=None):
    checks[name] = True if ok else detail


def still_in_step(after):
    """The next collective, a process set's lifecycle and an optimizer step, after ``after``."""
    total = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum, name=f"after {after}")
    check(f"allreduce after {after}", float(total) == n * (n + 1) / 2, total.tolist())
    ps = hvd.add_process_set([0])
    if r == 0:
        check(f"process set after {after}", float(hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps)) == 1)
    check(f"process set removed after {after}", hvd.remove_process_set(ps))
    torch.manual_seed(steps[0])
    steps[0] += 1
    model = torch.nn.Linear(3, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.full((2, 3), float(r + 1))).sum().backward()
    opt.step()
    weights = hvd.allgather(model.weight.detach().reshape(1, -1))
    check(f"optimizer step after {after}", bool((weights[0] == weights[-1]).all()), weights.tolist())


def expect_error(kind, fn, then_check=True):
    try:
        fn()
        errors[kind] = "no error"
    except Exception as exc:  # noqa: BLE001 - the type is what the test compares
        errors[kind] = type(exc).__name__
    if then_check:
        still_in_step(kind)


def bad_splits():
    hvd.alltoall(torch.arange(4.0), splits=[1, 2, 3][: n + 1])


def duplicate_name():
    handle = hvd.allreduce_async(torch.ones(2), name="twice")
    try:
        hvd.allreduce_async(torch.ones(2), name="twice")
    finally:
        hvd.synchronize(handle)


def async_mismatch_then_next():
    bad = hvd.allreduce_async(torch.ones(2 + r), name="uneven")
    good = hvd.allreduce_async(torch.ones(2), name="even", op=hvd.Sum)
    check("op after a refused async op", hvd.synchronize(good).tolist() == [float(n)] * 2)
    hvd.synchronize(bad)


def different_models():
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(1 + r)])
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())


# local errors: raised before anything is exchanged
expect_error("unknown op", lambda: hvd.allreduce(torch.ones(1), op=99))
expect_error("adasum", lambda: hvd.allreduce(torch.ones(1), op=hvd.Adasum))
expect_error("reducescatter adasum", lambda: hvd.reducescatter(torch.ones(2 * n), op=hvd.Adasum))
expect_error("non-contiguous in place", lambda: hvd.allreduce_(torch.ones(4, 4).t()))
expect_error("alltoall splits", bad_splits)
expect_error("duplicate name", duplicate_name)
expect_error("root outside the set", lambda: hvd.broadcast(torch.ones(1), root_rank=n + 5))
# cross-rank errors: found in the metadata records every rank sees
expect_error("shape mismatch", lambda: hvd.allreduce(torch.ones(3 + r), name="shape"))
expect_error("dtype mismatch", lambda: hvd.broadcast(torch.ones(3, dtype=torch.float64 if r else torch.float32), 0))
expect_error("root mismatch", lambda: hvd.broadcast(torch.ones(3), root_rank=r))
expect_error("different ops", lambda: hvd.allreduce(torch.ones(2)) if r == 0 else hvd.allgather(torch.ones(2)))
expect_error("grouped mismatch", lambda: hvd.grouped_allreduce([torch.ones(2)] * (1 + r)))
expect_error("allgather trailing dims", lambda: hvd.allgather(torch.ones(2, 2 + r)))
expect_error("reducescatter mismatch", lambda: hvd.reducescatter(torch.ones(2 * n + 2 * r)))
expect_error("async mismatch", async_mismatch_then_next)
expect_error("duplicate process set", lambda: hvd.add_process_set(list(range(n))))
expect_error("different models", different_models)
if r == 0:  # rank 1 has joined: allgather is refused on rank 0, rank 1 keeps waiting in join
    expect_error("join then allgather", lambda: hvd.allgather(torch.ones(2)), then_check=False)
    expect_error("join then broadcast", lambda: hvd.broadcast(torch.ones(2), root_rank=0), then_check=False)
    summed_with_joined = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    check("allreduce while joined", summed_with_joined.tolist() == [1.0, 1.0], summed_with_joined.tolist())
else:
    errors["join then allgather"] = errors["join then broadcast"] = "joined"
joined_last = hvd.join()
still_in_step("join")
check("join returns the last rank", joined_last == 0, joined_last)

# Horovod matches async ops by name: a rank may submit one its peers submit only after a barrier
early = hvd.allreduce_async(torch.full((2,), float(r + 1)), name="across a barrier", op=hvd.Sum) if r == 0 else None
hvd.barrier()
if r != 0:
    early = hvd.allreduce_async(torch.full((2,), float(r + 1)), name="across a barrier", op=hvd.Sum)
hvd.barrier()
got = hvd.synchronize(early)
check("async op submitted across a barrier", got.tolist() == [n * (n + 1) / 2] * 2, got.tolist())

# ops Horovod's suite exercises
x = torch.arange(2.0 * n * 3).reshape(2 * n, 3) * (r + 1)
mine = torch.arange(2.0 * n * 3).reshape(2 * n, 3)[2 * r:2 * r + 2]
check("reducescatter sum", hvd.reducescatter(x, op=hvd.Sum).tolist() == (mine * n * (n + 1) / 2).tolist())
check("reducescatter average", torch.allclose(hvd.reducescatter(x), mine * (n + 1) / 2))
scaled = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
check("reducescatter scaled", torch.allclose(scaled, mine * n * (n + 1) / 2))
leaf = torch.ones(2 * n, 2, requires_grad=True)
hvd.reducescatter(leaf, op=hvd.Sum).sum().backward()
check("reducescatter gradient", leaf.grad.tolist() == [[float(n)] * 2] * (2 * n), leaf.grad.tolist())
leaves = [torch.ones(2 * n, requires_grad=True) for _ in range(2)]
for out in hvd.grouped_reducescatter(leaves, op=hvd.Sum):
    out.sum().backward()
check("grouped reducescatter gradient", all(t.grad.tolist() == [float(n)] * (2 * n) for t in leaves))
for dtype in (torch.int16, torch.int8, torch.uint8, torch.float16, torch.bool):
    sent = torch.full((n, 2), r + 1).to(dtype)
    got = hvd.alltoall(sent)
    expected = torch.arange(1, n + 1).repeat_interleave(2).reshape(n, 2).to(dtype)
    check(f"alltoall {dtype}", got.dtype == dtype and got.tolist() == expected.tolist(), got.tolist())
check("int16 allreduce", hvd.allreduce(torch.full((3,), r + 1, dtype=torch.int16), op=hvd.Sum).tolist()
      == [n * (n + 1) // 2] * 3)
dense = torch.zeros(5, 2)
dense[r] = 1.0
summed = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse", op=hvd.Sum)()
check("sparse allreduce", summed.to_dense().tolist() == hvd.allreduce(dense, op=hvd.Sum).tolist())
first = hvd.add_process_set([0])
if r == 0:
    check("broadcast_object on a set", hvd.broadcast_object({"a": 1}, root_rank=0, process_set=first) == {"a": 1})
hvd.remove_process_set(first)

# DistributedOptimizer without named_parameters, with sparse gradients, and the synchronize warning
for sparse_as_dense in (False, True):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(6, 2, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0), sparse_as_dense=sparse_as_dense)
    before = emb.weight.detach().clone()
    emb(torch.tensor([r, 5])).sum().backward()
    opt.step()
    delta = before - emb.weight.detach()
    expected = torch.zeros(6, 2)
    expected[:n] += 1.0 / n
    expected[5] += 1.0
    check(f"sparse embedding (sparse_as_dense={sparse_as_dense})", torch.allclose(delta, expected), delta.tolist())
model = torch.nn.Linear(2, 1)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
model(torch.ones(1, 2) * r).sum().backward()
opt.synchronize()
check("unnamed parameters averaged", model.weight.grad.tolist() == [[(n - 1) / 2] * 2], model.weight.grad.tolist())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.step()
check("synchronize then step warns", any("skip_synchronize" in str(w.message) for w in caught))
report({"rank": r, "checks": checks, "errors": errors})
