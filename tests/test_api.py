"""polytrain.fit in one process: a script's live model, data, loss, metrics and callbacks (multi-process
runs of the same API under torchrun and mpirun live in tests/multiproc)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procs import read_metrics

import polytrain
from polytrain.callbacks import Callback
from polytrain.errors import SpecError

torch = pytest.importorskip("torch")


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)


def small_net() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def my_loss(out: Any, y: Any) -> Any:
    return torch.nn.functional.cross_entropy(out, y, reduction="none")


def errors(out: Any, y: Any) -> Any:
    return (out.argmax(1) != y).float()


SPEC = {"loop": {"epochs": 4}, "optimizer": {"name": "adam", "lr": 0.01}, "data": {"batch_size": 32}}


@pytest.mark.slow
def test_fit_trains_a_live_model_on_arrays_with_its_own_loss_and_metrics(tmp_path: Path) -> None:
    seen: list[int] = []

    class Steps(Callback):
        def on_step_end(self, run: Any, step: int, logs: Any) -> None:
            seen.append(step)

    x, y = digits()
    net = small_net()
    result = polytrain.fit({**SPEC, "output": str(tmp_path)}, model=net, train_data=(x, y), loss=my_loss,
                           metrics=["accuracy", errors], callbacks=[Steps()], show_progress=False)
    assert result.val_accuracy >= 0.93
    assert result.val_metrics["errors"] == pytest.approx(1 - result.val_accuracy)
    assert seen == list(range(1, result.global_step + 1)) and result.global_step == 4 * 45
    saved = json.loads((tmp_path / "model.json").read_text())
    assert saved["spec"]["model"]["name"] == "fit:Sequential" and saved["spec"]["loss"] == "fit:my_loss"
    assert saved["spec"]["metrics"] == ["accuracy", "fit:errors"]
    from safetensors.numpy import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    np.testing.assert_array_equal(weights["0.weight"], net[0].weight.detach().numpy())  # the caller's own model


@pytest.mark.slow
def test_fit_takes_a_map_style_dataset_and_separate_validation_data(tmp_path: Path) -> None:
    x, y = digits()

    class Pairs:
        def __init__(self, rows: slice) -> None:
            self.x, self.y = torch.from_numpy(x[rows]), torch.from_numpy(y[rows])

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            return self.x[i], self.y[i]

    result = polytrain.fit({**SPEC, "output": str(tmp_path)}, model=small_net(), train_data=Pairs(slice(0, 1500)),
                           val_data=Pairs(slice(1500, None)), show_progress=False)
    assert result.val_accuracy >= 0.85  # the last 297 digits (other writers than most of the first 1500)
    epochs = read_metrics(tmp_path, "epoch")
    assert len(epochs) == 4 and result.global_step == 4 * 47  # 1500 samples in batches of 32, none held out


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"val_data": "x"}, "val_data: given without train_data; pass both, or neither to use the spec's data"),
    ({"train_data": 3}, "train_data: expected (x, y) numpy arrays or a map-style dataset (__len__, __getitem__), "
                        "got a int"),
    ({"metrics": [3]}, "metrics[0]: expected a metric name or a function, got int"),
    ({"loss": 3}, "loss: expected a loss name or a function, got int"),
    ({"loss": "hinge"}, "loss: 'hinge' is not a built-in loss"),
    ({"model": "not a model"}, "model: expected a torch.nn.Module for framework 'torch', got str"),
    ({"train_data": (np.zeros((4, 64), np.float32), np.array([0, 1, -1, 2]))},
     "train_data: class labels must be 0 or more, found -1..2"),
])
def test_bad_arguments_are_the_spec_errors(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        polytrain.fit({**SPEC, "output": str(tmp_path)}, show_progress=False, **kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_the_spec_is_validated_as_a_file_is(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("optimizer: {lr: -1}\n")
    with pytest.raises(SpecError, match=r"^optimizer.lr: -1.0 is out of range \(must be > 0.0\)$"):
        polytrain.fit(spec, model=small_net(), train_data=digits())
