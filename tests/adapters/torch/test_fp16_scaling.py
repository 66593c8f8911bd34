"""fp16 dynamic loss scaling in the torch adapter (one process): an overflow skips the update and is counted."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polytrain import validation  # noqa: E402
from polytrain.adapters.torch.backend import check_fp16_runs  # noqa: E402
from polytrain.adapters.torch.framework import TorchFramework  # noqa: E402
from polytrain.adapters.torch.local import LocalBackend  # noqa: E402
from polytrain.data.source import DatasetInfo  # noqa: E402
from polytrain.world import World  # noqa: E402


def framework(precision: str) -> TorchFramework:
    spec = validation.from_dict({"precision": precision, "model": {"params": {"hidden_sizes": [8]}}})
    backend = LocalBackend(spec, World())
    backend.setup()
    fw = TorchFramework(spec, World(), backend)
    fw.build(DatasetInfo(input_shape=(4,), num_outputs=3, task="classification"))
    return fw


def weights(fw: TorchFramework) -> dict[str, np.ndarray]:
    return fw.export_state()


def test_overflow_skips_the_update_and_halves_the_scale(capsys: pytest.CaptureFixture[str]) -> None:
    check_fp16_runs(torch.device("cpu"))
    fw = framework("fp16")
    y = np.array([0, 1], dtype=np.int64)
    start, scale = weights(fw), fw.loss_scale()
    fw.train_micro_step(np.full((2, 4), 1e6, dtype=np.float32), y, 0.5, sync=True)  # inf in fp16
    fw.optimizer_step(0.1, clip_norm=1.0)
    after = weights(fw)
    assert all(np.array_equal(start[k], after[k]) for k in start), "an overflowing step changed the weights"
    assert fw.loss_scale() == scale / 2
    assert fw.step_stats() == {"skipped_steps": 1.0, "loss_scale": scale / 2}
    assert "fp16 gradient overflow in update 1 of this run: skipped (1 so far)" in capsys.readouterr().err

    fw.train_micro_step(np.ones((2, 4), dtype=np.float32), y, 0.5, sync=True)
    fw.optimizer_step(0.1, clip_norm=None)
    assert not all(np.array_equal(after[k], v) for k, v in weights(fw).items())
    assert fw.step_stats()["skipped_steps"] == 1.0 and fw.updates == 2


def test_gradients_reach_the_optimizer_unscaled() -> None:
    """The scaled and the fp32 run take the same step (up to fp16 rounding of the forward pass)."""
    x, y = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), np.array([0, 1, 2, 0])
    results = []
    for precision in ("fp32", "fp16"):
        fw = framework(precision)
        start = weights(fw)
        fw.train_micro_step(x, y, 0.25, sync=True)
        fw.optimizer_step(0.1, clip_norm=None)
        results.append({k: v - start[k] for k, v in weights(fw).items()})
    for key in results[0]:
        np.testing.assert_allclose(results[1][key], results[0][key], rtol=0.02, atol=1e-4, err_msg=key)


def test_other_precisions_have_no_scaler() -> None:
    for precision in ("fp32", "bf16"):
        fw = framework(precision)
        assert fw.scaler is None and fw.loss_scale() is None and fw.step_stats() == {}
