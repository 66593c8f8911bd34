"""Predicted ops (polytrain.horovod.torch.speculate) on 2 ranks: repeated small allreduces skip the metadata
exchange and give the same numbers; any rank that departs from the prediction (another shape, another op, a
join, an optimizer step) still gets the mismatch or the join on every rank, and the job goes on."""

import torch
from reporting import report

import polytrain.horovod.torch as hvd
from polytrain.horovod.torch import speculate

hvd.init()
r, n = hvd.rank(), hvd.size()
checks, errors, counts = {}, {}, {}


def check(name, ok, detail=None):
    checks[name] = True if ok else detail


def expect_error(kind, fn):
    before = speculate.counts()
    try:
        fn()
        errors[kind] = "no error"
    except Exception as exc:  # noqa: BLE001 - the type is what the test compares
        errors[kind] = type(exc).__name__
    counts[kind] = [now - then for now, then in zip(speculate.counts(), before)]
    total = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum, name=f"after {kind}")
    check(f"allreduce after {kind}", float(total) == n * (n + 1) / 2, total.tolist())


def repeat(label, times, fn):
    """``fn(i)`` returns (got, expected) for round i; counts the hits and misses these rounds made."""
    hits, misses = speculate.counts()
    wrong = []
    for i in range(times):
        got, expected = fn(i)
        if not torch.equal(got, expected):
            wrong.append((i, got.tolist(), expected.tolist()))
    check(label, not wrong, wrong[:2])
    after = speculate.counts()
    counts[label] = [after[0] - hits, after[1] - misses]


def ranks_sum(value):
    return sum(value(k) for k in range(n))


# the same allreduce again and again: after the first rounds no exchange runs
repeat("sum", 20, lambda i: (hvd.allreduce(torch.full((256,), float(r + i)), op=hvd.Sum, name="x"),
                             torch.full((256,), float(ranks_sum(lambda k: k + i)))))
repeat("average", 10, lambda i: (hvd.allreduce(torch.full((3, 4), float(r * 10 + i))),
                                 torch.full((3, 4), ranks_sum(lambda k: k * 10 + i) / n)))
repeat("max", 6, lambda i: (hvd.allreduce(torch.tensor([r + i, -r], dtype=torch.int64), op=hvd.Max),
                            torch.tensor([n - 1 + i, 0])))
repeat("min", 6, lambda i: (hvd.allreduce(torch.tensor([float(r + i)]), op=hvd.Min), torch.tensor([float(i)])))
repeat("product", 6, lambda i: (hvd.allreduce(torch.tensor([2.0 + r]), op=hvd.Product),
                                torch.tensor([float(torch.arange(2.0, 2.0 + n).prod())])))
repeat("scaled in place", 6, lambda i: (hvd.allreduce_(torch.full((5,), float(r + 1)), op=hvd.Sum, prescale_factor=2.0,
                                                       postscale_factor=0.25),
                                        torch.full((5,), ranks_sum(lambda k: k + 1) * 0.5)))
repeat("grouped", 6, lambda i: (torch.cat(hvd.grouped_allreduce([torch.full((2,), float(r)), torch.ones(3)],
                                                                op=hvd.Sum)),
                                torch.tensor([float(ranks_sum(lambda k: k))] * 2 + [float(n)] * 3)))
# two allreduces of one name, then a third op, over and over: three ops of context tell them apart
repeat("alternating", 8, lambda i: (torch.cat([hvd.allreduce(torch.ones(2), op=hvd.Sum, name="twice"),
                                               hvd.allreduce(torch.ones(2), op=hvd.Sum, name="twice"),
                                               hvd.allreduce(torch.ones(1), op=hvd.Sum, name="third")]),
                                    torch.full((5,), float(n))))
# a rank leaves the predicted op: every rank hears of it in the exchange that follows
expect_error("shape after hits", lambda: hvd.allreduce(torch.ones(256 + r), op=hvd.Sum, name="x"))
repeat("sum again", 6, lambda i: (hvd.allreduce(torch.full((256,), float(r + i)), op=hvd.Sum, name="x"),
                                  torch.full((256,), float(ranks_sum(lambda k: k + i)))))
expect_error("another op after hits", lambda: (hvd.allreduce(torch.ones(256), op=hvd.Sum, name="x") if r == 0
                                               else hvd.broadcast(torch.ones(256), root_rank=0, name="x")))
spare = torch.nn.Linear(3, 1)
spare_opt = hvd.DistributedOptimizer(torch.optim.SGD(spare.parameters(), lr=0.1),
                                     named_parameters=spare.named_parameters())


def step_once():
    spare(torch.ones(2, 3)).sum().backward()
    spare_opt.step()


repeat("sum once more", 6, lambda i: (hvd.allreduce(torch.full((256,), float(r + i)), op=hvd.Sum, name="x"),
                                      torch.full((256,), float(ranks_sum(lambda k: k + i)))))
expect_error("optimizer step after hits", lambda: (
    hvd.allreduce(torch.ones(256), op=hvd.Sum, name="x") if r == 0 else step_once()))



# a training loop: the loss's allreduce and the optimizer's step are predicted (its buckets go during backward)
def batch(step, rank):
    torch.manual_seed(100 + step * n + rank)
    return torch.randn(5, 4)


torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
reference = torch.nn.Linear(4, 2)
reference.load_state_dict(model.state_dict())
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
hits = speculate.counts()[0]
for step in range(8):
    loss = model(batch(step, r)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    hvd.allreduce(loss.detach(), name="loss")
    (sum(reference(batch(step, k)).pow(2).mean() for k in range(n)) / n).backward()  # every rank's batch, here
    reference_opt.step()
    reference_opt.zero_grad()
counts["training loop"] = [speculate.counts()[0] - hits, 0]
check("training loop = one process on every batch", all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(
    model.parameters(), reference.parameters())), [p.tolist() for p in model.parameters()])


def step_or_allreduce():
    if r == 0:  # the step is the predicted op: its buckets go during backward
        model(batch(0, r)).pow(2).mean().backward()
        opt.step()
    else:
        hvd.allreduce(torch.ones(3), name="not a step")


expect_error("allreduce instead of a predicted step", step_or_allreduce)

# a rank joins while the other goes on with predicted ops: the joined rank serves them with zeros
model = torch.nn.Linear(4, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
for step in range(5):
    model(batch(step, r)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    hvd.allreduce(torch.ones(1), name="loss")
before_join = speculate.counts()
if r == 0:
    model(batch(9, r)).pow(2).mean().backward()
    local = [p.grad.clone() for p in model.parameters()]
    opt.synchronize()
    check("step while joined averages with zeros", all(torch.allclose(p.grad, g / n) for p, g in zip(
        model.parameters(), local)))
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    got = [hvd.allreduce(torch.ones(2), op=hvd.Sum, name="loss").tolist() for _ in range(3)]
    check("allreduce while joined", got == [[1.0, 1.0]] * 3, got)
check("join returns the last rank", hvd.join() == 0)
counts["join"] = [now - then for now, then in zip(speculate.counts(), before_join)]
expect_error("nothing", lambda: None)

report({"rank": r, "checks": checks, "errors": errors, "counts": counts})
hvd.shutdown()
