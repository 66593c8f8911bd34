"""DistributedOptimizer, state broadcasts and SyncBatchNorm against single-process references.

Every rank trains on its shard of a batch that every rank can generate; the reference is
the same model trained in this process on the whole batch with a plain optimizer (what
n ranks x b must equal: 1 rank x n*b). Reports like collectives.py; under real Horovod
(POLYTRAIN_HOROVOD_IMPL=horovod) the DDP and SyncBatchNorm parts are skipped (no torch
process group; Horovod's SyncBatchNorm needs a GPU).
"""

import copy
import warnings

import torch
import torch.nn.functional as F
from reporting import report

import polytrain.horovod.torch as hvd

checks = {}
values = {}


def check(name, got, expected, tol=1e-5):
    got_t = torch.as_tensor(got, dtype=torch.float64)
    exp_t = torch.as_tensor(expected, dtype=torch.float64)
    diff = float((got_t - exp_t).abs().max()) if got_t.shape == exp_t.shape else float("inf")
    values[name] = diff
    checks[name] = True if diff <= tol else [diff, tol]


def flag(name, ok, detail=""):
    checks[name] = True if ok else [False, detail]


hvd.init()
r, n = hvd.rank(), hvd.size()
REAL = getattr(hvd, "IMPL", "") == "horovod"  # Horovod's SyncBatchNorm needs a GPU; no DDP
B, D = 8, 6
gen = torch.Generator().manual_seed(0)
X = torch.randn(n * B, D, generator=gen)
Y = torch.randn(n * B, 2, generator=gen)
mine = slice(r * B, (r + 1) * B)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(D, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                                        torch.nn.Tanh(), torch.nn.Linear(16, 2))
        self.unused = torch.nn.Linear(3, 3)  # gets no gradient: Horovod reduces zeros for it

    def forward(self, x):
        return self.body(x)


def make_model():
    torch.manual_seed(1)
    return Net()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(model, opt, steps, shard, passes=1, clip=None, explicit_sync=False):
    for _ in range(steps):
        rows = torch.arange(shard.start, shard.stop)
        for micro in rows.chunk(passes):
            F.mse_loss(model(X[micro]), Y[micro]).backward()
        if explicit_sync:
            opt.synchronize()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if explicit_sync:
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        opt.zero_grad()


def reference(steps, make_opt, passes=1, clip=None, scale=1.0):
    """1 process, whole batch: the average of the per-rank (per-pass summed) gradients."""
    model = make_model()
    opt = make_opt(model)
    for _ in range(steps):
        for k in range(n):
            for micro in torch.arange(k * B, (k + 1) * B).chunk(passes):
                (F.mse_loss(model(X[micro]), Y[micro]) * scale / n).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return flat(model)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def distributed(steps, make_opt=sgd, **kwargs):
    model = make_model()
    train_kw = {k: kwargs.pop(k) for k in ("passes", "clip", "explicit_sync") if k in kwargs}
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   backward_passes_per_step=train_kw.get("passes", 1), **kwargs)
    train(model, opt, steps, mine, **train_kw)
    return flat(model), opt


got, opt = distributed(4)
check("2 ranks x b == 1 rank x 2b (SGD momentum)", got, reference(4, sgd))
values["weights"] = got.tolist()
flag("isinstance Optimizer", isinstance(opt, torch.optim.Optimizer))
flag("state and param_groups", len(opt.state) == len(list(make_model().parameters()))
     and opt.param_groups[0]["lr"] == 0.1 and "state" in opt.state_dict())
got, _ = distributed(3, lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
check("Adam", got, reference(3, lambda m: torch.optim.Adam(m.parameters(), lr=0.01)))
got, _ = distributed(3, passes=2)
check("backward_passes_per_step=2", got, reference(3, sgd, passes=2))
got, _ = distributed(3, clip=0.05, explicit_sync=True)
check("synchronize + clip + skip_synchronize", got, reference(3, sgd, clip=0.05))
got, _ = distributed(3, compression=hvd.Compression.fp16)
check("fp16 compression", got, reference(3, sgd), tol=2e-3)
got, _ = distributed(3, op=hvd.Sum)
check("op=Sum", got, reference(3, sgd, scale=n))
got, _ = distributed(3, gradient_predivide_factor=2.0)
check("gradient_predivide_factor", got, reference(3, sgd))
got, _ = distributed(3, groups=2)
check("groups=2", got, reference(3, sgd))

# DDP on the same process group gives the same weights (the shim runs on torch.distributed)
def ddp_weights():
    model = torch.nn.parallel.DistributedDataParallel(make_model(), find_unused_parameters=True)
    opt = sgd(model)
    for _ in range(4):
        F.mse_loss(model(X[mine]), Y[mine]).backward()
        opt.step()
        opt.zero_grad()
    return flat(model.module)


if not REAL:
    check("equals DDP", distributed(4)[0], ddp_weights())

# sparse gradients (nn.Embedding(sparse=True)): allgathered, or reduced densely with sparse_as_dense
def embedding_weights(distributed_opt, **kwargs):
    torch.manual_seed(5)
    table = torch.nn.Embedding(20, 3, sparse=True)
    ids = torch.randint(0, 20, (n * 6,), generator=torch.Generator().manual_seed(6))
    opt = torch.optim.SGD(table.parameters(), lr=0.5)
    if distributed_opt:
        opt = hvd.DistributedOptimizer(opt, named_parameters=table.named_parameters(), **kwargs)
    for _ in range(2):
        rows = ids[r * 6:(r + 1) * 6] if distributed_opt else ids
        (table(rows) ** 2).sum().div(6 if distributed_opt else 6 * n).backward()
        opt.step()
        opt.zero_grad()
    return table.weight.detach().clone()


check("sparse gradients allgathered", embedding_weights(True), embedding_weights(False))
check("sparse_as_dense", embedding_weights(True, sparse_as_dense=True), embedding_weights(False))

# join: ranks > 0 run out of data after one step; rank 0's second step averages its gradient with zeros
def joined_step():
    torch.manual_seed(9)
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    expected = None
    for step in range(2 if r == 0 else 1):
        opt.zero_grad()
        if step == 1:  # what the others' zeros make of rank 0's gradient: divided by n
            probe = copy.deepcopy(model)
            probe(X[mine, :3] + step).sum().backward()
            expected = flat(model) - torch.cat([p.grad.reshape(-1) for p in probe.parameters()]) / n
        model(X[mine, :3] + step).sum().backward()
        opt.step()
    last = hvd.join()
    check("join returns the last rank", last, 0)
    if r == 0:
        check("optimizer step while others joined", flat(model), expected)


# misuse is reported like Horovod does
model = make_model()
opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters())
F.mse_loss(model(X[mine]), Y[mine]).backward()
try:
    opt.zero_grad()
    flag("zero_grad with pending allreduces raises", False, "no error")
except AssertionError as exc:
    flag("zero_grad with pending allreduces raises", "before optimizer.step() or optimizer.synchronize()" in str(exc))
opt.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt.step()
flag("step after synchronize warns", any("skip_synchronize" in str(w.message) for w in caught))
opt.zero_grad()
F.mse_loss(model(X[mine]), Y[mine]).backward()
try:
    F.mse_loss(model(X[mine]), Y[mine]).backward()
    flag("too many backward passes raises", False, "no error")
except AssertionError as exc:
    flag("too many backward passes raises", "backward_passes_per_step" in str(exc))
try:
    hvd.DistributedOptimizer(sgd(model), named_parameters=[("a", p) for p in model.parameters()])
    flag("duplicate names raise", False)
except ValueError as exc:
    flag("duplicate names raise", "unique" in str(exc))
sched = torch.optim.lr_scheduler.StepLR(hvd.DistributedOptimizer(sgd(make_model())), step_size=1, gamma=0.5)
flag("LR scheduler accepts it", sched.get_last_lr() == [0.1])

# broadcast_parameters / broadcast_optimizer_state: rank-specific start, rank 0 wins
torch.manual_seed(100 + r)
model = torch.nn.Linear(4, 3)
opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1), betas=(0.9, 0.99 - 0.01 * r))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
weights = hvd.allgather(flat(model).unsqueeze(0))
flag("broadcast_parameters", bool((weights == weights[0]).all()))
flag("broadcast_optimizer_state scalars", opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.9, 0.99),
     str(opt.param_groups[0]))
flag("broadcast_optimizer_state created Adam state", all("exp_avg" in s for s in opt.state.values()) and len(opt.state) == 2)
model.weight.grad = torch.ones_like(model.weight) * (r + 1)
model.bias.grad = torch.ones_like(model.bias)
opt.step()
opt.state[model.weight]["exp_avg"].add_(r)
hvd.broadcast_optimizer_state(opt, root_rank=0)
states = hvd.allgather(opt.state[model.weight]["exp_avg"].reshape(1, -1))
flag("broadcast_optimizer_state tensors", bool((states == states[0]).all()))
# an optimizer without state (plain SGD) synced after a step: the last gradient is not applied a second time
model = torch.nn.Linear(4, 3)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
plain = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(2, 4)).sum().backward()
before, grad = flat(model).clone(), model.weight.grad.clone()
hvd.broadcast_optimizer_state(plain, root_rank=0)
flag("broadcast_optimizer_state leaves a stateless optimizer's weights", torch.equal(flat(model), before))
if not REAL:  # Horovod leaves the zeros it stepped with in .grad; the shim puts each gradient back
    flag("broadcast_optimizer_state puts a stateless optimizer's gradients back", torch.equal(model.weight.grad, grad))


# SyncBatchNorm: my shard through SyncBatchNorm == my rows of a full-batch BatchNorm (Horovod's needs a GPU)
def sync_batch_norm():
    torch.manual_seed(3)
    full_in = torch.randn(n * 4, 3, 5)
    sync_bn = hvd.SyncBatchNorm(3)
    plain_bn = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        sync_bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        plain_bn.weight.copy_(sync_bn.weight)
    weights = torch.randn(n * 4, 3, 5, generator=torch.Generator().manual_seed(4))
    rows = slice(r * 4, (r + 1) * 4)
    x_mine = full_in[rows].clone().requires_grad_(True)
    x_full = full_in.clone().requires_grad_(True)
    out_mine = sync_bn(x_mine)
    out_full = plain_bn(x_full)
    (out_mine * weights[rows]).sum().backward()
    (out_full * weights).sum().backward()
    check("SyncBatchNorm output", out_mine.detach(), out_full[rows].detach())
    check("SyncBatchNorm running stats", torch.cat([sync_bn.running_mean, sync_bn.running_var]),
          torch.cat([plain_bn.running_mean, plain_bn.running_var]))
    check("SyncBatchNorm input gradient", x_mine.grad, x_full.grad[rows])
    check("SyncBatchNorm weight gradient", hvd.allreduce(sync_bn.weight.grad, op=hvd.Sum), plain_bn.weight.grad)
    sync_bn.eval()
    check("SyncBatchNorm eval", sync_bn(full_in).detach(), plain_bn.eval()(full_in).detach())


if not REAL:
    sync_batch_norm()
joined_step()  # last: Horovod's names for unnamed ops differ across ranks after uneven steps

report({"rank": r, "size": n, "checks": checks, "values": values})
hvd.shutdown()
