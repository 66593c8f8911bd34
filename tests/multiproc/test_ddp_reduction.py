"""The ddp backend checks the gradients for NaN/Inf while it reduces them (adapters/torch/ddp.py): on real gloo,
its mean is DDP's own bit for bit, and a NaN on one rank is seen on every rank, once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import check, command, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def test_the_hooked_reduction_equals_ddps_and_sees_a_nan_on_any_rank(tmp_path: Path) -> None:
    worker = Path(__file__).parent / "ddp_reduce_worker.py"
    check(run(command("torchrun", [str(worker), str(tmp_path)], nproc=2), timeout=150))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["identical"], report  # a power-of-two world: the same bits as DDP's built-in mean
        assert report["finite"] == [True, False, True], report  # rank 1's NaN, on both ranks; then cleared
