"""``backend: ddp`` asked for in one process trains (DDP needs a process group even then) like ``local``."""

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from safetensors.numpy import load_file  # noqa: E402

from polytrain import validation  # noqa: E402
from polytrain.train.trainer import Trainer  # noqa: E402
from polytrain.world import World  # noqa: E402


@pytest.mark.slow
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


def test_started_all_reduce_runs_on_its_own_copy_while_others_run() -> None:
    """`start_all_reduce` (the logging window's sums): a real gloo collective begun now and finished by the call;
    the caller may change or reuse its array meanwhile (the Trainer resets the window) and run other collectives
    before finishing it."""
    from polytrain.adapters.torch.backend import TorchBackend

    backend = TorchBackend(validation.from_dict({"backend": "local"}), World())
    backend.ensure_process_group()
    try:
        window = np.array([3.5, 64.0])
        finish = backend.start_all_reduce(window)
        window[:] = 0  # reset before the collective is finished
        np.testing.assert_array_equal(backend.all_reduce(np.array([2.0])), [2.0])  # another one meanwhile
        np.testing.assert_array_equal(finish(), [3.5, 64.0])
    finally:
        backend.teardown()


def test_training_mode_is_set_only_when_a_step_finds_the_model_elsewhere(tmp_path: Path) -> None:
    """The micro-step puts the model in training mode when evaluation (or the user) left it in eval mode, and
    does not walk the modules when it is training already (a submodule the user froze in eval mode stays so,
    as under Lightning)."""
    import torch

    from polytrain.adapters.torch.framework import TorchFramework
    from polytrain.adapters.torch.local import LocalBackend
    from polytrain.data import load_dataset
    from polytrain.protocols import UserCode
    from polytrain.spec.tables import DataSpec

    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 10)).eval()
    spec = validation.from_dict({"backend": "local", "output": str(tmp_path)})
    backend = LocalBackend(spec, World())
    backend.setup()
    framework = TorchFramework(spec, World(), backend, UserCode(model=model))
    data = load_dataset(DataSpec(batch_size=8), seed=0)
    framework.build(data.info)
    x, y = data.x_train[:8], data.y_train[:8]
    framework.train_micro_step(x, y, 1 / 8, sync=True)  # given in eval mode: trained in training mode
    assert all(module.training for module in model.modules())
    framework.evaluate(x, y)
    assert not any(module.training for module in model.modules())
    framework.train_micro_step(x, y, 1 / 8, sync=True)
    assert all(module.training for module in model.modules())
    model[1].eval()  # frozen by the user between steps: left so
    framework.train_micro_step(x, y, 1 / 8, sync=True)
    assert not model[1].training and model.training
