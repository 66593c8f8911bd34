"""The non-finite check of the sharded backends agrees across ranks although only one rank's shard is bad.

An Inf is put into one element of one gradient that, after the reduce-scatter, only rank 1's shard
holds (see sharded_nonfinite_worker.py: the loss and every other gradient stay finite, rank 0's
shards are all finite). Only the all-reduce of the "non-finite" flag in the backend's
``grads_finite`` can tell rank 0; every rank must then decide alike at that step:

- FSDP2, ``on_nonfinite: skip``: every rank reports the step skipped, no weight changes in it (the
  gathered weights after it equal those before, on every rank), training goes on with the same step
  count and the same weights everywhere.
- DeepSpeed ZeRO-2 and ZeRO-3 (``skip`` needs stage 0 there), ``stop``: every rank stops at that step
  with the same one-line reason, after the same steps and the same weights.

Checked to fail with the all-reduce taken out of ``grads_finite`` (rank 0 then goes on alone).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import command, job_env, run

pytest.importorskip("torch")

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "sharded_nonfinite_worker.py")
POISON_AT, STEPS = 3, 5
SETS = ["model.name=sharded_nonfinite_worker:make", f"model.params.poison_at={POISON_AT}", "model.params.poison_rank=1",
        "data.batch_size=16", "optimizer.lr=0.1", "loop.epochs=1", f"loop.max_steps={STEPS}", "loop.log_every_n_steps=1",
        "data.workers=0", "reliability.collective_timeout_s=30"]
REASON = f"step {POISON_AT}: the loss or a gradient is NaN/Inf"


def run_worker(out: Path, sets: list[str]) -> tuple[list[dict], list[str]]:
    """The worker on two ranks under torchrun; each rank's report and its own stderr."""
    out.mkdir()
    result = run(command("torchrun", [WORKER, str(out), *SETS, *sets], 2),
                 env=job_env({"PYTHONPATH": f"{HERE}:{HERE.parent}"}), timeout=200)
    stderr = [(out / f"rank{r}.stderr").read_text() if (out / f"rank{r}.stderr").exists() else "" for r in (0, 1)]
    everything = f"{result.stderr[-2000:]}\n" + "\n".join(f"--- rank {r}:\n{s[-3000:]}" for r, s in enumerate(stderr))
    missing = [r for r in (0, 1) if not (out / f"rank{r}.json").exists()]
    assert result.returncode == 0 and not missing, (
        f"exit {result.returncode}, rank(s) {missing} wrote no report:\n{everything}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)], stderr


def nonfinite_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "NaN/Inf" in line]


def test_fsdp_every_rank_skips_the_step_only_rank_1s_shard_made_nonfinite(tmp_path: Path) -> None:
    reports, stderr = run_worker(tmp_path / "out", ["backend=fsdp", "reliability.on_nonfinite=skip"])
    for rank, (report, err) in enumerate(zip(reports, stderr)):
        assert nonfinite_lines(err) == [f"[rank {rank}] {REASON}; step skipped (on_nonfinite: skip)"], (rank, err)
        assert report["error"] is None, report
        assert report["steps"] == list(range(1, STEPS + 1)), report
        digests = report["digests"]
        assert digests[str(POISON_AT)] == digests[str(POISON_AT - 1)], f"rank {rank}: the skipped step changed weights"
        assert digests[str(POISON_AT + 1)] != digests[str(POISON_AT)], f"rank {rank}: training did not go on"
    assert reports[0]["digests"] == reports[1]["digests"], "the ranks' weights differ"
    manifest = json.loads((tmp_path / "out" / "model.json").read_text())
    assert manifest["global_step"] == STEPS and manifest["backend"] == "fsdp"
    assert len(set(manifest["rank_state_digests"])) == 1


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_every_rank_stops_at_the_step_only_rank_1s_partition_made_nonfinite(
        stage: int, tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    reports, stderr = run_worker(tmp_path / "out", ["backend=deepspeed", f"deepspeed.stage={stage}",
                                                    "reliability.on_nonfinite=stop"])
    for rank, report in enumerate(reports):
        assert report["error"] is not None and report["error"].startswith(f"{REASON}; stopped"), (rank, report,
                                                                                                  stderr[rank][-3000:])
        assert report["steps"] == list(range(1, POISON_AT)), report
    assert reports[0]["error"] == reports[1]["error"]
    assert reports[0]["digests"] == reports[1]["digests"], "the ranks' weights differ"
    assert not (tmp_path / "out" / "model.json").exists()  # stopped: no final model

