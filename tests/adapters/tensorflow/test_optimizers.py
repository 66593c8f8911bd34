"""The TensorFlow optimizers follow ``torch.optim`` step for step (same gradients → same parameters)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

from polytrain.adapters.tensorflow.optimizers import make_optimizer  # noqa: E402
from polytrain.adapters.torch.framework import make_optimizer as make_torch_optimizer  # noqa: E402
from polytrain.spec.tables import OptimizerSpec  # noqa: E402

CASES = {
    "sgd": OptimizerSpec(name="sgd", lr=0.1),
    "sgd-momentum-wd": OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": OptimizerSpec(name="sgd", lr=0.05, momentum=0.8, nesterov=True),
    "adam": OptimizerSpec(name="adam", lr=0.01),
    "adam-l2-small-beta1": OptimizerSpec(name="adam", lr=0.01, betas=(0.3, 0.99), weight_decay=0.1, eps=1e-6),
    "adamw": OptimizerSpec(name="adamw", lr=0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_updates_match_torch_optim(case: str) -> None:
    spec = CASES[case]
    rng = np.random.default_rng(0)
    shapes = [(4, 3), (3,)]
    initial = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    torch_params = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in initial]
    torch_opt = make_torch_optimizer(spec, torch_params)
    tf_vars = [tf.Variable(a.copy()) for a in initial]
    tf_opt = make_optimizer(spec, tf_vars)
    apply = tf.function(lambda grads, scalars: tf_opt.apply(tf_vars, grads, scalars))
    for step in range(6):
        lr = spec.lr * (1 + step) / 6  # a schedule: the learning rate changes every step
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        for p, g in zip(torch_params, grads):
            p.grad = torch.from_numpy(g.copy())
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        apply([tf.constant(g) for g in grads], tf.constant(tf_opt.scalars(lr), tf.float32))
        for p, v in zip(torch_params, tf_vars):
            np.testing.assert_allclose(v.numpy(), p.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=f"step {step}")
    for i, p in enumerate(torch_params):  # the state, under torch.optim's own keys
        torch_state = {k: np.asarray(v) for k, v in torch_opt.state[p].items()}
        mine = tf_opt.slots(i)
        assert set(mine) == set(torch_state)
        for key in mine:
            np.testing.assert_allclose(mine[key], torch_state[key], rtol=1e-6, atol=1e-7, err_msg=key)
