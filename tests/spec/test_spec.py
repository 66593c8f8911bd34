"""TrainSpec loading and validation: every bad input is a one-line error naming the field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from polytrain import validation
from polytrain.errors import SpecError

BAD = [
    # (raw spec, text the message must contain)
    ({"framwork": "torch"}, "framwork: unknown field (did you mean 'framework'?)"),
    ({"framework": "jax"}, "framework: 'jax' is not allowed (allowed: torch, tensorflow)"),
    ({"backend": "nccl"}, "backend: 'nccl' is not available for framework 'torch'"),
    ({"backend": 3}, "backend: expected a non-empty string"),
    ({"seed": -1}, "seed: -1 is out of range (must be >= 0)"),
    ({"seed": "0"}, "seed: expected an integer"),
    ({"precision": "fp8"}, "precision: 'fp8' is not allowed"),
    ({"model": {"name": "resnet"}}, "model.name: unknown model 'resnet'"),
    ({"model": {"name": "mlp", "params": {"hidden": [3]}}}, "model.params.hidden: unknown field (did you mean 'hidden_sizes'?)"),
    ({"model": {"name": "mlp", "params": {"hidden_sizes": []}}}, "model.params.hidden_sizes: expected a non-empty list"),
    ({"model": {"name": "mlp", "params": {"hidden_sizes": [0]}}}, "model.params: sizes must be >= 1"),
    ({"model": {"name": "mlp", "params": {"activation": "swish"}}}, "model.params.activation: 'swish' is not allowed"),
    ({"model": {"name": "convnet", "params": {"kernel_size": 4}}}, "model.params.kernel_size: 4 is not allowed"),
    ({"model": {"name": "nosuchmodule_xyz:make"}}, "model.name: cannot import module 'nosuchmodule_xyz'"),
    ({"model": "mlp"}, "model: expected a table of name, params"),
    ({"data": {"name": "mnist"}}, "data.name: 'mnist' is not allowed (allowed: digits, synthetic, npz, tokens, parquet, csv, images, "
     "token_file, dataset)"),
    ({"data": {"batch_size": 0}}, "data.batch_size: 0 is out of range (must be >= 1)"),
    ({"data": {"batch_size": 2.5}}, "data.batch_size: expected an integer"),
    ({"data": {"val_fraction": 0.95}}, "data.val_fraction: 0.95 is out of range (must be <= 0.9)"),
    ({"data": {"name": "npz"}}, "data.path: required when data.name is 'npz'"),
    ({"data": {"name": "npz", "path": "/nonexistent/x.npz"}}, "data.path: file not found"),
    ({"data": {"name": "digits", "path": "x.npz"}}, "data.path: only used with data.name npz, parquet, csv, images, token_file, not 'digits'"),
    ({"data": {"synthetic": {"task": "ranking"}}}, "data.synthetic.task: 'ranking' is not allowed"),
    ({"horovod": {"compression": "fp16"}}, "horovod: only used with backend 'horovod', not 'auto'"),
    ({"backend": "horovod", "horovod": {"compression": "int8"}},
     "horovod.compression: 'int8' is not allowed (allowed: none, fp16)"),
    ({"optimizer": {"name": "lamb"}}, "optimizer.name: 'lamb' is not allowed (allowed: sgd, adam, adamw)"),
    ({"optimizer": {"lr": 0}}, "optimizer.lr: 0.0 is out of range (must be > 0.0)"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr: expected a number"),
    ({"optimizer": {"momentum": 1.5}}, "optimizer.momentum: 1.5 is out of range (must be <= 1.0)"),
    ({"optimizer": {"name": "adam", "nesterov": True}}, "optimizer.nesterov: needs optimizer.name 'sgd'"),
    ({"optimizer": {"name": "adam", "betas": [0.9]}}, "optimizer.betas: expected a list of 2 numbers"),
    ({"optimizer": {"name": "adam", "betas": [0.9, 1.0]}}, "optimizer.betas[1]: 1.0 is out of range"),
    ({"optimizer": {"nesterov": "yes"}}, "optimizer.nesterov: expected true or false"),
    ({"schedule": {"lr_scaling": "cubic"}}, "schedule.lr_scaling: 'cubic' is not allowed (allowed: linear, sqrt, none)"),
    ({"schedule": {"decay": "exp"}}, "schedule.decay: 'exp' is not allowed"),
    ({"schedule": {"warmup_epochs": 20}, "loop": {"epochs": 5}}, "schedule.warmup_epochs: 20.0 exceeds loop.epochs 5"),
    ({"schedule": {"min_lr": 1.0}}, "schedule.min_lr: 1.0 must be below optimizer.lr"),
    ({"loop": {"epochs": 0}}, "loop.epochs: 0 is out of range (must be >= 1)"),
    ({"loop": {"grad_accum_steps": -2}}, "loop.grad_accum_steps: -2 is out of range"),
    ({"loop": {"grad_clip_norm": 0}}, "loop.grad_clip_norm: 0.0 is out of range (must be > 0.0)"),
    ({"loop": {"max_steps": 0}}, "loop.max_steps: 0 is out of range (must be >= 1)"),
    ({"loop": {"epoch": 3}}, "loop.epoch: unknown field (did you mean 'epochs'?)"),
    # two metrics logged under one key would overwrite each other's values (issue 26)
    ({"metrics": ["json:loads", "pickle:loads"]},
     "metrics[1]: 'pickle:loads' would be logged as val_loads, like metrics[0] 'json:loads'; give each metric "
     "function its own name"),
    ({"metrics": ["accuracy", "fit:accuracy"]}, "metrics[1]: 'fit:accuracy' would be logged as val_accuracy, like "
     "metrics[0] 'accuracy'"),
    ({"metrics": ["fit:loss"]}, "metrics[0]: 'fit:loss' would be logged as val_loss, the validation loss's key"),
    ({"data": {"name": "images", "path": ".", "image_size": [-4, 8]}},
     "data.image_size[0]: -4 is out of range (must be 1..16384 pixels)"),
    ({"data": {"name": "images", "path": ".", "image_size": [8, 0]}}, "data.image_size[1]: 0 is out of range"),
    ({"data": {"name": "images", "path": ".", "image_size": [8, 100000]}}, "data.image_size[1]: 100000 is out of range"),
    ({"data": {"name": "csv", "path": ".", "features": ["a", "y"], "label": "y"}},
     "data.features: 'y' is also data.label; the model would be given its own target (leave it out of data.features)"),
]


@pytest.mark.parametrize("raw,message", BAD, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(BAD)])
def test_bad_spec_is_one_line_naming_the_field(raw: dict, message: str) -> None:
    with pytest.raises(SpecError) as info:
        validation.from_dict(raw)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_fp16_is_rejected_where_the_backend_has_no_loss_scaling() -> None:
    with pytest.raises(SpecError, match="precision: 'fp16' is not supported on backend 'mpi'"):
        validation.from_dict({"backend": "mpi", "precision": "fp16"})


def test_defaults_and_types() -> None:
    s = validation.from_dict({"optimizer": {"name": "adam", "lr": 1}, "model": {"params": {"hidden_sizes": [8]}}})
    assert s.optimizer.lr == 1.0 and isinstance(s.optimizer.lr, float)
    assert s.optimizer.betas == (0.9, 0.999)
    assert s.loop.epochs == 10 and s.backend == "auto" and s.framework == "torch"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 3  # frozen


def test_yaml_toml_json_give_the_same_spec(tmp_path) -> None:
    (tmp_path / "a.yaml").write_text("optimizer:\n  name: adam\n  lr: 0.01\nloop: {epochs: 3}\n")
    (tmp_path / "a.toml").write_text("[optimizer]\nname = 'adam'\nlr = 0.01\n[loop]\nepochs = 3\n")
    (tmp_path / "a.json").write_text('{"optimizer": {"name": "adam", "lr": 0.01}, "loop": {"epochs": 3}}')
    specs = [validation.load(tmp_path / f"a.{ext}") for ext in ("yaml", "toml", "json")]
    assert specs[0] == specs[1] == specs[2]
    assert specs[0].digest() == specs[2].digest()


def test_overrides_parse_yaml_values() -> None:
    s = validation.load(None, ["optimizer.lr=0.2", "model.params.hidden_sizes=[4, 5]", "loop.grad_clip_norm=1"])
    assert s.optimizer.lr == 0.2 and s.model.params["hidden_sizes"] == [4, 5] and s.loop.grad_clip_norm == 1.0
    with pytest.raises(SpecError, match="--set 'optimizer.lr': expected KEY=VALUE"):
        validation.load(None, ["optimizer.lr"])


@pytest.mark.parametrize("text,suffix,message", [
    ("a: [1, 2\n", ".yaml", "cannot parse YAML"),
    ("[loop\n", ".toml", "cannot parse TOML"),
    ("{", ".json", "cannot parse JSON"),
    ("- 1\n- 2\n", ".yaml", "spec: expected a table at the top level"),
])
def test_bad_files(tmp_path, text: str, suffix: str, message: str) -> None:
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(SpecError, match=message):
        validation.load(path)


def test_unknown_file_type(tmp_path) -> None:
    with pytest.raises(SpecError, match="unknown file type"):
        validation.load(tmp_path / "spec.ini")


def test_cli_bad_spec_exit_code_2_one_line_no_traceback(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("optimizer: {name: lamb}\n")
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "train", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == ["polytrain: error: optimizer.name: 'lamb' is not allowed (allowed: sgd, adam, adamw)"]
    bad_flag = subprocess.run([sys.executable, "-m", "polytrain.cli", "train", "--sett", "x=1"],
                              capture_output=True, text=True, timeout=60)
    assert bad_flag.returncode == 2 and len(bad_flag.stderr.strip().splitlines()) == 1
    assert "--sett" in bad_flag.stderr


def test_model_digest_of_older_checkpoints_still_matches() -> None:
    """Checkpoints written before the file-source fields existed record these digests (computed with the
    code of 4e840f7); a spec that sets none of the new fields must match them, or --resume would refuse."""
    assert validation.from_dict({}).model_digest() == "57810a94a17734a1"
    tokens = {"data": {"name": "tokens"}, "model": {"name": "transformer"}}
    assert validation.from_dict(tokens).model_digest() == "bfd7d9bff36a1483"
    reading = validation.from_dict({"data": {"workers": 0, "prefetch": 5, "batch_size": 7}})
    assert reading.model_digest() == "57810a94a17734a1"  # how samples are read is not which samples
    assert validation.from_dict({"data": {"transform": "json:loads"}}).model_digest() != "57810a94a17734a1"


def test_a_user_metric_named_like_a_built_in_one_is_refused(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_metrics_26.py").write_text("def accuracy(outputs, targets):\n    return outputs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SpecError) as info:
        validation.from_dict({"metrics": ["accuracy", "my_metrics_26:accuracy"]})
    assert str(info.value) == ("metrics[1]: 'my_metrics_26:accuracy' would be logged as val_accuracy, like metrics[0] "
                               "'accuracy'; give each metric function its own name")
    validation.from_dict({"metrics": ["top5_accuracy", "my_metrics_26:accuracy"]})  # distinct keys pass
