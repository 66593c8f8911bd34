"""Horovod's DistributedOptimizer, built by composition (no class synthesised at run time).

The wrapper *is* a ``torch.optim.Optimizer`` (isinstance holds, LR schedulers work) whose
``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own objects.
During ``backward()`` a post-accumulate-grad hook marks each gradient ready; once every
gradient of a bucket (see `buckets`) is ready the bucket is copied into one flat buffer
and its allreduce starts asynchronously, overlapping with the rest of backward.
``step()`` (or ``synchronize()``) waits, scales and copies the results back into ``.grad``.
A step the ranks predict (`speculate`) launches its buckets without waiting for the step's
metadata exchange; the verdict, in the first bucket's spare last element, is read before the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from polytrain.horovod.common import Adasum, Average
from polytrain.horovod.torch import elastic_world, speculate, stall, transport
from polytrain.horovod.torch.buckets import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    layout_id,
    name_parameters,
    plan_buckets,
    split_groups,
)
from polytrain.horovod.torch.collectives import scale_
from polytrain.horovod.torch.compression import Compression, Compressor
from polytrain.horovod.torch.join import OPTIMIZER_LAYOUTS
from polytrain.horovod.torch.ops import allgather
from polytrain.horovod.torch.process_sets import ProcessSet, global_process_set, resolve
from polytrain.horovod.torch.runtime import runtime
from polytrain.observe.timeline import COLLECTIVES

_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all processes."""

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                 compression: type[Compressor] = Compression.none, backward_passes_per_step: int = 1,
                 op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Any = None, sparse_as_dense: bool = False,
                 process_set: ProcessSet = global_process_set):
        # torch.optim.Optimizer.__init__ is not called on purpose: param groups and state stay the
        # wrapped optimizer's (see the properties below).
        self.optimizer = optimizer
        if op == Adasum:
            raise ValueError("op=hvd.Adasum is not supported by polytrain's Horovod shim; use hvd.Average or "
                             "hvd.Sum, or run real Horovod (POLYTRAIN_HOROVOD_IMPL=horovod)")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        if num_groups:
            warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                          DeprecationWarning, stacklevel=2)
            groups = groups if groups is not None else num_groups
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = groups
        self._parameter_names = name_parameters(self.param_groups, named_parameters)
        self._synchronized = False
        self._should_synchronize = True
        self._hooks: list[Any] = []
        self._buckets: list[Bucket] = []
        self._passes: dict[int, int] = {}
        self._pending = False
        self._seq = 0
        self._next_launch = 0
        self._sparse: list[torch.Tensor] = []
        self._layout = 0
        self._build()
        elastic_world.LIVE.add(self)

    # --------------------------------------------------------------- the wrapped optimizer's data
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        """Anything else torch.optim.Optimizer keeps (hook tables ...) is the wrapped optimizer's."""
        inner = self.__dict__.get("optimizer")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._reset_step()
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add parameters on every rank alike; the gradient buckets are rebuilt."""
        self.optimizer.add_param_group(param_group)
        self._parameter_names.update({p: f"allreduce.noname.{len(self.param_groups) - 1}.{j}"
                                      for j, p in enumerate(self.param_groups[-1]["params"])
                                      if p not in self._parameter_names})
        self._build()

    # --------------------------------------------------------------- setup
    def _build(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._pieces: speculate.Pieces = ()
        OPTIMIZER_LAYOUTS.pop(self._layout, None)
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        names = [self._parameter_names[p] for p in params]
        state = runtime()
        settings = state.settings
        cap = min(settings.fusion_threshold, DEFAULT_BUCKET_BYTES) or 1
        self._buckets = plan_buckets(params, names, cap, split_groups(params, self._groups))
        self._layout = layout_id(self._buckets)
        self._reset_step()
        if not self.process_set.included() or self.process_set.size() == 1:
            return
        # every bucket's buffer has a spare last element: a predicted step's flag (see `speculate`)
        self._pieces = tuple((b.numel + 1, self._compression.compress(torch.zeros(1, dtype=b.dtype))[0].dtype,
                              b.device) for b in self._buckets)
        OPTIMIZER_LAYOUTS[self._layout] = [(numel, dtype) for numel, dtype, _ in self._pieces]
        if settings.metadata_check:
            self._verify_layout(names, params)
        for bucket in self._buckets:
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(bucket)))

    def _verify_layout(self, names: list[str], params: list[torch.Tensor]) -> None:
        mine = torch.tensor([self._layout], dtype=torch.int64)
        layouts = allgather(mine, name="DistributedOptimizer.layout", process_set=self.process_set)
        if bool((layouts == mine).all()):
            return
        raise stall.CollectiveMismatchError(
            f"DistributedOptimizer parameters differ across ranks (layout fingerprints {layouts.tolist()}); "
            f"this rank has {len(params)} parameters, first {names[:3]}")

    def _reset_step(self) -> None:
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.launched = None
        self._passes = {}
        self._pending = False
        self._next_launch = 0
        self._record: tuple[Any, torch.Tensor] | None = None
        self._verified = False
        self._speculating = False  # buckets launched as the predicted step, before any exchange
        self._sparse = []
        self._synchronized = False

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._passes = {}

    # --------------------------------------------------------------- during backward
    def _make_hook(self, bucket: Bucket) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            count = self._passes.get(id(p), 0)
            if count >= self.backward_passes_per_step:
                raise AssertionError(_TOO_MANY_PASSES)
            self._passes[id(p)] = count + 1
            self._pending = True
            if count + 1 == self.backward_passes_per_step:
                self._fill(bucket, p)
                bucket.ready += 1
                self._launch_ready()
        return hook

    def _fill(self, bucket: Bucket, p: torch.Tensor) -> None:
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(bucket.numel + 1, dtype=bucket.dtype, device=bucket.device)
        slot = bucket.slots[id(p)]
        view = bucket.buffer[bucket.offsets[slot]:bucket.offsets[slot] + p.numel()]
        grad = p.grad
        if grad is None:
            view.zero_()
        elif grad.is_sparse:
            if self.sparse_as_dense:
                view.copy_(grad.to_dense().reshape(-1))
            else:
                view.zero_()
                self._sparse.append(p)
        else:
            view.copy_(grad.reshape(-1))

    def _launch_ready(self, block: bool = False) -> None:
        """Launch complete buckets in index order, so every rank issues the same sequence.

        The step's metadata record goes first; its exchange runs while backward goes on, and
        no bucket leaves before it is verified (``block`` waits for it, at synchronize()).
        """
        if self._next_launch == len(self._buckets) or self._buckets[self._next_launch].ready < len(
                self._buckets[self._next_launch].params):
            return
        if not self._verified:
            if self._record is None:
                self._start_record()
            if not self._verified and not self._check_record(block):
                return
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _start_record(self) -> None:
        set_id = self.process_set.process_set_id
        self._seq = stall.next_seq(set_id)
        if not runtime().settings.metadata_check:
            self._verified = True
            return
        record = stall.make_record(stall.OPTIMIZER, None, [], extra=self._layout)
        group, size, _ = resolve(self.process_set)
        if speculate.expect(set_id, record, self._pieces, group, size, "DistributedOptimizer step", self._seq):
            self._verified = self._speculating = True  # the buckets go now; their verdict is read before the step
            speculate.defer(set_id, lambda: self._settle(record))
            return
        self._record = stall.start_exchange(record, group, size)

    def _settle(self, record: torch.Tensor) -> None:
        """Read the predicted step's verdict from the first bucket. On a miss every rank completes the predicted
        allreduces (zeros for buckets not launched yet), exchanges records as without prediction (a mismatch
        raises on every rank there) and launches its buckets again."""
        group, size, _ = resolve(self.process_set)
        set_id = self.process_set.process_set_id
        label = "DistributedOptimizer step"
        work, sent, _ = self._buckets[0].launched
        stall.wait(work, label, set_id, self._seq, group)
        self._speculating = False
        if speculate.verdict(set_id, speculate.row_of(record), self.op, float(sent[-1]), size):
            return
        works = [b.launched[0] if b.launched is not None else transport.all_reduce(
            torch.zeros(numel, dtype=dtype, device=device), self.op, group)
            for b, (numel, dtype, device) in zip(self._buckets, self._pieces)]
        for work in works:
            stall.wait(work, label, set_id, self._seq, group)
        self._record = stall.start_exchange(record, group, size)
        self._check_record(block=True)
        self._next_launch, self._sparse = 0, []
        for bucket in self._buckets:
            bucket.launched = None
            for p in bucket.params:
                if self._passes.get(id(p), 0) == self.backward_passes_per_step:
                    self._fill(bucket, p)
        self._launch_ready()

    def _check_record(self, block: bool) -> bool:
        work, records = self._record
        if not block and work is not None and not work.is_completed():
            return False
        group = self.process_set.group
        set_id = self.process_set.process_set_id
        stall.wait(work, "DistributedOptimizer step", set_id, self._seq, group)
        speculate.learn(set_id, records, self.op, self._pieces)
        stall.verify(records, "DistributedOptimizer step", group, set_id, self._seq, joined_ok=set_id == 0)
        self._verified = True
        return True

    def _launch(self, bucket: Bucket) -> None:
        if self.op == Average and self.gradient_predivide_factor != 1.0:
            scale_(bucket.buffer, 1.0 / self.gradient_predivide_factor)
        sent, ctx = self._compression.compress(bucket.buffer)
        if bucket.index == 0 and self._speculating:
            sent[-1] = speculate.flag(self.op)
        group = self.process_set.group
        bucket.launched_at = runtime().timeline.now()
        work = transport.all_reduce(sent, self.op, group)
        bucket.launched = (work, sent, ctx)

    # --------------------------------------------------------------- step
    def synchronize(self) -> None:
        """Finish every gradient allreduce now (e.g. before clipping); then use skip_synchronize()."""
        if not self.process_set.included() or not self._hooks:
            self._synchronized = True
            return
        for bucket in self._buckets:  # parameters that got no gradient this step contribute zeros
            if bucket.ready < len(bucket.params):
                for p in bucket.params:
                    if self._passes.get(id(p), 0) < self.backward_passes_per_step:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        self._fill(bucket, p)
                bucket.ready = len(bucket.params)
        self._launch_ready(block=True)
        speculate.settle(self.process_set.process_set_id)
        group, size, _ = resolve(self.process_set)
        post = self.gradient_predivide_factor if self.op == Average else 1.0
        if self.op == Average:
            post /= size
        timeline = runtime().timeline
        for bucket in self._buckets:
            work, sent, ctx = bucket.launched
            stall.wait(work, f"{bucket.label()} (gradient bucket {bucket.index})",
                       self.process_set.process_set_id, self._seq, group)
            timeline.complete(f"gradient bucket {bucket.index}", "collective", bucket.launched_at, timeline.now(),
                              track=COLLECTIVES, op="allreduce", bytes=(sent.numel() - 1) * sent.element_size(),  # not the spare flag
                              tensors=bucket.label())
            reduced = self._compression.decompress(sent, ctx)
            # scale while copying back (one pass over the bucket, not two) where every gradient is dense
            fused = reduced.is_floating_point() and not any(p.grad.is_sparse for p in bucket.params)
            if not fused:
                scale_(reduced, post)
            for p, offset in zip(bucket.params, bucket.offsets):
                piece = reduced[offset:offset + p.numel()].view(p.shape)
                if fused:
                    torch.mul(piece, post, out=p.grad)
                elif not p.grad.is_sparse:
                    p.grad.copy_(piece)
                elif self.sparse_as_dense:
                    p.grad = piece.to_sparse()
                # other sparse gradients are allgathered below
        for p in self._sparse:
            self._reduce_sparse(p, size)
        self._reset_step()
        self._synchronized = True

    def _reduce_sparse(self, p: torch.Tensor, size: int) -> None:
        grad = p.grad.coalesce()
        name = self._parameter_names[p]
        indices = allgather(grad.indices().t().contiguous(), name=f"{name}.indices", process_set=self.process_set)
        values = allgather(grad.values(), name=f"{name}.values", process_set=self.process_set)
        if self.op == Average:
            values = values / size
        p.grad = torch.sparse_coo_tensor(indices.t(), values, grad.shape, check_invariants=False).coalesce()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make ``step()`` skip synchronisation (after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause "
                                 "a race condition.")
        self.optimizer.zero_grad(set_to_none=set_to_none)
