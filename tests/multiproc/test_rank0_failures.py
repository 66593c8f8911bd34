"""Failures only one rank sees end every rank at once, with the same one line (issue 16 item 7).

Two real ranks started the way a cluster script starts them (``RANK``/``WORLD_SIZE``/``MASTER_*``), each
in a working directory of its own, so a relative path can mean a different thing to each — the way a
path on a filesystem that is not shared does. Rank 0 alone: cannot make the output directory; cannot
write a checkpoint (a file-size limit on rank 0 only stands in for its full disk). Rank 1 alone: cannot
read the checkpoint rank 0 chose to resume from. The collective timeout stays at 300 s, far beyond the
test's own timeout: a rank left waiting for the others fails the test instead of ending late.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from procs import check, free_port, loopback_env, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

SETS = ["loop.epochs=1", "loop.log_every_n_steps=100", "reliability.collective_timeout_s=300",
        "reliability.stall_warning_s=300"]
LIMITED = """\
import os, resource, signal, sys
if os.environ["RANK"] == "0":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def train_args(sets: list[str], *extra: str) -> list[str]:
    return ["-m", "polytrain.cli", "train", "--quiet", *[a for s in [*SETS, *sets] for a in ("--set", s)], *extra]


def two_ranks(dirs: list[Path], args: list[str], wrapper: Path | None = None) -> list:
    """Both ranks at once, each in its own directory; their CompletedProcess, rank 0 first."""
    port, results = free_port(), [None, None]

    def one(rank: int) -> None:
        cmd = [sys.executable, *([str(wrapper)] if wrapper else []), *args]
        env = loopback_env(RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=str(port))
        results[rank] = run(cmd, env=env, cwd=dirs[rank], timeout=150)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results), "a rank's runner failed (see the output above)"
    return results


def last_line(result) -> str:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


def rank_dirs(tmp_path: Path) -> list[Path]:
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]
    for d in dirs:
        d.mkdir()
    return dirs


def test_an_output_only_rank_0_cannot_make_ends_both_ranks(tmp_path: Path) -> None:
    dirs = rank_dirs(tmp_path)
    (dirs[0] / "blocked").write_text("a file where the output directory should go")
    results = two_ranks(dirs, train_args(["output=blocked/run"]))
    expected = ("polytrain: error: output: cannot write to blocked/run (Not a directory); choose a writable "
                "directory")
    assert [r.returncode for r in results] == [2, 2], [r.stderr[-2000:] for r in results]
    assert [last_line(r) for r in results] == [expected, expected]


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_checkpoint_only_rank_0_cannot_write_ends_both_ranks(tmp_path: Path, background: bool) -> None:
    """Also when rank 0 writes it in the background: both ranks learn of it at the next save."""
    dirs = rank_dirs(tmp_path)
    wrapper = tmp_path / "limited.py"
    wrapper.write_text(LIMITED)
    out = tmp_path / "out"
    results = two_ranks(dirs, train_args([f"output={out}", "checkpoint.every_n_steps=5",
                                          f"checkpoint.async_save={str(background).lower()}"]), wrapper)
    assert [r.returncode for r in results] == [1, 1], [r.stderr[-2000:] for r in results]
    lines = [last_line(r) for r in results]
    assert lines[0] == lines[1]
    assert lines[0].startswith(f"polytrain: error: checkpoint.dir: cannot write the checkpoint of step 5 under "
                               f"{out / 'checkpoints'} (File too large); no earlier checkpoint exists"), lines[0]


def test_a_resume_path_only_rank_0_can_read_ends_both_ranks(tmp_path: Path) -> None:
    dirs = rank_dirs(tmp_path)
    out = tmp_path / "out"
    # one process writes the checkpoint into rank 0's directory only (rank 1's stays empty)
    check(run([sys.executable, *train_args([f"output={out}", "checkpoint.dir=ck", "checkpoint.every_n_epochs=1"])],
              env=loopback_env(), cwd=dirs[0], timeout=150))
    step = sorted(p.name for p in (dirs[0] / "ck").iterdir() if p.name.startswith("step-"))[-1]
    results = two_ranks(dirs, train_args([f"output={out}", "loop.epochs=2", "checkpoint.dir=ck",
                                          "checkpoint.every_n_epochs=1"], "--resume", f"ck/{step}"))
    assert [r.returncode for r in results] == [2, 2], [r.stderr[-2000:] for r in results]
    reason = f"checkpoint: ck/{step} has no manifest.json (not a polytrain checkpoint)"
    assert last_line(results[1]) == f"polytrain: error: {reason}"
    assert last_line(results[0]) == f"polytrain: error: rank 1: {reason}"
