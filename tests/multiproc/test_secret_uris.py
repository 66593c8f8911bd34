"""A credential in a URI of the spec never leaves the run in clear (issue 48 item 7), while the run still uses it.

A real run (torch, one rank) whose ``logging.mlflow.tracking_uri`` holds a password (a ``file:`` store: the only
store here that takes the ``user:password@`` form; a credential means nothing to it, so polytrain drops it before
MLflow writes the URI into the store) and whose ``logging.wandb.tags`` hold another (W&B offline, its files under
the output): no file under the output (model.json, every manifest.json, metrics, W&B's run), no line of its
output and nothing in the MLflow store holds either password, while the store the URI names has the run, its
metrics and the masked URI as a param. A store that cannot be reached (``postgresql://user:PASSWORD@...`` on a
port nothing listens on) is one line, exit 2, under ``polytrain launch``, with the password masked there too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from procs import check, free_port, loopback_env, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

pytest.importorskip("torch")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

PASSWORD, TOKEN = "PW-d6c1e4f0a9", "TK-77b20e5c31"

SPEC = """\
framework: torch
backend: local
model: {{name: mlp, params: {{hidden_sizes: [8]}}}}
data: {{name: digits, batch_size: 64}}
loop: {{epochs: 1, max_steps: 2, log_every_n_steps: 1}}
checkpoint: {{every_n_steps: 1}}
output: {output}
logging:
  mlflow: {{tracking_uri: "{uri}", experiment: secrets}}
{wandb}"""


def files_holding(root: Path, *secrets: str) -> list[str]:
    """Every file under ``root`` (binary ones too) that holds one of ``secrets``."""
    return [str(path) for path in root.rglob("*") if path.is_file()
            and any(secret.encode() in path.read_bytes() for secret in secrets)]


def test_a_password_in_a_spec_uri_reaches_the_store_and_nothing_written_or_printed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    uri = f"file://user:{PASSWORD}@localhost{store}"
    wandb = f'  wandb: {{mode: offline, project: secrets, tags: ["https://bot:{TOKEN}@example.com/x"]}}\n'
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(output=out, uri=uri, wandb=wandb))
    done = check(run([sys.executable, "-m", "polytrain.cli", "train", str(spec)], env=loopback_env(WANDB_SILENT="true"),
                     cwd=tmp_path))
    written = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()]
    assert "model.json" in written and any(p.endswith("manifest.json") for p in written), written
    assert any(p.startswith("wandb/") for p in written) and "metrics.jsonl" in written, written
    assert files_holding(out, PASSWORD, TOKEN) == []
    assert files_holding(store, PASSWORD, TOKEN) == []
    assert PASSWORD not in done.stdout + done.stderr and TOKEN not in done.stdout + done.stderr
    shown = f"file://user:***@localhost{store}"
    assert json.loads((out / "model.json").read_text())["spec"]["logging"]["mlflow"]["tracking_uri"] == shown
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when allowed
    client = MlflowClient(tracking_uri=store.as_uri())  # the store the URI named: the run went there
    experiment = client.get_experiment_by_name("secrets")
    assert experiment is not None
    [logged] = client.search_runs([experiment.experiment_id])
    assert logged.data.params["logging.mlflow.tracking_uri"] == shown
    assert logged.data.params["logging.wandb.tags"] == json.dumps(["https://bot:***@example.com/x"])
    assert [m.step for m in client.get_metric_history(logged.info.run_id, "train/loss")] == [1, 2]


def test_an_unreachable_store_is_one_line_with_its_password_masked(tmp_path: Path) -> None:
    out = tmp_path / "out"
    uri = f"postgresql://user:{PASSWORD}@127.0.0.1:{free_port()}/mlflow"
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(output=out, uri=uri, wandb=""))
    done = run([sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "local", "-np", "1", str(spec)],
               env=loopback_env(), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "logging.mlflow: cannot open the tracking store postgresql://user:***@127.0.0.1:" in done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.left_behind == []
    assert not out.exists() or files_holding(out, PASSWORD) == []
