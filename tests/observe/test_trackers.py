"""W&B and MLflow from the spec (``logging.wandb``, ``logging.mlflow``; issue 31), read back with each library's
own reader and compared with what metrics.jsonl holds.

One run (torch, backend local) of 2 epochs with a checkpoint per epoch, resumed to 3 epochs: MLflow's SQLite store
(through ``MlflowClient``) and W&B's offline run directories (W&B's own record format, `wandb_records`) hold every
step and epoch record of both parts, in one tracker run, with the spec as params/config, the environment and the
final model. A tracker that cannot start is one line with exit code 2 before any training; one that breaks
mid-run (its tables dropped) warns once and the run ends as it would have.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from procs import read_metrics

from polytrain import cli
from polytrain.train.trainer import Trainer
from polytrain.validation import from_dict

pytest.importorskip("torch")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

SPEC: dict[str, Any] = {
    "framework": "torch", "backend": "local",
    "model": {"name": "mlp", "params": {"hidden_sizes": [4]}},
    "data": {"name": "synthetic", "batch_size": 12, "val_fraction": 0.2,
             "synthetic": {"samples": 100, "features": 6, "classes": 3, "noise": 1.5}},
    "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
    "loop": {"epochs": 2, "log_every_n_steps": 3}, "seed": 3,
    "checkpoint": {"every_n_epochs": 1},
}


def spec_for(out: Path, **changes: Any) -> dict[str, Any]:
    spec = json.loads(json.dumps(SPEC))
    spec["output"] = str(out)
    spec["logging"] = {"wandb": {"mode": "offline", "project": "tests"},
                       "mlflow": {"tracking_uri": f"sqlite:///{out.parent / 'mlflow.db'}", "experiment": "tests"}}
    for key, value in changes.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file (``run-<id>.wandb``) as W&B's own protobuf ``Record``s. W&B 0.31 writes the file
    from its Go core and ships no Python reader: this undoes its framing (a 7-byte header, then LevelDB-log
    chunks in 32 KiB blocks: crc32c, length, type) and parses each record with W&B's ``wandb_internal_pb2``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, pending, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            pending = b""
            out.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            out.append(pending + chunk)
    records = []
    for raw in out:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    """step → logged values of one offline run directory."""
    rows: dict[int, dict[str, float]] = {}
    for record in wandb_records(next(run_dir.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.setdefault(int(items.pop("_step")), {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def expected(out: Path) -> dict[int, dict[str, float]]:
    """step → the tagged values metrics.jsonl holds (the names TensorBoard and the trackers get)."""
    tags = {"loss": "train/loss", "lr": "train/lr", "samples_per_s": "train/samples_per_s",
            "train_loss": "epoch/train_loss", "val_loss": "val/loss", "val_accuracy": "val/accuracy"}
    rows: dict[int, dict[str, float]] = {}
    for record in read_metrics(out):
        if record["event"] in ("step", "epoch"):
            rows.setdefault(record["step"], {}).update(
                {tag: record[key] for key, tag in tags.items() if record.get(key) is not None})
    return rows


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's output directory after both parts (2 epochs, then resumed to 3)."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    Trainer(from_dict(spec_for(out)), show_progress=False).fit()
    Trainer(from_dict(spec_for(out, loop={"epochs": 3})), show_progress=False, resume="auto").fit()
    return out


@pytest.mark.slow
def test_mlflow_holds_every_record_of_both_parts_in_one_run(tracked: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tracked.parent / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    want = expected(tracked)
    assert max(want) == 21 and min(want) == 3  # 7 steps an epoch, 3 epochs, every 3rd step and each epoch's last
    for tag in ("train/loss", "train/lr", "val/loss", "val/accuracy", "epoch/train_loss"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
        assert history == {step: row[tag] for step, row in want.items() if tag in row}, tag
    params = run.data.params
    assert params["optimizer.lr"] == "0.05" and params["model.params.hidden_sizes"] == "[4]"
    assert params["loop.epochs"] == "2" and run.data.tags["polytrain.changed_params"] == "loop.epochs"
    assert run.data.tags["polytrain.backend"] == "local" and run.data.tags["polytrain.world_size"] == "1"
    saved = {f.path: f.file_size for f in client.list_artifacts(run.info.run_id, "model")}
    assert saved == {"model/model.safetensors": (tracked / "model.safetensors").stat().st_size,
                     "model/model.json": (tracked / "model.json").stat().st_size}
    # the experiment polytrain made keeps its artifacts beside the database, not in the working directory
    assert experiment.artifact_location == (tracked.parent / "mlartifacts").as_uri()


@pytest.mark.slow
def test_wandb_offline_runs_hold_every_record_under_one_run_id(tracked: Path) -> None:
    first, second = sorted((tracked / "wandb").glob("offline-run-*"), key=lambda d: d.name)
    run_id = first.name.rsplit("-", 1)[1]
    assert second.name.rsplit("-", 1)[1] == run_id  # the resumed part continued the same W&B run
    logged = {**wandb_history(first), **wandb_history(second)}
    want = expected(tracked)
    assert sorted(logged) == sorted(want)
    for step, row in want.items():
        assert {k: v for k, v in logged[step].items() if k in row} == row, step
    config = [r.config for r in wandb_records(next(first.glob("run-*.wandb"))) if r.WhichOneof("record_type") ==
              "config"]
    values = {item.key: json.loads(item.value_json) for c in config for item in c.update}
    assert values["optimizer"]["lr"] == 0.05 and values["polytrain"]["backend"] == "local"
    model = second / "files" / "model" / "model.safetensors"
    assert model.read_bytes() == (tracked / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_checkpoints_keep_the_tracker_runs(tracked: Path) -> None:
    from mlflow import MlflowClient

    manifest = json.loads((tracked / "checkpoints" / "step-00000021" / "manifest.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{tracked.parent / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert manifest["trackers"]["mlflow"] == run.info.run_id
    assert len(list((tracked / "wandb").glob(f"offline-run-*-{manifest['trackers']['wandb']}"))) == 2


def test_a_tracker_that_cannot_start_is_one_line_before_training(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({**SPEC, "output": str(tmp_path / "out"),
                                "logging": {"mlflow": {"tracking_uri": f"sqlite:///{blocker}/mlflow.db"}}}))
    assert cli.main(["train", str(spec), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("polytrain: error: logging.mlflow: cannot open the tracking store "
                                               f"sqlite:///{blocker}/mlflow.db"), err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # nothing trained, nothing recorded


def test_a_missing_library_is_named_when_the_spec_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # what Python says of a package that is absent
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({**SPEC, "output": str(tmp_path / "out"), "logging": {"wandb": {}}}))
    assert cli.main(["train", str(spec), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == ("polytrain: error: logging.wandb: wandb is not installed "
                                               "(pip install 'polytrain[trackers]')")
    assert not (tmp_path / "out").exists()


class DropMlflowTables:
    """After step 4, the MLflow store loses its metrics table (a store broken under a running job)."""

    def __init__(self, database: Path) -> None:
        self.database = database

    def on_step_end(self, run: Any, step: int, logs: dict[str, Any]) -> None:
        if step == 4:
            with sqlite3.connect(self.database) as db:
                db.execute("DROP TABLE latest_metrics")
                db.execute("DROP TABLE metrics")


@pytest.mark.slow
def test_a_tracker_that_breaks_mid_run_warns_once_and_training_goes_on(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import polytrain

    spec = spec_for(tmp_path / "broken", loop={"log_every_n_steps": 1})
    del spec["logging"]["wandb"]
    reference = spec_for(tmp_path / "reference", loop={"log_every_n_steps": 1})
    reference["logging"] = {}
    result = polytrain.fit(spec, callbacks=[DropMlflowTables(tmp_path / "mlflow.db")], show_progress=False)
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "logging.mlflow" in line]
    assert "Traceback" not in err
    assert len(warnings) == 1 and warnings[0].startswith("polytrain: warning: logging.mlflow failed at step 5 ")
    assert warnings[0].endswith("training goes on without it")
    same = polytrain.fit(reference, show_progress=False)
    assert result.global_step == same.global_step == 14 and result.history == same.history
    assert [r["step"] for r in read_metrics(tmp_path / "broken") if r["event"] == "step"] == list(range(1, 15))


@pytest.mark.slow
def test_the_own_loop_logs_to_the_spec_trackers_and_a_resumed_loop_goes_on_in_the_same_runs(tmp_path: Path) -> None:
    """``Distributed.log`` (every rank calls it, rank 0 logs): the first call starts the spec's trackers; a checkpoint
    keeps their runs, and a loop that loads it before its first `log` goes on in them."""
    import torch

    from polytrain.torch import Distributed

    database = tmp_path / "mlflow.db"
    spec = {"output": str(tmp_path / "loop"), "logging": {
        "mlflow": {"tracking_uri": f"sqlite:///{database}"}, "wandb": {"mode": "offline"}}}
    logged: dict[int, float] = {}

    def part(steps: range, resume: bool) -> None:
        torch.manual_seed(0)
        with Distributed("local", spec=spec) as dist:
            net = torch.nn.Linear(3, 1)
            model, optimizer = dist.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            state = {"model": model, "optimizer": optimizer, "step": steps.start}
            if resume:
                dist.load(tmp_path / "ckpt", state)
            for step in steps:
                loss = model(torch.ones(4, 3)).pow(2).mean()
                dist.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                dist.log({"loss": loss.detach(), "lr": 0.1}, step)
                logged[step] = loss.item()
            dist.save(tmp_path / "ckpt", {**state, "step": steps.stop - 1})

    part(range(1, 4), resume=False)
    part(range(4, 7), resume=True)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{database}")
    (run,) = client.search_runs([client.get_experiment_by_name("polytrain").experiment_id])
    assert run.info.status == "FINISHED"
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == logged
    first, second = sorted((tmp_path / "loop" / "wandb").glob("offline-run-*"))
    assert first.name.rsplit("-", 1)[1] == second.name.rsplit("-", 1)[1]
    rows = {**wandb_history(first), **wandb_history(second)}
    assert {step: row["loss"] for step, row in rows.items()} == logged


def test_a_file_store_the_spec_names_still_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow 3 refuses its legacy file store unless allowed; a spec that names a ``file:`` URI gets it."""
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # restored after: polytrain allows it for the run
    uri = (tmp_path / "mlruns").as_uri()
    spec = {**SPEC, "output": str(tmp_path / "run"), "logging": {"mlflow": {"tracking_uri": uri}}}
    Trainer(from_dict(spec), show_progress=False).fit()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("polytrain").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val/accuracy")}
    assert history == {r["step"]: r["val_accuracy"] for r in read_metrics(tmp_path / "run", "epoch")}
