"""The ddp backend checks the gradients for NaN/Inf while it reduces them (adapters/torch/ddp.py): on real gloo,
its mean is DDP's own bit for bit, and a NaN on one rank is seen on every rank, once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import check, command, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def test_the_hooked_reduction_equals_ddps_and_sees_a_nan_on_any_rank() -> None:
    worker = Path(__file__).parent / "ddp_reduce_worker.py"
    result = check(run(command("torchrun", [str(worker)], nproc=2), timeout=150))
    reports = sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["identical"], report  # a power-of-two world: the same bits as DDP's built-in mean
        assert report["finite"] == [True, False, True], report  # rank 1's NaN, on both ranks; then cleared
