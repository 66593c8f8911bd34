"""An MLflow run for rank 0's records (spec ``logging.mlflow``), through `mlflow.MlflowClient`.

The store is the spec's ``tracking_uri``, else MLflow's own (``MLFLOW_TRACKING_URI``, else its default SQLite
database ``mlflow.db`` in the working directory); a ``file:`` store (MLflow's legacy one, which MLflow 3 refuses by
default) is allowed when the spec names it. An experiment polytrain creates in a SQLite store keeps its
artifacts beside the database (``mlartifacts/``), not in the working directory. The resolved spec goes in as
params (dotted keys), the run's environment as ``polytrain.*`` tags, every step/epoch record as metrics, the final
model under the ``model/`` artifact path. A resumed run reopens the run whose id its checkpoint kept; params the
resumed spec changed stay as first logged (MLflow does not change a param) and are listed in the
``polytrain.changed_params`` tag.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polytrain.errors import UserError
from polytrain.observe.redact import redact_text, without_user_info
from polytrain.observe.trackers import flat, one_line

PARAM_CHARS = 6000  # MLflow's limit on a param's value
BATCH = 100  # MLflow's limit on params per log_batch


def _store_hint(uri: str) -> str:
    if uri.startswith("sqlite:"):
        return "a sqlite:///path/to/mlflow.db whose directory can be made and written"
    return "a reachable tracking server (http://host:port), a sqlite:/// database or a file: directory"


class MlflowRun:
    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    @classmethod
    def start(cls, options: Any, *, output: Path, run_id: str | None, config: Mapping[str, Any],
              environment: Mapping[str, Any]) -> MlflowRun:
        import mlflow
        from mlflow import MlflowClient

        uri = options.tracking_uri or mlflow.get_tracking_uri()
        if uri.startswith("file:"):  # a directory: a credential means nothing there, and MLflow would write it into
            uri = without_user_info(uri)  # the store (each experiment's artifact location is the URI's)
        if uri.startswith("file:") or "://" not in uri and not uri.startswith(("sqlite:", "databricks")):
            # a file store the spec names (MLflow 3 refuses those unless allowed: its default is SQLite)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # the store's own log: a line per new database, a traceback per failed write; polytrain says either in one
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # a server that is not there: seconds
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        try:
            client = MlflowClient(tracking_uri=uri)
            run = cls._reopen(client, run_id) if run_id else None
            if run is None:
                experiment = cls._experiment(client, redact_text(options.experiment), uri)
                tags = {f"polytrain.{key}": str(value) for key, value in environment.items()}
                run = client.create_run(experiment, run_name=redact_text(options.run_name or output.absolute().name),
                                        tags=tags)
                params = {key: _param(value) for key, value in flat(config).items()}
            else:
                logged = run.data.params
                params = {k: v for k, v in ((k, _param(v)) for k, v in flat(config).items()) if k not in logged}
                changed = sorted(k for k, v in flat(config).items() if k in logged and logged[k] != _param(v))
                if changed:
                    client.set_tag(run.info.run_id, "polytrain.changed_params", ",".join(changed)[:PARAM_CHARS])
                client.update_run(run.info.run_id, status="RUNNING")
            from mlflow.entities import Param

            items = [Param(key, value) for key, value in params.items()]
            for i in range(0, len(items), BATCH):
                client.log_batch(run.info.run_id, params=items[i:i + BATCH])
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - every way a store can refuse: one line, before training
            raise UserError(f"logging.mlflow: cannot open the tracking store {redact_text(uri)} ({type(exc).__name__}: "
                            f"{one_line(exc)}); give logging.mlflow.tracking_uri as {_store_hint(uri)}") from None
        return cls(client, run.info.run_id)

    @staticmethod
    def _reopen(client: Any, run_id: str) -> Any:
        from mlflow.exceptions import MlflowException

        try:
            return client.get_run(run_id)
        except MlflowException:
            return None  # not in this store (another tracking_uri): a new run

    @staticmethod
    def _experiment(client: Any, name: str, uri: str) -> str:
        found = client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None
        if uri.startswith("sqlite:///"):
            database = Path(uri.removeprefix("sqlite:///").split("?")[0])
            location = (database.absolute().parent / "mlartifacts").as_uri()
        return client.create_experiment(name, artifact_location=location)

    def log(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def log_model(self, files: Sequence[Path]) -> None:
        for file in files:
            self.client.log_artifact(self.run_id, str(file), artifact_path="model")

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:PARAM_CHARS]
