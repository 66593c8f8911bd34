"""A slow disk never kills a healthy job, and a writer that dies is still named (issue 48, items 1 and 2).

Each checkpoint file rank 0 writes takes ``SLOW_S`` seconds longer to reach the disk (`slow_disk/sitecustomize.py`,
a stand-in for network storage): a checkpoint's three files, and the final model's two, take longer than the
collective timeout. The other ranks wait for rank 0 on the job's side channel, by its heartbeat, not inside a
collective, so the job completes — with the weights of a run on a fast disk — and their stall warning says whom
they wait for and how long they will; rank 0's says the others wait for its own part. Before, rank 1 failed with
"a collective failed during the checkpoint at step 3" (and warned "every rank has reached it").

A writer SIGKILLed mid-write (ranks started by hand, so no launcher stops the survivor first): the rank waiting for
it names it after the collective timeout, exits 1, and nothing is left running.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import BIN, check, free_port, loopback_env, run, train

from polytrain.checkpoint.store import complete_checkpoints, load_checkpoint, read_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
SLOW_DISK = str(HERE / "slow_disk")
SLOW_S = "2"
TIMEOUT_S = "3"  # less than one checkpoint's files take to write
SETS = ["loop.max_steps=3", "checkpoint.every_n_steps=3", f"reliability.collective_timeout_s={TIMEOUT_S}",
        "reliability.stall_warning_s=1"]


def slow_env(out: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (SLOW_DISK, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "SLOW_WRITE_UNDER": str(out), "SLOW_WRITE_S": SLOW_S, **extra}


def warned(stderr: str, rank: int, activity: str, says: str) -> bool:
    pattern = rf"polytrain: rank {rank}: WARNING: no progress in {activity} for \d+ s; {re.escape(says)}"
    return any(re.search(pattern, line) for line in stderr.splitlines())


WAITS = ("this rank has done its part and waits for rank 0, still at work in it; it waits as long as that rank is "
         f"alive (the job fails only if a rank stops responding for reliability.collective_timeout_s={TIMEOUT_S} s)")
WORKS = "this rank is still at its own part of it, which the other ranks wait for as long as it is alive"


@pytest.fixture(scope="module")
def fast_disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fast")
    check(train(out, SETS, nproc=2))
    return out


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_slow_checkpoint_write_on_rank_0_is_waited_for_not_a_failure(tmp_path: Path, fast_disk: Path,
                                                                       background: bool) -> None:
    out = tmp_path / "slow"
    result = check(train(out, [*SETS, f"checkpoint.async_save={str(background).lower()}"], nproc=2,
                         env=slow_env(out)))
    want, _ = read_model(fast_disk)
    got, manifest = read_model(out)
    assert manifest["global_step"] == 3 and sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    [saved] = complete_checkpoints(out / "checkpoints")
    assert saved.name == "step-00000003" and load_checkpoint(saved)[0]["global_step"] == 3
    checkpoint = "the background write of the checkpoint at step 3" if background else "the checkpoint at step 3"
    for activity in (checkpoint, "the final model"):
        assert warned(result.stderr, 1, activity, WAITS), result.stderr[-3000:]
        assert warned(result.stderr, 0, activity, WORKS), result.stderr[-3000:]
    assert "every rank has reached it" not in result.stderr
    assert result.left_behind == []


def test_an_own_loop_waits_for_a_slow_save_on_rank_0(tmp_path: Path) -> None:
    """`Distributed.save` in a hand-written loop: the same wait; the last checkpoint holds the loop's final weights."""
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           str(HERE / "slow_save_worker.py"), "1", TIMEOUT_S]
    result = check(run(cmd, env=loopback_env(SAVE_ROOT=str(tmp_path), **slow_env(tmp_path)), timeout=150))
    done = re.search(r"^DONE 6 (\S+)$", result.stdout, re.MULTILINE)
    saved = complete_checkpoints(tmp_path)
    assert done and [p.name for p in saved] == ["step-00000003", "step-00000006"], result.stdout[-2000:]
    tensors = load_checkpoint(saved[-1])[1]["model"]
    assert sum(float(np.asarray(t, dtype=np.float64).sum()) for t in tensors.values()) == pytest.approx(
        float(done.group(1)), rel=1e-12)
    assert warned(result.stderr, 1, "the checkpoint save", WAITS), result.stderr[-3000:]
    assert warned(result.stderr, 0, "the checkpoint save", WORKS), result.stderr[-3000:]
    assert result.left_behind == []


def test_a_writer_killed_mid_write_is_named_by_the_rank_waiting_for_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    commands = []
    for rank in (0, 1):
        args = [sys.executable, "-m", "polytrain.cli", "train", "--quiet",
                *[a for s in [*SETS, f"output={out}"] for a in ("--set", s)]]
        commands.append(f"RANK={rank} LOCAL_RANK={rank} {shlex.join(args)} 2>{tmp_path / f'rank{rank}.err'}")
    env = loopback_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(free_port()),
                       **slow_env(out, SLOW_WRITE_KILL="1"))
    result = run(["sh", "-c", f"{commands[0]} & p0=$!; {commands[1]} & p1=$!; wait $p0; echo rank0 exit $?; "
                               f"wait $p1; echo rank1 exit $?"], env=env, timeout=240)
    # rank 0 died of SIGKILL at its first checkpoint file (sh: 128 + 9); rank 1 gave it up and failed
    assert re.findall(r"rank\d exit \d+", result.stdout) == ["rank0 exit 137", "rank1 exit 1"], result.stdout
    survivor = (tmp_path / "rank1.err").read_text()
    last = survivor.strip().splitlines()[-1]
    assert re.fullmatch(r"polytrain: error: rank 1: waiting for rank 0 during the checkpoint at step 3: rank 0 stopped "
                        rf"responding \(rank 0 last seen in .+; no heartbeat for {TIMEOUT_S} s: "
                        r"reliability.collective_timeout_s\)", last), survivor[-3000:]
    assert "Traceback" not in survivor
    assert complete_checkpoints(out / "checkpoints") == []  # the write never finished: nothing half-made counts
    assert result.left_behind == []
