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


def test_all_reduce_hands_gloo_memory_torch_owns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Trainer's all_reduce gives gloo a copy torch owns, never a view of the caller's numpy array: gloo's
    worker thread may drop the last reference after the collective returns, and freeing numpy memory needs the
    GIL, which the main thread can hold while it frees the process group (a hang at exit, ~1 run in 100)."""
    import torch.distributed as dist

    from polytrain.adapters.torch.backend import TorchBackend

    backend = TorchBackend(validation.from_dict({"backend": "local"}), World())
    backend.ensure_process_group()
    given, seen = np.array([1.0, 2.0]), []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, **kw: (seen.append(tensor), real(tensor, **kw))[1])
    try:
        np.testing.assert_array_equal(backend.all_reduce(given), given)  # a real one-rank gloo all-reduce
    finally:
        backend.teardown()
    (tensor,) = seen
    assert tensor.data_ptr() != given.ctypes.data
    assert not np.shares_memory(tensor.numpy(), given)
