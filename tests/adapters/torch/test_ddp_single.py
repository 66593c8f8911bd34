"""``backend: ddp`` asked for in one process trains (DDP needs a process group even then) like ``local``."""

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from safetensors.numpy import load_file  # noqa: E402

from polytrain import validation  # noqa: E402
from polytrain.trainer import Trainer  # noqa: E402
from polytrain.world import World  # noqa: E402


def test_ddp_in_one_process_equals_local(tmp_path: Path) -> None:
    weights = {}
    for backend in ("local", "ddp"):
        spec = validation.from_dict({"backend": backend, "loop": {"epochs": 1}, "output": str(tmp_path / backend)})
        result = Trainer(spec, World(), show_progress=False).fit()
        assert result.global_step == 45
        weights[backend] = load_file(str(tmp_path / backend / "model.safetensors"))
    assert weights["local"].keys() == weights["ddp"].keys()
    for name, value in weights["local"].items():
        np.testing.assert_array_equal(weights["ddp"][name], value, err_msg=name)
