"""The spec's ``logging`` and ``profile`` tables: where rank 0's records go beside metrics.jsonl (TensorBoard,
CSV, Weights & Biases, MLflow), and which steps the framework's profiler records.

Neither changes what is trained: `polytrain.spec.tables.TrainSpec.digest` leaves both out, so a run resumes a checkpoint
written with other trackers or profiling.
"""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.errors import SpecError
from polytrain.spec.schema import rule

WANDB_MODES = ("online", "offline", "disabled")
PROFILE_ACTIVITIES = ("cpu", "cuda")


@dataclass(frozen=True)
class WandbSpec:
    """A Weights & Biases run (rank 0). ``mode`` null: W&B's own choice (``WANDB_MODE``, else online); the run's
    files go under ``<output>/wandb``; ``name`` null: the output directory's name."""

    project: str = "polytrain"
    entity: str | None = None
    name: str | None = None
    mode: str | None = rule(None, choices=WANDB_MODES)
    tags: tuple[str, ...] | None = None


@dataclass(frozen=True)
class MlflowSpec:
    """An MLflow run (rank 0). ``tracking_uri`` null: MLflow's own (``MLFLOW_TRACKING_URI``, else its default, a
    SQLite database ``mlflow.db`` in the working directory); ``experiment``: made when missing (in a SQLite store
    with its artifacts beside the database, in ``mlartifacts/``); ``run_name`` null: the output directory's name."""

    tracking_uri: str | None = None
    experiment: str = "polytrain"
    run_name: str | None = None


@dataclass(frozen=True)
class LoggingSpec:
    """Rank 0's records: metrics.jsonl always; ``csv`` (metrics.csv) and ``tensorboard`` (``<output>/tb``) on by
    default; ``wandb`` and ``mlflow`` when given (a table, ``{}`` for the defaults)."""

    csv: bool = True
    tensorboard: bool = True
    wandb: WandbSpec | None = None
    mlflow: MlflowSpec | None = None

    def trackers(self) -> dict[str, WandbSpec | MlflowSpec]:
        """The trackers the spec names, by name (the registry's rows)."""
        return {name: options for name, options in (("wandb", self.wandb), ("mlflow", self.mlflow))
                if options is not None}


@dataclass(frozen=True)
class ProfileSpec:
    """The framework's profiler over optimizer steps ``steps`` (first and last, counted from 1 as in
    metrics.jsonl) on ``ranks``; one trace per profiled rank under ``<output>/profile`` (TensorBoard's profiler
    plugin and Perfetto open it). ``activities``: what torch.profiler records (``cuda`` only where there is a GPU);
    ``memory``: tensor allocations too."""

    steps: tuple[int, int] = (2, 3)
    ranks: tuple[int, ...] = (0,)
    activities: tuple[str, ...] = PROFILE_ACTIVITIES
    memory: bool = False


def check_profile(profile: ProfileSpec) -> None:
    """The rules of one profile table across its fields (raised as `SpecError`)."""
    first, last = profile.steps
    if first < 1 or last < first:
        raise SpecError(f"profile.steps: {list(profile.steps)} is not a range of steps (two step numbers, the "
                        f"first >= 1 and the last >= the first)")
    for i, rank in enumerate(profile.ranks):
        if rank < 0:
            raise SpecError(f"profile.ranks[{i}]: {rank} is not a rank (ranks count from 0)")
    for i, activity in enumerate(profile.activities):
        if activity not in PROFILE_ACTIVITIES:
            raise SpecError(f"profile.activities[{i}]: {activity!r} is not allowed (allowed: "
                            f"{', '.join(PROFILE_ACTIVITIES)})")

