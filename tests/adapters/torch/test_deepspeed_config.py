"""The DeepSpeed config polytrain generates from a spec, and the spec rules of the deepspeed table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from polytrain import validation  # noqa: E402
from polytrain.adapters.torch.deepspeed import deepspeed_config, merge  # noqa: E402
from polytrain.errors import SpecError  # noqa: E402
from polytrain.spec import tables as spec_mod  # noqa: E402


def make(**raw) -> spec_mod.TrainSpec:
    return validation.from_dict({"backend": "deepspeed", **raw}, validate_components=False)


def test_batch_accumulation_and_clipping_come_from_the_spec() -> None:
    spec = make(data={"batch_size": 12}, loop={"grad_accum_steps": 3, "grad_clip_norm": 0.7})
    config = deepspeed_config(spec, world_size=4, on_gpu=False)
    assert config["train_micro_batch_size_per_gpu"] == 12
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 12 * 3 * 4
    assert config["gradient_clipping"] == 0.7
    assert config["zero_optimization"] == {"stage": 2}


def test_clipping_is_pinned_off_when_the_spec_has_none() -> None:
    config = deepspeed_config(make(), world_size=2, on_gpu=False)
    assert "gradient_clipping" in config and config["gradient_clipping"] == 0.0


def test_global_batch_size_sets_the_micro_batch() -> None:
    spec = make(data={"global_batch_size": 96}, loop={"grad_accum_steps": 2})
    config = deepspeed_config(spec, world_size=4, on_gpu=False)
    assert config["train_micro_batch_size_per_gpu"] == 12
    assert config["train_batch_size"] == 96  # the Trainer's global batch, exactly


def test_a_global_batch_deepspeed_cannot_take_exactly_is_refused() -> None:
    """DeepSpeed's train_batch_size must be micro × accumulation × world: 100 samples on 4 ranks × 2
    micro-steps has no such split, and rounding up would make DeepSpeed count 104 (issue 16 item 11)."""
    spec = make(data={"global_batch_size": 100}, loop={"grad_accum_steps": 2})
    with pytest.raises(SpecError) as info:
        deepspeed_config(spec, world_size=4, on_gpu=False)
    assert str(info.value) == ("data.global_batch_size: 100 must be a multiple of world size × loop.grad_accum_steps "
                               "= 4 × 2 = 8 on backend deepspeed (DeepSpeed's train_batch_size is micro-batch × "
                               "accumulation × world size)")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_precision_sections_are_explicit(precision: str) -> None:
    config = deepspeed_config(make(precision=precision), world_size=2, on_gpu=True)
    assert config["bf16"] == {"enabled": precision == "bf16"}
    fp16 = config["fp16"]
    assert fp16["enabled"] is (precision == "fp16")
    # dynamic scaling with GradScaler's settings, written out rather than left to DeepSpeed's defaults
    assert (fp16["loss_scale"], fp16["initial_scale_power"], fp16["loss_scale_window"], fp16["hysteresis"]) == \
        (0, 16, 2000, 1)


def test_polytrains_optimizer_is_accepted_by_zero_even_with_offload() -> None:
    spec = make(deepspeed={"stage": 3, "offload_optimizer": True, "offload_param": True})
    config = deepspeed_config(spec, world_size=2, on_gpu=False)
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                           "offload_param": {"device": "cpu", "pin_memory": False}}
    assert config["zero_allow_untested_optimizer"] is True
    assert config["zero_force_ds_cpu_optimizer"] is False
    assert "optimizer" not in config and "scheduler" not in config
    gpu = deepspeed_config(spec, world_size=2, on_gpu=True)
    assert gpu["zero_optimization"]["offload_param"]["pin_memory"] is True


def test_nvme_offload_writes_under_the_jobs_own_folder_with_the_aio_table(tmp_path) -> None:
    """ZeRO-Infinity: device nvme, the path a folder of this job's own under nvme_path (one per output directory),
    and the aio table from deepspeed.aio, with DeepSpeed's names."""
    from polytrain.adapters.torch.zero_infinity import job_folder

    nvme = {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": str(tmp_path),
            "aio": {"block_size": 262144, "queue_depth": 4}}
    spec = make(output=str(tmp_path / "out"), deepspeed=nvme)
    config = deepspeed_config(spec, world_size=2, on_gpu=False)
    folder = str(job_folder(spec))
    assert folder.startswith(f"{tmp_path}/polytrain-")
    assert config["zero_optimization"] == {
        "stage": 3, "offload_optimizer": {"device": "nvme", "pin_memory": False, "nvme_path": folder},
        "offload_param": {"device": "nvme", "pin_memory": False, "nvme_path": folder}}
    assert config["aio"] == {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 1,
                             "single_submit": False, "overlap_events": True}
    other = make(output=str(tmp_path / "other"), deepspeed=nvme)
    assert job_folder(other) != job_folder(spec)  # two jobs on one drive never share files
    mixed = make(deepspeed={"stage": 3, "offload_optimizer": "nvme", "offload_param": "cpu",
                            "nvme_path": str(tmp_path)})
    zero = deepspeed_config(mixed, world_size=2, on_gpu=False)["zero_optimization"]
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False} and zero["offload_optimizer"]["device"] \
        == "nvme"
    assert "aio" not in deepspeed_config(make(deepspeed={"stage": 3, "offload_optimizer": "cpu"}), 2, False)


def test_overrides_merge_table_by_table_and_replace_anything_else() -> None:
    spec = make(deepspeed={"stage": 1, "config": {
        "zero_optimization": {"reduce_bucket_size": 1000, "stage": 1},  # repeating an owned key's value is fine
        "bf16": {"enabled": False}, "steps_per_print": 10, "new_key": [1, 2]}})
    config = deepspeed_config(spec, world_size=2, on_gpu=False)
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 1000}
    assert config["bf16"] == {"enabled": False}
    assert config["steps_per_print"] == 10
    assert config["new_key"] == [1, 2]
    json.dumps(config)  # what rank 0 writes to <output>/deepspeed_config.json


@pytest.mark.parametrize(("raw", "message"), [
    ({"deepspeed": {"stage": 1, "config": {"zero_optimization": {"stage": 3}}}},
     "deepspeed.config.zero_optimization.stage: 3 disagrees with deepspeed.stage (1); the spec owns it: set "
     "deepspeed.stage instead"),
    ({"loop": {"grad_accum_steps": 2}, "deepspeed": {"config": {"gradient_accumulation_steps": 4}}},
     "deepspeed.config.gradient_accumulation_steps: 4 disagrees with loop.grad_accum_steps (2)"),
    ({"deepspeed": {"config": {"gradient_clipping": 2.5}}},
     "deepspeed.config.gradient_clipping: 2.5 disagrees with loop.grad_clip_norm (0.0)"),
    ({"deepspeed": {"config": {"bf16": {"enabled": True}}}}, "deepspeed.config.bf16.enabled: True disagrees with "
     "precision (False)"),
    ({"precision": "fp16", "deepspeed": {"stage": 0, "config": {"fp16": {"enabled": False}}}},
     "deepspeed.config.fp16.enabled: False disagrees with precision (True)"),
    ({"deepspeed": {"config": {"zero_optimization": {"stage": True}}}},
     "deepspeed.config.zero_optimization.stage: True disagrees with deepspeed.stage (2)"),
    ({"deepspeed": {"stage": 2, "config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}}},
     "deepspeed.config.zero_optimization.offload_optimizer: set deepspeed.offload_optimizer: true instead"),
    ({"deepspeed": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": "/x", "config": {
        "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}}},
     "deepspeed.config.zero_optimization.offload_optimizer.device: 'cpu' disagrees with deepspeed.offload_optimizer "
     "('nvme')"),
    ({"deepspeed": {"stage": 3, "offload_param": True, "config": {
        "zero_optimization": {"offload_param": {"nvme_path": "/y"}}}}},
     "deepspeed.config.zero_optimization.offload_param.nvme_path: '/y' disagrees with deepspeed.nvme_path (None)"),
])
def test_keys_the_spec_owns_cannot_be_overridden(raw: dict, message: str) -> None:
    """deepspeed.config is merged last; without this, it could change the stage, accumulation or precision
    behind the spec's checks (issue 16 item 10)."""
    with pytest.raises(SpecError) as info:
        make(**raw)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize(("key", "value", "field"), [("train_micro_batch_size_per_gpu", 8, "data.batch_size (32)"),
                                                     ("train_batch_size", 8, "data.global_batch_size (64)")])
def test_batch_keys_must_agree_with_the_trainer(key: str, value: int, field: str) -> None:
    spec = make(data={"batch_size": 32}, deepspeed={"config": {key: value}})
    with pytest.raises(SpecError, match=f"^deepspeed.config.{key}: {value} disagrees with {field}".replace(".", r"\.")
                       .replace("(", r"\(").replace(")", r"\)")):
        deepspeed_config(spec, world_size=2, on_gpu=False)
    assert deepspeed_config(make(data={"batch_size": 32}, deepspeed={"config": {"train_batch_size": 64}}),
                            world_size=2, on_gpu=False)["train_batch_size"] == 64


def test_merge_does_not_modify_its_inputs() -> None:
    base = {"a": {"b": 1}}
    merged = merge(base, {"a": {"c": 2}})
    assert merged == {"a": {"b": 1, "c": 2}} and base == {"a": {"b": 1}}


@pytest.mark.parametrize(("raw", "message"), [
    ({"deepspeed": {"stage": 2, "offload_param": True}}, "deepspeed.offload_param: needs deepspeed.stage 3"),
    ({"deepspeed": {"stage": 0, "offload_optimizer": True}}, "deepspeed.offload_optimizer: needs deepspeed.stage"),
    ({"deepspeed": {"stage": 4}}, "deepspeed.stage: 4 is not allowed"),
    ({"deepspeed": {"config": {"optimizer": {"type": "Adam"}}}}, "deepspeed.config.optimizer: not allowed"),
    ({"deepspeed": {"config": {"scheduler": {}}}}, "deepspeed.config.scheduler: not allowed"),
    ({"deepspeed": {"config": [1]}}, "deepspeed.config: expected a table"),
    # ZeRO-Infinity (issue 35)
    ({"deepspeed": {"stage": 2, "offload_optimizer": "nvme", "nvme_path": "/x"}},
     "deepspeed.offload_optimizer: nvme needs deepspeed.stage 3, not 2"),
    ({"deepspeed": {"stage": 3, "offload_param": "nvme"}}, "deepspeed.nvme_path: required with "
     "deepspeed.offload_param: nvme"),
    ({"deepspeed": {"stage": 3, "offload_optimizer": "cpu", "nvme_path": "/x"}}, "deepspeed.nvme_path: only used "
     "with deepspeed.offload_optimizer or offload_param: nvme"),
    ({"deepspeed": {"stage": 3, "aio": {"queue_depth": 4}}}, "deepspeed.aio: only used with"),
    ({"deepspeed": {"stage": 3, "offload_optimizer": "disk"}}, "deepspeed.offload_optimizer: 'disk' is not allowed"),
    ({"deepspeed": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": "/x", "aio": {"block_size": 100}}},
     "deepspeed.aio.block_size: 100 is out of range"),
    ({"deepspeed": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": "/x", "config": {"aio": {}}}},
     "deepspeed.config.aio: set deepspeed.aio instead"),
])
def test_bad_deepspeed_tables_name_the_field(raw: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message.replace(".", r"\.")) as info:
        make(**raw)
    assert "\n" not in str(info.value)


def test_deepspeed_table_needs_backend_deepspeed() -> None:
    with pytest.raises(SpecError, match="deepspeed: only used with backend 'deepspeed', not 'ddp'"):
        validation.from_dict({"backend": "ddp", "deepspeed": {"stage": 3}}, validate_components=False)


def test_skipping_nonfinite_steps_needs_zero_stage_0() -> None:
    with pytest.raises(SpecError, match="reliability.on_nonfinite: 'skip' needs deepspeed.stage 0"):
        make(deepspeed={"stage": 2}, reliability={"on_nonfinite": "skip"})
    assert make(deepspeed={"stage": 0}, reliability={"on_nonfinite": "skip"}).deepspeed.stage == 0


@pytest.mark.timeout(120)
def test_deepspeed_is_imported_without_mlflow_which_stays_importable() -> None:
    """DeepSpeed's autotuner imports MLflow when it is installed (~2 s of CPU in every rank; polytrain never runs
    the autotuner): the backend's import leaves it out, and a tracker's later ``import mlflow`` still works."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("mlflow")
    code = ("import sys; from polytrain.adapters.torch.deepspeed import _import_deepspeed; ds = _import_deepspeed(); "
            "print('mlflow' in sys.modules, ds.__name__); import mlflow; print(mlflow.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "deepspeed", "mlflow"]
