"""A checkpoint's manifest is checked field by field and by its own digest before anything reads it, and its file
names never lead out of its directory (issue 48, items 9 and 10).

One checkpoint is trained once per module (the Trainer on the fakes of tests/trainer_fakes.py, step 9: epoch 1,
step 2 of the epoch); each case tampers a copy of it and resumes from it (the Trainer's real resume path,
`polytrain.train.checkpoints`) and inspects it (``polytrain checkpoint inspect``, the CLI's own entry point): both
must end in the same one line naming the field and the file (exit 2), with nothing loaded. Before this change the
cases were a KeyError/TypeError traceback, or a resume that went on ("resumed ... at step -5"), or tensors read
from outside the checkpoint. A few runs of the real CLI on a tiny digits job close the module: the exit code and
stderr of ``polytrain train --resume`` and ``checkpoint inspect``, an RNG state torch refuses, and ``model.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from procs import run
from trainer_fakes import FakeJob
from trainer_runs import fit, make_spec

from polytrain import cli
from polytrain.checkpoint import manifest as cm
from polytrain.checkpoint import store as ckpt
from polytrain.train.trainer import Trainer

STEP = "step-00000009"
STOPPING = {"monitor": "val_loss", "patience": 5}
Tamper = Callable[[Path, dict[str, Any]], Any]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the Trainer (fakes) at step 9, with a data record and early stopping's state."""
    root = tmp_path_factory.mktemp("trained")
    spec = make_spec(root / "run", loop={"max_steps": 9, "early_stopping": STOPPING}, checkpoint={"every_n_steps": 9})
    fit(spec)
    saved = spec.checkpoint_dir / STEP
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["dataset"]["train"] == 80 and manifest["early_stopping"] is not None
    assert manifest[cm.DIGEST_KEY] == cm.digest(manifest)  # the Trainer's manifest records its own digest
    return saved


def tampered(trained: Path, tmp_path: Path, tamper: Tamper) -> Path:
    """A copy of the trained checkpoint with ``tamper`` (directory, manifest) applied to its manifest (as JSON:
    its digest left as it was, unless the tamper returns the text to write)."""
    copy = tmp_path / "ck" / STEP
    shutil.copytree(trained, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    text = tamper(copy, manifest)
    (copy / "manifest.json").write_text(text if isinstance(text, str) else json.dumps(manifest))
    return copy


def resumed(tmp_path: Path, path: Path) -> tuple[BaseException | None, FakeJob]:
    """Resume the trained run's spec (another output) from ``path``; the error, or None when it trained on."""
    spec = make_spec(tmp_path / "out", loop={"max_steps": 12, "early_stopping": STOPPING})
    job = FakeJob()
    try:
        Trainer(spec, show_progress=False, resume=str(path), backend_factory=job.backend_factory,
                framework_factory=job.framework_factory).fit()
    except ckpt.CheckpointError as exc:
        return exc, job
    return None, job


def inspected(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``polytrain checkpoint inspect PATH`` through the CLI's entry point: its exit code and stderr."""
    capsys.readouterr()
    code = cli.main(["checkpoint", "inspect", str(path)])
    return code, capsys.readouterr().err


def drop(key: str) -> Tamper:
    return lambda _, m: m.pop(key) and None


def put(key: str, value: Any) -> Tamper:
    return lambda _, m: m.__setitem__(key, value)


def outside(copy: Path, manifest: dict[str, Any]) -> None:
    """The issue's case: the model named by a path out of the checkpoint, the file there with the right hash."""
    other = copy.parent.parent / "other"
    other.mkdir()
    shutil.copy(copy / "model.safetensors", other / "model.safetensors")
    manifest["files"]["../../other/model.safetensors"] = manifest["files"].pop("model.safetensors")
    (copy / "model.safetensors").unlink()


def linked_out(copy: Path, manifest: dict[str, Any]) -> str:
    """The same through a symbolic link: the manifest untouched (its digest matches), the file a link out."""
    other = copy.parent.parent / "other"
    other.mkdir()
    shutil.move(copy / "model.safetensors", other / "model.safetensors")
    os.symlink(other / "model.safetensors", copy / "model.safetensors")
    return json.dumps(manifest)


def edited_step(_: Path, manifest: dict[str, Any]) -> None:
    manifest["global_step"] = 8  # a valid value: only the digest tells


def set_in(*keys: str, value: Any) -> Tamper:
    def tamper(_: Path, manifest: dict[str, Any]) -> None:
        target = manifest
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return tamper


MODEL = "files['model.safetensors']"
CASES: dict[str, tuple[Tamper, str]] = {
    "world-size-removed": (drop("world_size"), "world_size is missing: it must be a whole number ≥ 1"),
    "epoch-removed": (drop("epoch"), "epoch is missing: it must be a whole number ≥ 0"),
    "step-in-epoch-removed": (drop("step_in_epoch"), "step_in_epoch is missing"),
    "epoch-as-text": (put("epoch", "1"), 'epoch must be a whole number ≥ 0 (epochs completed), not "1" (text)'),
    "global-step-negative": (put("global_step", -5), "global_step must be a whole number ≥ 0 (optimizer steps "
                                                     "taken), not -5"),
    "step-in-epoch-fraction": (put("step_in_epoch", 2.5), "step_in_epoch must be a whole number ≥ 0"),
    "world-size-zero": (put("world_size", 0), "world_size must be a whole number ≥ 1"),
    "world-size-true": (put("world_size", True), "world_size must be a whole number ≥ 1"),
    "global-batch-text": (put("global_batch", "12"), "global_batch must be a whole number ≥ 0"),
    "rng-states-text": (put("rng_states", "ab"), "rng_states must be a list of one RNG state per rank "
                                                 "(world_size 1), not \"ab\""),
    "rng-states-one-too-many": (put("rng_states", [[3, 0], [3, 0]]), "rng_states must be a list of one RNG "
                                                                      "state per rank (world_size 1)"),
    "rng-state-of-text": (put("rng_states", [["3", "0"]]), "rng_states[0] must be a rank's RNG state"),
    "early-stopping-waited-negative": (set_in("early_stopping", "waited", value=-1),
                                       "early_stopping.waited must be a whole number ≥ 0"),
    "early-stopping-best-text": (set_in("early_stopping", "best", value="low"),
                                 "early_stopping.best must be a number"),
    "loss-scaler-partial": (put("loss_scaler", {"scale": 1024.0}), "loss_scaler must be null or hold scale"),
    "dataset-count-text": (set_in("dataset", "train", value="80"), "dataset.train must be a whole number ≥ 0"),
    "dataset-files-list": (set_in("dataset", "files", value=[]), "dataset.files must be an object"),
    "trackers-number": (put("trackers", {"mlflow": 3}), "trackers.mlflow must be non-empty text"),
    "framework-unknown": (put("framework", "jax"), "framework must be one of torch, tensorflow"),
    "run-id-number": (put("run_id", 5), "run_id must be non-empty text"),
    "files-a-list": (put("files", []), "files must be an object naming each tensor file"),
    "files-without-the-model": (lambda _, m: m["files"].pop("model.safetensors"),
                                "files does not list model.safetensors"),
    "file-size-negative": (lambda _, m: m["files"]["model.safetensors"].__setitem__("bytes", -1),
                           f"{MODEL}.bytes must be a whole number ≥ 0"),
    "file-sha256-short": (lambda _, m: m["files"]["model.safetensors"].__setitem__("sha256", "abc"),
                          f"{MODEL}.sha256 must be a sha256 (64 hex digits)"),
    "file-named-out-of-the-directory": (outside, "files names '../../other/model.safetensors'; a tensor file is "
                                                 "named by a plain file name inside the checkpoint directory"),
    "file-named-absolute": (lambda _, m: m["files"].__setitem__("/etc/model.safetensors", m["files"]["optimizer"
                                                                ".safetensors"]), "files names '/etc/model"),
    "digest-malformed": (put(cm.DIGEST_KEY, "xyz"), f"{cm.DIGEST_KEY} must be a sha256 (64 hex digits)"),
    "a-valid-value-edited": (edited_step, f"does not match the {cm.DIGEST_KEY} it records: it was edited or "
                                          "damaged after it was written"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_a_tampered_manifest_is_one_line_naming_the_field_and_the_file(
        trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    tamper, expected = CASES[case]
    copy = tampered(trained, tmp_path, tamper)
    error, job = resumed(tmp_path, copy)
    assert error is not None, f"{case}: resumed from a tampered manifest"
    message = str(error)
    assert "\n" not in message and message.startswith(f"--resume: {copy / 'manifest.json'}"), message
    assert expected in message, message
    assert job.fw.calls.loaded == 0 and job.fw.calls.micro == []  # refused before anything was loaded
    code, err = inspected(copy, capsys)
    [line] = err.strip().splitlines()
    assert code == 2 and line.startswith(f"polytrain: error: checkpoint: {copy / 'manifest.json'}") and expected in line


@pytest.mark.slow
def test_a_tensor_file_linked_out_of_the_checkpoint_is_refused(trained: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    copy = tampered(trained, tmp_path, linked_out)
    expected = (f"{copy / 'model.safetensors'} leads outside its checkpoint directory (to "
                f"{tmp_path / 'other' / 'model.safetensors'})")
    error, job = resumed(tmp_path, copy)
    assert error is not None and expected in str(error) and job.fw.calls.loaded == 0
    code, err = inspected(copy, capsys)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_resume_auto_refuses_rather_than_starting_over_when_no_checkpoint_verifies(trained: Path,
                                                                                   tmp_path: Path) -> None:
    copy = tampered(trained, tmp_path, put("epoch", "1"))
    spec = make_spec(tmp_path / "out", loop={"max_steps": 12, "early_stopping": STOPPING},
                     checkpoint={"dir": str(copy.parent)})
    job = FakeJob()
    with pytest.raises(ckpt.CheckpointError) as info:
        fit(spec, job=job, resume="auto")
    assert str(info.value).startswith(f"--resume auto: no checkpoint in {copy.parent} verifies; the newest: "
                                      f"{copy / 'manifest.json'}: epoch must be a whole number")
    assert job.fw.calls.micro == []  # before, it trained from step 1


@pytest.mark.slow
def test_a_manifest_from_before_the_digest_still_resumes(trained: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Checkpoints written before manifests recorded their digest have none: they load, checked field by field."""
    copy = tampered(trained, tmp_path, drop(cm.DIGEST_KEY))
    error, job = resumed(tmp_path, copy)
    assert error is None and min(m.step for m in job.fw.calls.micro) == 10 and job.fw.calls.loaded == 1
    capsys.readouterr()
    assert cli.main(["checkpoint", "inspect", str(copy)]) == 0 and "global_step  9" in capsys.readouterr().out


def test_every_manifest_polytrain_writes_is_sealed(tmp_path: Path) -> None:
    """What `sealed_text` records is the digest of what a reader parses back, numpy numbers and NaN included."""
    import numpy as np

    path = ckpt.save_checkpoint(tmp_path, 3, {"model": {"w": np.zeros(2, np.float32)}},
                                {"world_size": 1, "epoch": 0, "step_in_epoch": 3, "lr": np.float64(0.5),
                                 "early_stopping": {"best": float("nan"), "waited": 1}, cm.DIGEST_KEY: "0" * 64})
    manifest = ckpt.verify(path)
    assert manifest[cm.DIGEST_KEY] == cm.digest(manifest) != "0" * 64 and manifest["lr"] == 0.5
    ckpt.write_model(tmp_path / "model", {"w": np.zeros(2, np.float32)}, {"global_step": 3, "val_loss": float("nan")})
    model = json.loads((tmp_path / "model" / "model.json").read_text())
    assert model[cm.DIGEST_KEY] == cm.digest(model) and ckpt.read_model(tmp_path / "model")[1]["val_loss"] is None


# ---------------------------------------------------------------------------- the own loop


def test_the_own_loops_load_checks_the_manifest(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from polytrain.torch import Distributed

    with Distributed("local") as dist:
        model = torch.nn.Linear(3, 2)
        model, optimizer = dist.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        saved = dist.save(tmp_path / "ck", {"model": model, "optimizer": optimizer, "step": 4, "epoch": 1})
        good = json.loads((saved / "manifest.json").read_text())
        for key, value, expected in (("epoch", "1", 'epoch must be a whole number ≥ 0 (epochs completed), not "1"'),
                                     ("global_step", -5, "global_step must be a whole number ≥ 0"),
                                     ("step_in_epoch", None, "step_in_epoch must be a whole number ≥ 0")):
            (saved / "manifest.json").write_text(json.dumps({**good, key: value}))
            with pytest.raises(ckpt.CheckpointError) as info:
                dist.load(saved, {"model": model, "optimizer": optimizer})
            assert str(info.value).startswith(f"checkpoint: {saved / 'manifest.json'}: {expected}"), str(info.value)
        (saved / "manifest.json").write_text(json.dumps(good))
        assert dist.load(saved, {"model": model, "optimizer": optimizer})["step"] == 4


# ---------------------------------------------------------------------------- the CLI on a real run


DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"


def polytrain(*args: Any, cwd: Path | None = None) -> Any:
    return run([sys.executable, "-m", "polytrain.cli", *map(str, args)], timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("digits")
    proc = polytrain("train", DIGITS, "--quiet", "--set", f"output={out}", "--set", "loop.max_steps=3",
                     "--set", "checkpoint.every_n_steps=3", "--set", "model.params.hidden_sizes=[8]")
    assert proc.returncode == 0, proc.stderr
    return out


def resume_fails(digits_run: Path, path: Path, tmp_path: Path) -> str:
    proc = polytrain("train", DIGITS, "--quiet", "--set", f"output={tmp_path / 'out'}", "--set", "loop.max_steps=6",
                     "--set", "model.params.hidden_sizes=[8]", "--resume", path)
    [line] = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    return line


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_the_cli_refuses_a_tampered_manifest_and_an_rng_state_torch_cannot_take(digits_run: Path,
                                                                                 tmp_path: Path) -> None:
    saved = digits_run / "checkpoints" / "step-00000003"
    copy = tmp_path / "ck" / saved.name
    shutil.copytree(saved, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "world_size"}))
    assert resume_fails(digits_run, copy, tmp_path) == (
        f"polytrain: error: --resume: {copy / 'manifest.json'}: world_size is missing: it must be a whole number ≥ 1 "
        "(how many ranks wrote it); the file is damaged or was edited; give another checkpoint (an earlier step), "
        "or the checkpoint root to take the newest one that verifies")
    inspect = polytrain("checkpoint", "inspect", copy)
    assert inspect.returncode == 2 and "world_size is missing" in inspect.stderr
    # a manifest that is whole (sealed) but holds an RNG state torch's generator cannot take: before, a traceback
    (copy / "manifest.json").write_text(cm.sealed_text({**manifest, "rng_states": [[1, 2, 3]]}))
    line = resume_fails(digits_run, copy, tmp_path)
    assert line.startswith(f"polytrain: error: checkpoint: {copy / 'manifest.json'}: rng_states[0] is not a torch RNG "
                           "state ("), line


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_cli_refuses_an_edited_model_json(digits_run: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(digits_run / "model.safetensors", model)
    written = json.loads((digits_run / "model.json").read_text())
    assert written[cm.DIGEST_KEY] == cm.digest(written)
    for value, expected in (("3", 'global_step must be a whole number ≥ 0 (optimizer steps taken), not "3"'),
                            (2, f"does not match the {cm.DIGEST_KEY} it records")):
        (model / "model.json").write_text(json.dumps({**written, "global_step": value}))
        proc = polytrain("checkpoint", "inspect", model)
        [line] = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and line.startswith(f"polytrain: error: checkpoint: {model / 'model.json'}")
        assert expected in line, line
