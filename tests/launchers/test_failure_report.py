"""Which rank `polytrain launch` names: the launchers' failure output parsed (texts as the real launchers
print them), and the choice between what the ranks wrote on the exit board and what the launcher said."""

import signal

import pytest

from polytrain.launchers import registry
from polytrain.launchers.deepspeed import parse_deepspeed
from polytrain.launchers.exit_board import RankRecord
from polytrain.launchers.failure_report import (
    RankFailure,
    choose,
    launch_exit_code,
    launcher_failure_line,
    report_launcher_failure,
    report_worker_failure,
)
from polytrain.launchers.mpirun import parse_hydra, parse_openmpi
from polytrain.launchers.srun import parse_srun
from polytrain.launchers.torchrun import parse_torchrun


def parse_launcher_output(text: str) -> list[RankFailure]:
    """As `polytrain launch` reads any launcher's output: with the parsers of every registered launcher."""
    return registry.output_reading().parse(text)

KILL, TERM = int(signal.SIGKILL), int(signal.SIGTERM)

# torch 2.x torchrun, rank 1 SIGKILLed (the root cause comes after the other failures)
TORCHRUN = """\
E1125 04:25:11.061000 14690 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 14703) of binary: /venv/bin/python
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
/tmp/kill1.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-25_04:25:11
  host      : node-a
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 14702)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 14702
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-25_04:25:11
  host      : node-b
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 14703)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 14703
=======================================================
"""

OPENMPI5_SIGNAL = """\
--------------------------------------------------------------------------
prterun noticed that process rank 1 with PID 14961 on node vm exited on
signal 9 (Killed).
--------------------------------------------------------------------------
"""

OPENMPI5_EXIT = """\
--------------------------------------------------------------------------
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-16546@1,3]
   Exit code:    3
--------------------------------------------------------------------------
"""

OPENMPI4_EXIT = """\
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[55245,1],2]
  Exit code:    7
--------------------------------------------------------------------------
"""

OPENMPI_ABORT = """\
--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD
  Proc: [[14129,1],1]
  Errorcode: 1

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
--------------------------------------------------------------------------
"""

HYDRA = """\

===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   RANK 1 PID 31337 RUNNING AT node7
=   KILLED BY SIGNAL: 9 (Killed)
===================================================================================
"""

SRUN = """\
srun: error: node02: task 3: Killed
srun: launch/slurm: _step_signal: Terminating StepId=12.0
slurmstepd: error: *** STEP 12.0 ON node01 CANCELLED AT 2026-11-25T04:25:11 ***
srun: error: node01: tasks 0-1: Terminated
srun: error: node02: task 2: Exited with exit code 1
"""

DEEPSPEED = ("[2026-11-25 04:25:34,450] [ERROR] [launch.py:259:sigkill_handler] ['/venv/bin/python', '-u', "
             "'/tmp/kill1.py'] exits with return code = -9\n")


def test_torchrun_root_cause_first_then_the_other_failures():
    assert parse_torchrun(TORCHRUN) == [RankFailure(1, "node-b", signal=KILL), RankFailure(0, "node-a", signal=TERM)]


def test_torchrun_log_line_when_there_is_no_block():
    text = "E1125 ... api.py:1002] failed (exitcode: 3) local_rank: 1 (pid: 14703) of binary: /venv/bin/python\n"
    assert parse_torchrun(text) == [RankFailure(1, code=3)]


def test_open_mpi_signal_exit_code_and_abort():
    assert parse_openmpi(OPENMPI5_SIGNAL) == [RankFailure(1, "vm", signal=KILL)]
    assert parse_openmpi(OPENMPI5_EXIT) == [RankFailure(3, code=3)]
    assert parse_openmpi(OPENMPI4_EXIT) == [RankFailure(2, code=7)]
    assert parse_openmpi(OPENMPI_ABORT) == [RankFailure(1, code=1)]
    assert parse_openmpi("MPI_ABORT was invoked on rank 4 in communicator MPI_COMM_WORLD\nwith errorcode 2.") == [
        RankFailure(4, code=2)]


def test_hydra_bad_termination():
    assert parse_hydra(HYDRA) == [RankFailure(1, "node7", signal=KILL)]
    assert parse_hydra("=   PID 12 RUNNING AT n1\n=   EXIT CODE: 9\n") == [RankFailure(None, "n1", code=9)]


def test_srun_lines_name_tasks_hosts_and_how_each_ended():
    assert parse_srun(SRUN) == [
        RankFailure(3, "node02", signal=KILL), RankFailure(0, "node01", signal=TERM),
        RankFailure(1, "node01", signal=TERM), RankFailure(2, "node02", code=1),
    ]
    assert parse_srun("srun: error: n1: task 0: Segmentation fault (core dumped)\n") == [
        RankFailure(0, "n1", signal=int(signal.SIGSEGV))]


def test_deepspeed_says_the_return_code_but_not_the_rank():
    assert parse_deepspeed(DEEPSPEED) == [RankFailure(None, signal=KILL)]
    assert parse_deepspeed("worker-3: [2026] [ERROR] [launch.py:259] ['x'] exits with return code = 2\n") == [
        RankFailure(None, "worker-3", code=2)]


def test_one_entry_per_rank_in_the_order_seen():
    assert parse_launcher_output(TORCHRUN) == [RankFailure(1, "node-b", signal=KILL),
                                               RankFailure(0, "node-a", signal=TERM)]
    assert parse_launcher_output("rank 1 printed: all fine\n") == []


def record(rank, end=None, code=None, reason=None, peer_lost=False, host="h"):
    return RankRecord(rank, host, 1000 + rank, 1.0, end, code, reason, peer_lost)


def test_a_silent_rank_named_by_the_launcher_beats_the_peer_that_lost_it():
    records = {0: record(0, end=5.0, code=1, reason="rank 0: a collective failed ...", peer_lost=True), 1: record(1)}
    seen = parse_launcher_output(OPENMPI5_SIGNAL)
    assert choose(records, seen) == RankFailure(1, "h", signal=KILL)
    # the peer's failure outranks nothing even when the launcher saw it first
    assert choose(records, [RankFailure(0, code=1), RankFailure(1, signal=KILL)]).rank == 1


def test_a_rank_that_failed_on_its_own_beats_one_stopped_by_the_launcher():
    records = {0: record(0), 1: record(1, end=3.0, code=1, reason="RuntimeError: injected")}
    seen = [RankFailure(0, signal=TERM), RankFailure(1, code=1)]
    assert choose(records, seen) == RankFailure(1, "h", code=1, reason="RuntimeError: injected")
    # and without a board: the SIGTERM is the launcher's cleanup
    assert choose({}, seen).rank == 1


def test_a_rank_that_recorded_its_failure_and_was_then_stopped_is_named_by_what_it_recorded():
    """Rank 1 raised and wrote its end on the board; its peer lost it and exited first, so torchrun SIGTERMed
    rank 1 while its interpreter was still exiting: how rank 1 ended is its own error, not the launcher's stop."""
    records = {0: record(0, end=6.0, code=1, reason="rank 0: a collective failed ...", peer_lost=True),
               1: record(1, end=5.0, code=1, reason="RuntimeError: injected failure on rank 1")}
    seen = [RankFailure(1, "h", signal=TERM)]
    assert choose(records, seen) == RankFailure(1, "h", code=1, reason="RuntimeError: injected failure on rank 1")
    # the same with the watch's reading of the signal instead of the launcher's word
    assert choose(records, [], {}, {1: TERM}) == RankFailure(1, "h", code=1,
                                                             reason="RuntimeError: injected failure on rank 1")


def test_without_the_launchers_word_the_first_rank_to_die_silently_is_named():
    records = {0: record(0), 1: record(1), 2: record(2, end=9.0, code=0)}
    deaths = {0: 12.5, 1: 12.0}
    assert choose(records, [], deaths) == RankFailure(1, "h")
    # DeepSpeed said how a worker died, not which: it goes to the first that died
    assert choose(records, parse_deepspeed(DEEPSPEED), deaths) == RankFailure(1, "h", signal=KILL)


def test_a_silent_death_by_the_launchers_stop_signal_is_not_the_cause():
    """Two silent deaths noted at the same moment: the one the watch saw die of SIGTERM was stopped."""
    records = {0: record(0), 1: record(1)}
    deaths = {0: 12.0, 1: 12.0}
    assert choose(records, parse_deepspeed(DEEPSPEED), deaths, {0: TERM}) == RankFailure(1, "h", signal=KILL)
    # its own signal, when the watch read it, rather than the launcher's anonymous one
    assert choose(records, [], deaths, {0: TERM, 1: signal.SIGSEGV}) == RankFailure(1, "h", signal=signal.SIGSEGV)


def test_own_errors_in_the_order_they_happened_and_nothing_to_say():
    records = {0: record(0, end=4.0, code=2, reason="b"), 1: record(1, end=3.0, code=1, reason="a")}
    assert choose(records, []).rank == 1
    assert choose({0: record(0, end=1.0, code=0)}, []) is None
    assert choose({}, parse_deepspeed(DEEPSPEED)) == RankFailure(None, signal=KILL)


@pytest.mark.parametrize("failure,line", [
    (RankFailure(1, "vm", signal=KILL), "polytrain launch: rank 1 on host vm was killed by SIGKILL; torchrun exited "
                                        "with code 1"),
    (RankFailure(2, "vm", code=1, reason="RuntimeError: x"),
     "polytrain launch: rank 2 on host vm exited with code 1 (RuntimeError: x); torchrun exited with code 1"),
    (RankFailure(0), "polytrain launch: rank 0 ended without a word (killed by a signal such as SIGKILL, or the "
                     "out-of-memory killer); torchrun exited with code 1"),
    (RankFailure(None, signal=KILL), "polytrain launch: a rank was killed by SIGKILL (torchrun does not say which); "
                                     "torchrun exited with code 1"),
    (None, "polytrain launch: torchrun exited with code 1; no rank said how it ended"),
])
def test_the_line(failure, line):
    assert launcher_failure_line("torchrun", 1, failure) == line


def test_local_starter_line_prefers_a_rank_that_did_not_only_lose_its_peer(capsys):
    records = {0: record(0, end=2.0, code=1, reason="lost", peer_lost=True), 1: record(1, end=1.0, code=3,
                                                                                         reason="ValueError: v")}
    report_worker_failure([1, 3], records)
    assert capsys.readouterr().err == "polytrain launch: rank 1 exited with code 3; stopping the other 1 worker(s)\n"
    report_worker_failure([None, -9, None], {})
    assert capsys.readouterr().err == "polytrain launch: rank 1 was killed by SIGKILL; stopping the other 2 worker(s)\n"


def test_bad_input_on_the_rank_named_is_the_launchs_exit_code_whatever_the_launcher_says():
    """torchrun exits 1 for any failed worker; a rank that named bad input (exit 2) makes the launch exit 2, as the
    local starter and mpirun do by passing the worker's code on. Other codes and signals stay the launcher's."""
    assert launch_exit_code(1, RankFailure(0, "h", code=2, reason="model.name: cannot import 'nope'")) == 2
    assert launch_exit_code(1, RankFailure(0, "h", code=1, reason="RuntimeError: x")) == 1
    assert launch_exit_code(1, RankFailure(0, "h", code=3)) == 1
    assert launch_exit_code(1, RankFailure(1, "h", signal=KILL)) == 1
    assert launch_exit_code(1, None) == 1
    # from the exit board (a rank of this host), and from torchrun's own output alone (a rank on another host)
    records = {0: record(0, end=1.0, code=2, reason="model.name: cannot import 'nope'"), 1: record(1, end=1.0, code=2)}
    assert report_launcher_failure("torchrun", 1, records, "", parsers=(parse_torchrun,)) == 2
    output = "E1125 04:25:11.061000 14690 api.py:1002] failed (exitcode: 2) local_rank: 0 (pid: 14703) of binary: py"
    assert report_launcher_failure("torchrun", 1, {}, output, parsers=(parse_torchrun,)) == 2
