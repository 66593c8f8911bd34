"""Every Horovod collective against its documented result, written against the Horovod API only.

Run by every rank (torchrun, mpirun, horovodrun); writes one JSON report per rank (see report):
``checks`` maps a check name to ``[got, expected]`` (the test compares them) and ``values``
holds raw numbers for comparing implementations. POLYTRAIN_HOROVOD_IMPL picks the shim or
real Horovod.
"""

import os
import sys

import torch
from reporting import report

import polytrain.horovod.torch as hvd

checks = {}
values = {}


def check(name, got, expected, tol=1e-6):
    got = got.tolist() if torch.is_tensor(got) else got
    expected = expected.tolist() if torch.is_tensor(expected) else expected
    values[name] = got
    ok = _close(got, expected, tol)
    checks[name] = [got, expected] if not ok else True


def _close(a, b, tol):
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= tol * max(1.0, abs(b))
    return a == b


try:
    hvd.rank()
    checks["rank before init raises"] = ["no error", "ValueError"]
except ValueError as exc:
    check("rank before init raises", str(exc), "Horovod has not been initialized; use hvd.init().")

hvd.init()
r, n = hvd.rank(), hvd.size()
check("topology", [hvd.size(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()],
      [n, n, 0, 1, True])
check("local rank", hvd.local_rank(), r)
check("reduce op values", [hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product], [0, 1, 2, 3, 4, 5])
values["mpi_enabled"] = hvd.mpi_enabled()
values["built"] = [hvd.mpi_built(), hvd.gloo_built(), hvd.nccl_built(), hvd.cuda_built(), hvd.rocm_built()]
ranks = torch.arange(n, dtype=torch.float64) + 1
x = torch.tensor([r + 1.0, 2.0 * (r + 1)])

# allreduce and its variants
check("allreduce average", hvd.allreduce(x, name="x.avg"), torch.tensor([ranks.mean(), 2 * ranks.mean()]))
check("allreduce sum", hvd.allreduce(x, op=hvd.Sum), torch.tensor([ranks.sum(), 2 * ranks.sum()]))
check("allreduce min", hvd.allreduce(x, op=hvd.Min), [1.0, 2.0])
check("allreduce max", hvd.allreduce(x, op=hvd.Max), [float(n), 2.0 * n])
check("allreduce product", hvd.allreduce(x, op=hvd.Product), [float(ranks.prod()), float(ranks.prod() * 2 ** n)])
check("allreduce int sum", hvd.allreduce(torch.tensor([r + 1, 7]), op=hvd.Sum), [int(ranks.sum()), 7 * n])
check("input unchanged", x, [r + 1.0, 2.0 * (r + 1)])
check("prescale postscale sum", hvd.allreduce(x, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5),
      [1.5 * float(ranks.sum()), 3.0 * float(ranks.sum())])
check("prescale average", hvd.allreduce(x, prescale_factor=2.0), [2 * float(ranks.mean()), 4 * float(ranks.mean())])
check("deprecated average=False", hvd.allreduce(x, average=False), [float(ranks.sum()), 2 * float(ranks.sum())])
y = x.clone()
out = hvd.allreduce_(y, op=hvd.Sum)
check("allreduce_ in place", [out is y, y.tolist()], [True, [float(ranks.sum()), 2 * float(ranks.sum())]])
fp16 = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
check("fp16 compression", [str(fp16.dtype), fp16.tolist()], ["torch.float32", [float(ranks.sum()), 2 * float(ranks.sum())]])
try:
    hvd.allreduce(x, op=hvd.Sum, average=True)
    checks["op and average raises"] = ["no error", "ValueError"]
except ValueError:
    check("op and average raises", True, True)

# async handles
h1 = hvd.allreduce_async(x, name="async.a", op=hvd.Sum)
h2 = hvd.allreduce_async_(x.clone(), name="async.b")
while not hvd.poll(h1):
    pass
check("async handle is int", isinstance(h1, int), True)
check("async sum", hvd.synchronize(h1), [float(ranks.sum()), 2 * float(ranks.sum())])
check("async in place average", hvd.synchronize(h2), [float(ranks.mean()), 2 * float(ranks.mean())])
check("synchronize twice is None", hvd.synchronize(h1) is None, True)

# grouped allreduce (mixed shapes and dtypes)
group = [torch.full((2, 3), r + 1.0), torch.tensor([float(r)]), torch.tensor([r, 1])]
summed = hvd.grouped_allreduce(group, op=hvd.Sum)
check("grouped allreduce", [t.tolist() for t in summed],
      [[[float(ranks.sum())] * 3] * 2, [float(n * (n - 1) / 2)], [n * (n - 1) // 2, n]])
inplace = [t.clone() for t in group[:2]]
hvd.grouped_allreduce_(inplace)
check("grouped allreduce_", [t.tolist() for t in inplace], [[[float(ranks.mean())] * 3] * 2, [(n - 1) / 2]])
handle = hvd.grouped_allreduce_async([torch.ones(4) * r, torch.ones(1)], op=hvd.Max)
check("grouped allreduce async", [t.tolist() for t in hvd.synchronize(handle)], [[float(n - 1)] * 4, [1.0]])

# allgather with a first dimension that differs per rank
mine = torch.full((r + 1, 2), float(r))
expected_rows = [[float(i)] * 2 for i in range(n) for _ in range(i + 1)]
check("allgather uneven", hvd.allgather(mine, name="uneven"), expected_rows)
check("allgather async", hvd.synchronize(hvd.allgather_async(torch.tensor([r]))), list(range(n)))
gathered = hvd.grouped_allgather([mine, torch.tensor([[r, r]])])
check("grouped allgather", [t.tolist() for t in gathered], [expected_rows, [[i, i] for i in range(n)]])

# broadcast
root = 1 % n
check("broadcast", hvd.broadcast(torch.tensor([float(r)] * 3), root_rank=root, name="b"), [float(root)] * 3)
z = torch.tensor([r, r + 10])
hvd.broadcast_(z, root_rank=0)
check("broadcast_ in place", z, [0, 10])
check("broadcast async", hvd.synchronize(hvd.broadcast_async(torch.tensor([r * 2.0]), root)), [2.0 * root])

# alltoall: even split, then explicit splits (rank r sends j+1 rows to rank j)
rows = torch.tensor([[100 * r + k] for k in range(2 * n)], dtype=torch.float32)
check("alltoall", hvd.alltoall(rows).view(-1), [100.0 * i + 2 * r + k for i in range(n) for k in range(2)])
splits = torch.tensor([j + 1 for j in range(n)], dtype=torch.int32)
data = torch.arange(int(splits.sum()), dtype=torch.float32) + 100 * r
got, received = hvd.alltoall(data, splits=splits)
start = sum(range(1, r + 1))
check("alltoall splits", got, [100.0 * i + start + k for i in range(n) for k in range(r + 1)])
check("alltoall received splits", [received.tolist(), str(received.dtype)], [[r + 1] * n, "torch.int32"])
out, recv = hvd.synchronize(hvd.alltoall_async(data, splits=splits))
check("alltoall async", [out.tolist(), recv.tolist()],
      [[100.0 * i + start + k for i in range(n) for k in range(r + 1)], [r + 1] * n])

# reducescatter: even and uneven first dimension (first ranks get the extra rows)
even = torch.full((2 * n, 3), r + 1.0)
check("reducescatter average", hvd.reducescatter(even), [[float(ranks.mean())] * 3] * 2)
check("reducescatter sum", hvd.reducescatter(even, op=hvd.Sum), [[float(ranks.sum())] * 3] * 2)
uneven = torch.arange(2 * n + 1, dtype=torch.float32).unsqueeze(1) * (r + 1)
counts = [2 + (1 if i < 1 else 0) for i in range(n)]
offset = sum(counts[:r])
check("reducescatter uneven", hvd.reducescatter(uneven, op=hvd.Sum).view(-1),
      [float(k * ranks.sum()) for k in range(offset, offset + counts[r])])
both = hvd.grouped_reducescatter([even, uneven], op=hvd.Sum)
check("grouped reducescatter", [both[0].tolist(), both[1].view(-1).tolist()],
      [[[float(ranks.sum())] * 3] * 2, [float(k * ranks.sum()) for k in range(offset, offset + counts[r])]])

# objects
check("broadcast_object", hvd.broadcast_object({"rank": r, "text": "x" * r}, root_rank=root),
      {"rank": root, "text": "x" * root})
check("allgather_object", hvd.allgather_object((r, [r] * r)), [(i, [i] * i) for i in range(n)])
hvd.barrier()

# autograd
a = torch.tensor([1.0, 2.0], requires_grad=True)
(hvd.allreduce(a, op=hvd.Sum) * torch.tensor([1.0, 3.0])).sum().backward()
check("allreduce gradient", a.grad, [float(n), 3.0 * n])
g = torch.ones(r + 1, 2, requires_grad=True)
weights = torch.arange(sum(range(1, n + 1)) * 2, dtype=torch.float32).view(-1, 2)
(hvd.allgather(g) * weights).sum().backward()
my_rows = sum(range(1, r + 1))  # rows gathered before this rank's
check("allgather gradient", g.grad, weights[my_rows:my_rows + r + 1])
b = torch.tensor([5.0, 6.0], requires_grad=True)
(hvd.broadcast(b, root_rank=0) * 2).sum().backward()
check("broadcast gradient", b.grad, [2.0, 2.0] if r == 0 else [0.0, 0.0])

# join: ranks > 0 join after one allreduce; rank 0 does one more that the others serve with zeros
first = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="join.first")
uneven = os.environ.get("POLYTRAIN_HOROVOD_METADATA_CHECK") != "0"  # the shim's join needs the check for this
if r == 0 and uneven:
    extra = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="join.extra")
    check("allreduce while others joined", extra, [1.0, 1.0])
last = hvd.join()
agreed = hvd.allgather(torch.tensor([last]), name="join.agreed").tolist()  # else any rank may be last
check("join returns last joined rank", [first.tolist(), last, agreed],
      [[float(n)] * 2, 0 if uneven else agreed[0], [agreed[0]] * n])

try:
    hvd.allreduce(x, op=hvd.Adasum, name="adasum")
    values["adasum"] = hvd.allreduce(x, op=hvd.Adasum, name="adasum2").tolist()
except (ValueError, NotImplementedError) as exc:
    values["adasum"] = type(exc).__name__

# process sets (3+ ranks): {0, 2}
if n >= 3:
    evens = hvd.add_process_set([0, 2])
    check("process set info", [evens.size(), evens.included()], [2, r in (0, 2)])
    if r in (0, 2):
        check("process set allreduce", hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, process_set=evens), [4.0])
        check("process set rank", evens.rank(), [0, 2].index(r))
        check("process set allgather", hvd.allgather(torch.tensor([r]), process_set=evens), [0, 2])
        check("process set broadcast", hvd.broadcast(torch.tensor([r]), root_rank=2, process_set=evens), [2])
    hvd.barrier()
    check("remove process set", hvd.remove_process_set(evens), True)
    check("remove global set", hvd.remove_process_set(hvd.global_process_set), False)
    # a process set registered by init, after a shutdown (what elastic resets do)
    odds = hvd.ProcessSet([1])
    pair = hvd.ProcessSet([1, 2])
    hvd.shutdown()
    hvd.init(process_sets=[odds, pair])
    check("init process sets", [odds.size(), pair.size(), pair.included(), hvd.rank()], [1, 2, r in (1, 2), r])
    if r in (1, 2):
        check("init process set allreduce", hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=pair), [3.0])

report({"rank": r, "size": n, "checks": checks, "values": values})
hvd.shutdown()
sys.exit(0)
