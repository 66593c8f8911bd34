"""ZeRO-Infinity's per-job folders and their locks (issue 48 item 6) on real directories, with a real second process
holding a lock (`swap_folders.hold` in a child python): a live job of the same output refuses a new one before
anything is touched; once that process is gone (the kernel lets go of its flock) its folder is a killed job's and
the next start removes it; another output's folders are never touched. Two whole DeepSpeed jobs meet in
tests/multiproc/test_zero_infinity_jobs.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from polytrain import validation  # noqa: E402
from polytrain.adapters.torch import swap_folders  # noqa: E402

HOLDER = """
import sys
from pathlib import Path
from polytrain.adapters.torch.swap_folders import hold
folder = Path(sys.argv[1])
folder.mkdir(parents=True)
hold(folder, sys.argv[2])
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""


def spec(tmp_path: Path, output: str = "out") -> object:
    return validation.from_dict({"backend": "deepspeed", "output": str(tmp_path / output), "deepspeed": {
        "stage": 3, "offload_optimizer": "nvme", "nvme_path": str(tmp_path / "nvme")}}, validate_components=False)


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_live_job_refuses_a_new_one_and_once_gone_its_folder_is_removed(tmp_path: Path) -> None:
    job, other_output = spec(tmp_path), spec(tmp_path, "elsewhere")
    nvme = tmp_path / "nvme"
    first = swap_folders.job_folder(job, "first")
    assert first != swap_folders.job_folder(job, "second") and first.name.startswith("polytrain-")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(first), str(tmp_path / "out")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        (first / "zero_stage_3" / "optimizer" / "rank0").mkdir(parents=True)
        (first / "zero_stage_3" / "optimizer" / "rank0" / "0_5.tensor.swp").write_bytes(b"\0" * 4096)
        stranger = swap_folders.job_folder(other_output, "x")  # a killed job of another output: not this one's
        stranger.mkdir()
        (stranger / swap_folders.LOCK).write_text(f'{{"output": "{tmp_path / "elsewhere"}"}}')
        before = files(nvme)

        second = swap_folders.job_folder(job, "second")
        assert swap_folders.claim(second, job) == (
            f"{first} holds the offloaded files of another job with output {tmp_path / 'out'}, still running; wait "
            "for it to end, or give this job another output")
        swap_folders.remove(second, 0)  # what prepare does on a refusal: its own folder goes
        assert files(nvme) == before and not second.exists()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    third = swap_folders.job_folder(job, "third")
    assert swap_folders.claim(third, job) == ""  # the first job is gone: its folder is a killed job's
    assert not first.exists() and stranger.is_dir()
    assert files(nvme) == sorted([f"{stranger.name}/{swap_folders.LOCK}", f"{third.name}/{swap_folders.LOCK}"])
    swap_folders.remove(third, 0)
    assert not third.exists()


def test_the_last_rank_to_let_go_removes_the_folder_and_a_dead_ranks_files_keep_it(tmp_path: Path) -> None:
    job = spec(tmp_path)
    folder = swap_folders.job_folder(job, "k")
    assert swap_folders.claim(folder, job) == ""
    for rank in (0, 1):
        (folder / "zero_stage_3" / "optimizer" / f"rank{rank}").mkdir(parents=True)
        (folder / "zero_stage_3" / "optimizer" / f"rank{rank}" / "0_5.tensor.swp").write_bytes(b"\0" * 4096)
    swap_folders.remove(folder, 0)  # rank 1 died without cleaning up: its files and the lock file stay
    assert files(tmp_path / "nvme") == [f"{folder.name}/{swap_folders.LOCK}",
                                        f"{folder.name}/zero_stage_3/optimizer/rank1/0_5.tensor.swp"]
    again = swap_folders.job_folder(job, "restarted")
    assert swap_folders.claim(again, job) == "" and not folder.exists()  # the restart finds and removes them
    swap_folders.remove(again, 0)
    assert not list((tmp_path / "nvme").iterdir())
