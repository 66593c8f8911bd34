"""A Weights & Biases run for rank 0's records (spec ``logging.wandb``).

The run's files go under ``<output>/wandb`` (an offline run's directory is what ``wandb sync`` uploads later). The
resolved spec is the run's config, with the environment (backend, launcher, world size, versions) under
``polytrain``; every step/epoch record is logged at its optimizer step; the final model's files are copied into the
run's ``files/model/``. A resumed run passes the id its checkpoint kept with ``resume="allow"``, so W&B continues
the same run. W&B's console capture, system metrics and git probing are off: the run holds what polytrain logs. W&B's service
process is stopped when the run finishes, unless the script has a W&B run of its own open.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polytrain.errors import UserError
from polytrain.observe.redact import redact_text, redacted
from polytrain.observe.trackers import one_line


class WandbRun:
    def __init__(self, run: Any) -> None:
        self.run = run
        self.run_id = run.id

    @classmethod
    def start(cls, options: Any, *, output: Path, run_id: str | None, config: Mapping[str, Any],
              environment: Mapping[str, Any]) -> WandbRun:
        import wandb

        directory = output / "wandb"
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                                  disable_git=True, save_code=False)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # every name W&B keeps as the spec shows it: a credential in a URI masked (polytrain.observe.redact)
            run = wandb.init(project=redact_text(options.project), entity=redacted(options.entity),
                             name=redact_text(options.name or output.absolute().name), mode=options.mode,
                             tags=redacted(list(options.tags or ())), dir=str(output), id=run_id,
                             resume="allow", settings=settings, reinit="create_new")
            run.config.update({**config, "polytrain": dict(environment)}, allow_val_change=True)
        except Exception as exc:  # noqa: BLE001 - no key, no network, a bad entity: one line, before training
            raise UserError(f"logging.wandb: cannot start the W&B run ({type(exc).__name__}: {one_line(exc)}); "
                            f"check logging.wandb (project, entity, mode) and WANDB_API_KEY, or set mode: "
                            f"offline") from None
        return cls(run)

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def log_model(self, files: Sequence[Path]) -> None:
        target = Path(self.run.dir) / "model"
        target.mkdir(parents=True, exist_ok=True)
        for file in files:
            shutil.copy2(file, target / file.name)  # files in the run's directory are part of the run

    def finish(self, failed: bool) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        if wandb.run is None:  # no run of the script's own is open: stop W&B's service process (it outlives runs)
            wandb.teardown()
