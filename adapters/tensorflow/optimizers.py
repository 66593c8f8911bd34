"""SGD, Adam and AdamW with PyTorch's update rules, written out in TensorFlow.

Keras' optimizers differ from ``torch.optim`` in ways that change training (Keras SGD
momentum is ``v = μv − lr·g``, Keras Adam puts ε inside the bias correction and knows
no coupled weight decay), so a spec would not train alike on both frameworks. These
classes keep their state in ``tf.Variable`` slots and follow the single-tensor CPU path
of ``torch.optim`` line by line:

- ``sgd``: g += wd·p; v = μv + g (v = g on the first step); g = g + μv (nesterov) or v; p −= lr·g
- ``adam``: g += wd·p; m = lerp(m, g, 1−β1); v = β2·v + (1−β2)·g²;
  p −= lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + ε)
- ``adamw``: p ·= 1 − lr·wd, then Adam without the L2 term.

The per-step scalars (lr, bias corrections) are computed in Python double precision like
PyTorch does and passed into the compiled step as float32 tensors. ``slots(i)``/``load_slots``
use ``torch.optim``'s state keys (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``) so
optimizer state moves between the frameworks too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from polytrain.spec.tables import OptimizerSpec


def _slots(variables: Sequence[Any], name: str) -> list[tf.Variable]:
    return [tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False, name=f"{name}_{i}")
            for i, v in enumerate(variables)]


class SGD:
    def __init__(self, spec: OptimizerSpec, variables: Sequence[Any]) -> None:
        self.momentum, self.nesterov, self.weight_decay = spec.momentum, spec.nesterov, spec.weight_decay
        self.buffers = _slots(variables, "momentum") if self.momentum > 0 else []
        self.steps = 0

    def scalars(self, lr: float) -> list[float]:
        self.steps += 1
        return [lr]

    def apply(self, variables: Sequence[Any], grads: Sequence[tf.Tensor], scalars: tf.Tensor) -> None:
        lr = scalars[0]
        for i, (var, grad) in enumerate(zip(variables, grads)):
            if self.weight_decay:
                grad = grad + self.weight_decay * tf.convert_to_tensor(var)
            if self.momentum > 0:
                buf = self.buffers[i]
                buf.assign(buf * self.momentum + grad)
                grad = grad + self.momentum * buf if self.nesterov else buf.read_value()
            var.assign_sub(lr * grad)

    def slots(self, index: int) -> dict[str, np.ndarray]:
        """Variable ``index``'s state in Keras layout, as torch.optim names it (nothing before the first step)."""
        if self.momentum > 0 and self.steps > 0:
            return {"momentum_buffer": self.buffers[index].numpy()}
        return {}

    def load_slots(self, index: int, slots: Mapping[str, np.ndarray]) -> None:
        if "momentum_buffer" in slots and self.momentum > 0:
            self.buffers[index].assign(slots["momentum_buffer"])
            self.steps = max(self.steps, 1)


class Adam:
    """Adam (coupled L2 weight decay, like ``torch.optim.Adam``) or, with ``decoupled``, AdamW."""

    def __init__(self, spec: OptimizerSpec, variables: Sequence[Any], decoupled: bool) -> None:
        self.beta1, self.beta2 = spec.betas
        self.eps, self.weight_decay, self.decoupled = spec.eps, spec.weight_decay, decoupled
        self.exp_avg = _slots(variables, "exp_avg")
        self.exp_avg_sq = _slots(variables, "exp_avg_sq")
        self.steps = 0

    def scalars(self, lr: float) -> list[float]:
        self.steps += 1
        bias_correction1 = 1 - self.beta1 ** self.steps
        bias_correction2 = 1 - self.beta2 ** self.steps
        return [lr, lr / bias_correction1, math.sqrt(bias_correction2), 1 - lr * self.weight_decay]

    def apply(self, variables: Sequence[Any], grads: Sequence[tf.Tensor], scalars: tf.Tensor) -> None:
        step_size, bias_correction2_sqrt, decay_factor = scalars[1], scalars[2], scalars[3]
        for var, grad, m, v in zip(variables, grads, self.exp_avg, self.exp_avg_sq):
            if self.weight_decay:
                if self.decoupled:
                    var.assign(tf.convert_to_tensor(var) * decay_factor)
                else:
                    grad = grad + self.weight_decay * tf.convert_to_tensor(var)
            if self.beta1 > 0.5:  # torch's lerp(m, g, w) picks its formula by w = 1 − β1
                m.assign(m + (1 - self.beta1) * (grad - m))
            else:
                m.assign(grad - (grad - m) * self.beta1)
            v.assign(v * self.beta2 + (1 - self.beta2) * grad * grad)
            denom = tf.sqrt(v) / bias_correction2_sqrt + self.eps
            var.assign_sub(step_size * m / denom)

    def slots(self, index: int) -> dict[str, np.ndarray]:
        if self.steps == 0:
            return {}
        return {"step": np.array(self.steps, np.float32), "exp_avg": self.exp_avg[index].numpy(),
                "exp_avg_sq": self.exp_avg_sq[index].numpy()}

    def load_slots(self, index: int, slots: Mapping[str, np.ndarray]) -> None:
        if "step" in slots:
            self.steps = int(np.asarray(slots["step"]))
        for key, target in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            if key in slots:
                target[index].assign(slots[key])


def make_optimizer(spec: OptimizerSpec, variables: Sequence[Any]) -> SGD | Adam:
    if spec.name == "sgd":
        return SGD(spec, variables)
    return Adam(spec, variables, decoupled=spec.name == "adamw")
