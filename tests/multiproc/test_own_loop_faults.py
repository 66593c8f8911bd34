"""Stall warnings and the failure report in a hand-written loop (`polytrain.loop.watch`), as in the Trainer
(tests/multiproc/test_peer_failures.py): the waiting rank names the rank that is behind and where it is; when a
peer dies, the survivor's next collective fails with one line naming it."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from procs import BIN, free_port, loopback_env, run

pytest.importorskip("torch")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

WORKER = str(Path(__file__).resolve().parent / "loop_fault_worker.py")


def test_a_stalled_rank_is_named_by_the_waiting_rank_and_the_loop_goes_on() -> None:
    """Rank 1 sleeps 6 s in its own code between steps 2 and 3; after 2 s rank 0, in step 3's backward (DDP's
    all-reduce), warns once naming rank 1 and where it is. The loop then ends normally."""
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           WORKER, "2", "300"]
    result = run(cmd, env=loopback_env(FAULT_RANK="1", FAULT_AT="3", FAULT_MODE="sleep", FAULT_SLEEP="6"),
                 timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DONE 8" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "WARNING: no progress" in line]
    named = [line for line in warnings if re.search(
        r"rank 0: WARNING: no progress in backward of step 3 for \d+ s; rank 1 is still in the script's own code "
        r"after step 2 \(the job fails after reliability.collective_timeout_s=300 s\)", line)]
    assert len(named) == 1, warnings
    assert result.left_behind == []


def test_the_survivor_of_a_killed_peer_fails_with_one_line_naming_it(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed before step 3 (ranks started by hand, so no launcher stops the survivor first): rank
    0's backward of step 3 fails, and what it raises names rank 1 from its heartbeats."""
    commands = []
    for rank in (0, 1):
        args = [sys.executable, WORKER, "60", "30"]
        commands.append(f"RANK={rank} LOCAL_RANK={rank} {shlex.join(args)} 2>{tmp_path / f'rank{rank}.err'}")
    env = loopback_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(free_port()), FAULT_RANK="1",
                       FAULT_AT="3", FAULT_MODE="kill")
    result = run(["sh", "-c", f"{commands[0]} & p0=$!; {commands[1]} & p1=$!; wait $p0; echo rank0 exit $?; "
                               f"wait $p1; echo rank1 exit $?"], env=env, timeout=180)
    survivor = (tmp_path / "rank0.err").read_text()
    last = survivor.strip().splitlines()[-1]
    assert re.match(r"(\[rank0\]: )?polytrain\.errors\.TrainingFailure: rank 0: a collective failed during backward of step 3: "
                    r"rank 1 stopped responding \(last seen in ", last), survivor[-3000:]
    assert re.findall(r"rank\d exit \d+", result.stdout) == ["rank0 exit 1", "rank1 exit 137"], result.stdout
    assert result.left_behind == []
