"""Gradient averaging is exact: 2 ranks × b ≡ 1 process × 2b ≡ 1 process × (2 micro-steps of b)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from procs import trained_run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

COMMON = ["data.name=digits", "optimizer.name=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9",
          "schedule.lr_scaling=none", "loop.epochs=1", "loop.max_steps=25", "loop.log_every_n_steps=1",
          "model.params.hidden_sizes=[64, 32]"]


def trained(out: Path, *, nproc: int, batch: int, accum: int, extra: list[str] = ()) -> tuple[np.ndarray, dict]:
    sets = [*COMMON, f"data.batch_size={batch}", f"loop.grad_accum_steps={accum}", *extra]
    run = trained_run(out, sets, nproc=nproc, quiet=False)
    assert len(set(run.manifest["rank_state_digests"])) == 1
    return run.losses, run.state


@pytest.mark.parametrize("extra", [[], ["loop.grad_clip_norm=0.5", "optimizer.name=adam", "optimizer.lr=0.01",
                                        "optimizer.momentum=0.0"]], ids=["sgd", "adam+clip"])
def test_two_ranks_equal_one_process_with_double_batch(tmp_path: Path, extra: list[str]) -> None:
    ddp_losses, ddp_state = trained(tmp_path / "ddp", nproc=2, batch=16, accum=1, extra=extra)
    big_losses, big_state = trained(tmp_path / "big", nproc=1, batch=32, accum=1, extra=extra)
    acc_losses, acc_state = trained(tmp_path / "acc", nproc=1, batch=16, accum=2, extra=extra)
    assert len(ddp_losses) == len(big_losses) == len(acc_losses) == 25
    np.testing.assert_allclose(ddp_losses, big_losses, rtol=1e-5)
    np.testing.assert_allclose(acc_losses, big_losses, rtol=1e-5)
    assert ddp_losses[-1] < ddp_losses[0]  # it learned something
    for name in big_state:
        np.testing.assert_allclose(ddp_state[name], big_state[name], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(acc_state[name], big_state[name], rtol=1e-5, atol=1e-6, err_msg=name)
