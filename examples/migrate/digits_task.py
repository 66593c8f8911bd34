"""What every migration example shares, so that an original and its polytrain version can be compared number
for number: the data (scikit-learn's handwritten digits), the model, the settings, and the result file.

Every script trains the same problem: 512 training samples, 2 epochs of 16 optimizer steps, each step over a
global batch of 32 samples (on 2 ranks: 16 each), SGD with momentum, gradients clipped at a norm of 1.0 (the
PyTorch scripts: `datasets`, `make_model`; the Keras pair builds its own model from `digits`).
Each writes, from rank 0, a JSON file: every optimizer step's loss (the mean over the global batch), the
gradient norm before clipping, and the final weights (and, where the script evaluates, the validation
accuracy over the 101 held-out samples and how many predictions it was computed from).
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import numpy as np

SEED = 0
EPOCHS = 2
TRAIN_SAMPLES, VAL_SAMPLES = 512, 101  # 101: an uneven split over 2 ranks, the case gather_for_metrics fixes
GLOBAL_BATCH = 32  # samples per optimizer step, over all ranks
LR, MOMENTUM, CLIP = 0.1, 0.9, 1.0


def digits() -> tuple[np.ndarray, np.ndarray]:
    """`sklearn.datasets.load_digits()`'s arrays (pixels scaled to [0, 1], labels), read from the file
    scikit-learn ships (importing scikit-learn itself costs seconds in every process)."""
    root = importlib.util.find_spec("sklearn").submodule_search_locations[0]
    table = np.loadtxt(os.path.join(root, "datasets", "data", "digits.csv.gz"), delimiter=",")
    return table[:, :-1] / 16.0, table[:, -1].astype(np.int64)


def datasets() -> tuple[Any, Any]:
    """The training set (the first 512 digits) and the validation set (the next 101), as torch datasets."""
    import torch
    from torch.utils.data import TensorDataset

    x, y = digits()
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    end = TRAIN_SAMPLES + VAL_SAMPLES
    return TensorDataset(x[:TRAIN_SAMPLES], y[:TRAIN_SAMPLES]), TensorDataset(x[TRAIN_SAMPLES:end],
                                                                            y[TRAIN_SAMPLES:end])


def make_model() -> Any:
    """The torch model, with the same initial weights in every script and on every rank."""
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def write_result(path: str, losses: list[float], norms: list[float], state: dict[str, Any],
                 **extra: Any) -> None:
    """Write what a run is compared by: per-step losses and gradient norms, the final weights (a state dict of
    torch tensors or numpy arrays)."""
    weights = {name: np.asarray(value.detach().cpu() if hasattr(value, "detach") else value).ravel().tolist()
               for name, value in state.items()}
    with open(path, "w") as f:
        json.dump({"losses": losses, "norms": norms, "weights": weights, **extra}, f)
