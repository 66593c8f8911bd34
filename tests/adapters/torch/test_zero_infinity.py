"""ZeRO-Infinity's checks on one process, on real directories: what ``deepspeed.nvme_path`` must offer before a run
(a folder that can be made and written with direct I/O, room for what the node's ranks write) and how a write that
fails mid-run is named. The runs themselves are in tests/multiproc/test_zero_infinity.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torch")

from polytrain import validation  # noqa: E402
from polytrain.adapters.torch import zero_infinity  # noqa: E402


def nvme_spec(tmp_path: Path, **deepspeed: object) -> object:
    return validation.from_dict({"backend": "deepspeed", "output": str(tmp_path / "out"), "optimizer": {
        "name": "adam"}, "deepspeed": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": str(tmp_path / "nvme"),
                                       **deepspeed}}, validate_components=False)


def test_a_writable_folder_with_room_passes_and_keeps_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "nvme" / "job"
    assert zero_infinity.problem(folder, 4096) == ""
    assert folder.is_dir() and not list(folder.iterdir())  # the direct-I/O probe is removed


def test_a_folder_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert zero_infinity.problem(blocker / "job", 4096) == \
        f"cannot create {blocker / 'job'} (Not a directory); choose a writable directory"


def test_too_little_room_says_how_much_is_free_and_needed(tmp_path: Path) -> None:
    (tmp_path / "job").mkdir()
    free = shutil.disk_usage(tmp_path / "job").free
    text = zero_infinity.problem(tmp_path / "job", free * 2)
    assert text.startswith(f"{free / 2**20:.1f} MiB free under {tmp_path / 'job'}, but this node's ranks write "
                           f"about {free * 2 / 2**20:.1f} MiB there")


def test_needed_bytes_counts_master_gradients_state_and_parameters(tmp_path: Path) -> None:
    """Adam: fp32 master 4 + gradient 4 + two moments 8 bytes per element of a rank's partition; parameters in
    fp32 4 more; a margin of 10% for DeepSpeed's alignment, and one aligned block."""
    optimizer_only = nvme_spec(tmp_path)
    both = nvme_spec(tmp_path, offload_param="nvme")
    numel = 1_000_001
    part = 500_001
    assert zero_infinity.needed_bytes(optimizer_only, numel, 2) == int(16 * part * 1.1) + 4096
    assert zero_infinity.needed_bytes(both, numel, 2) == int(20 * part * 1.1) + 4096


def test_a_write_refused_mid_run_is_one_line_naming_the_folder_and_checkpoint(tmp_path: Path) -> None:
    spec = nvme_spec(tmp_path)
    folder = zero_infinity.job_folder(spec)
    rank_dir = folder / "zero_stage_3" / "optimizer" / "rank0"
    rank_dir.mkdir(parents=True)
    swap = rank_dir / "0_5.tensor.swp"
    swap.write_bytes(b"\0" * 4096)
    assert zero_infinity.write_failure(spec, folder, 0) is None  # writable: not the drive's fault
    subprocess.run(["chattr", "+i", str(swap)], check=True)
    try:
        failure = zero_infinity.write_failure(spec, folder, 0)
    finally:
        subprocess.run(["chattr", "-i", str(swap)], check=True)
    assert failure is not None and failure.exit_code == 1
    assert str(failure) == (f"deepspeed.nvme_path: cannot write the offloaded state under {folder} (Operation not "
                            "permitted); no checkpoint was written yet; free space or make it writable, then resume "
                            "with --resume auto")
    zero_infinity.remove(folder, 0)
    assert not (tmp_path / "nvme").exists() or not list((tmp_path / "nvme").iterdir())
