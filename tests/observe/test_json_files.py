"""Every JSON file polytrain writes is strict JSON (issue 36 item 2): a non-finite number is ``null``, never a bare
``NaN``/``Infinity`` that strict parsers (jq, JavaScript, most JSON tools) reject. A real run that diverges writes
them all, and each is read back with a parser that refuses those constants."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polytrain.checkpoint import store as ckpt
from polytrain.commands import compare_runs as compare_runs
from polytrain.observe import jsonfiles as jsonfiles
from polytrain.train.callbacks import BestCheckpoints
from polytrain.train.trainer import Trainer
from polytrain.validation import from_dict
from polytrain.world import World

HERE = Path(__file__).parents[1]


def refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict(text: str) -> Any:
    """What a strict parser reads (Python's ``json`` accepts NaN and Infinity unless told not to)."""
    return json.loads(text, parse_constant=refuse)


def strict_records(path: Path) -> list[dict[str, Any]]:
    return [strict(line) for line in path.read_text().splitlines()]


def test_finite_and_dumps_write_non_finite_numbers_as_null() -> None:
    value = {"nan": math.nan, "inf": [np.float32("inf"), -math.inf], "np": (np.float64(0.25), np.int64(3)),
             "nested": {"ok": 1.5, "bool": np.bool_(True), "text": "NaN"}, "zero_d": np.array(2.0)}
    text = jsonfiles.dumps(value, sort_keys=True)
    assert strict(text) == {"nan": None, "inf": [None, None], "np": [0.25, 3],
                            "nested": {"ok": 1.5, "bool": True, "text": "NaN"}, "zero_d": 2.0}
    assert jsonfiles.finite(np.float64(0.5)).__class__ is float


def test_a_diverging_run_writes_only_strict_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The 3rd training forward returns NaN (the last step of epoch 1): the step is skipped
    (reliability.on_nonfinite: skip), its loss and the epoch's train loss are NaN."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(HERE / "multiproc"))  # nan_model
    monkeypatch.setenv("NAN_RANK", "0")
    monkeypatch.setenv("NAN_AT", "3")
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "out"
    spec = from_dict({
        "framework": "torch", "backend": "local", "model": {"name": "nan_model:make"}, "output": str(out),
        "data": {"name": "synthetic", "batch_size": 16, "val_fraction": 0.25,
                 "synthetic": {"samples": 64, "features": 6, "classes": 3}},
        "loop": {"epochs": 2, "log_every_n_steps": 1,
                 "early_stopping": {"monitor": "train_loss", "mode": "min", "patience": 5}},
        "checkpoint": {"every_n_epochs": 1, "monitor": "train_loss", "mode": "min", "save_top_k": 2},
        "reliability": {"on_nonfinite": "skip"}, "seed": 0,
    })
    with caplog.at_level(logging.WARNING):
        result = Trainer(spec, World(), show_progress=False, timeline=str(out / "trace.json")).fit()
    assert "NaN or Inf" not in caplog.text  # TensorBoard is given finite values only
    written = sorted(p for p in out.rglob("*") if p.suffix in (".json", ".jsonl"))
    names = {str(p.relative_to(out)) for p in written}
    assert {"metrics.jsonl", "model.json", "trace.json", "checkpoints/best/index.json",
            "checkpoints/step-00000003/manifest.json", "checkpoints/step-00000006/manifest.json"} <= names
    for path in written:
        if path.suffix == ".jsonl":
            strict_records(path)
        else:
            strict(path.read_text())
    records = strict_records(out / "metrics.jsonl")
    steps = {r["step"]: r["loss"] for r in records if r["event"] == "step"}
    assert steps[3] is None and all(isinstance(steps[s], float) for s in (1, 2, 4, 5, 6))  # NaN -> null
    assert [r["step"] for r in records if r["event"] == "nonfinite"] == [3]
    epochs = [r for r in records if r["event"] == "epoch"]
    assert epochs[0]["train_loss"] is None and isinstance(epochs[1]["train_loss"], float)
    index = strict((out / "checkpoints" / "best" / "index.json").read_text())
    assert [e["step"] for e in index["best"]] == [6]  # a NaN train loss is never among the best
    assert math.isnan(result.history[0]["train_loss"])  # the result keeps the number itself
    assert "np." not in repr(result)


def test_manifests_model_json_and_best_index_are_strict(tmp_path: Path) -> None:
    state = {"w": np.zeros(2, np.float32)}
    ckpt.write_model(tmp_path / "model", state, {"val_loss": math.nan, "val_accuracy": np.float32("nan"),
                                                 "spec": {"limit": math.inf}})
    model = strict((tmp_path / "model" / "model.json").read_text())
    assert (model["val_loss"], model["val_accuracy"], model["spec"]) == (None, None, {"limit": None})
    assert ckpt.read_model(tmp_path / "model")[1]["val_loss"] is None  # the pair still reads back
    path = ckpt.save_checkpoint(tmp_path / "ckpt", 4, {"model": state},
                                {"early_stopping": {"best": math.inf, "waited": 1}, "lr": np.float64(0.1),
                                 "world_size": 1, "epoch": 0, "step_in_epoch": 0})
    saved = strict((path / "manifest.json").read_text())
    assert saved["early_stopping"] == {"best": None, "waited": 1} and saved["lr"] == 0.1
    assert ckpt.verify(path)["global_step"] == 4
    best = BestCheckpoints(tmp_path / "best", "val_loss", "min", 2)
    assert not best.wants(math.inf) and not best.wants(-math.inf) and not best.wants(math.nan) and best.wants(1.0)


def test_a_compare_record_writes_a_diverged_loss_as_null(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compare_runs.ENV_OUT, str(tmp_path))

    class Main:  # what Record reads of a polytrain.torch.Distributed on rank 0
        is_main = True

    record = compare_runs.Record(Main())
    record.step(0.5)
    record.step(math.nan)
    record._log.close()
    losses = [r["loss"] for r in strict_records(tmp_path / "metrics.jsonl")]
    assert losses == [0.5, None]
