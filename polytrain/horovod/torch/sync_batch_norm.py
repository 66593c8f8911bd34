"""Horovod's ``hvd.SyncBatchNorm``: batch statistics over the whole global batch.

Unlike Horovod's (GPU-only in training), this one runs on CPU and GPU. Each rank
contributes its count, per-channel mean and biased variance (one allgather, combined
exactly with Chan's parallel formula); the backward pass allreduces the two per-channel
sums the input gradient needs, as Horovod does. Weight and bias gradients stay local —
DistributedOptimizer averages them like every other gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from polytrain.horovod.common import Sum
from polytrain.horovod.torch.collectives import allgather_async, allreduce_async, synchronize
from polytrain.horovod.torch.runtime import size


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation whose training statistics span every process (input ``(N, C, ...)``)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked) if self.track_running_stats else 0.0
        else:
            factor = self.momentum
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, self.running_mean, self.running_var,
                                            self.eps, factor)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C, ...) -> (N * ..., C)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).t()


def _broadcastable(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float) -> torch.Tensor:
        flat = _channels_last(input.contiguous()).to(torch.float64)
        count = flat.shape[0]
        local_mean = flat.mean(0) if count else flat.new_zeros(flat.shape[1])
        local_var = flat.var(0, unbiased=False) if count else flat.new_zeros(flat.shape[1])
        mine = torch.cat([flat.new_tensor([count]), local_mean, local_var]).unsqueeze(0)
        stats = synchronize(allgather_async(mine, name="sync_batch_norm.stats"))
        counts, means, variances = stats[:, 0:1], stats[:, 1:1 + flat.shape[1]], stats[:, 1 + flat.shape[1]:]
        total = counts.sum()
        mean = (counts * means).sum(0) / total
        var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * total / max(float(total) - 1, 1.0)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(var + eps).to(input.dtype)
        mean = mean.to(input.dtype)
        xhat = (input - _broadcastable(mean, input)) * _broadcastable(invstd, input)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total = float(total)
        out = xhat
        if weight is not None:
            out = out * _broadcastable(weight, input)
        if bias is not None:
            out = out + _broadcastable(bias, input)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        xhat, weight, invstd = ctx.saved_tensors
        dy = _channels_last(grad_output.contiguous())
        flat_xhat = _channels_last(xhat)
        sum_dy = dy.sum(0)
        sum_dy_xhat = (dy * flat_xhat).sum(0)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            handle = allreduce_async(torch.cat([sum_dy, sum_dy_xhat]), op=Sum, name="sync_batch_norm.grad_sums")
            global_dy, global_dy_xhat = synchronize(handle).chunk(2)
            scale = invstd if weight is None else invstd * weight
            grad_input = _broadcastable(scale, grad_output) * (
                grad_output - _broadcastable(global_dy / ctx.total, grad_output)
                - xhat * _broadcastable(global_dy_xhat / ctx.total, grad_output))
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy
        return grad_input, grad_weight, grad_bias, None, None, None, None
