"""The exit board: what a polytrain worker writes when it starts and ends, read back by `polytrain launch`;
the death watch; and `--debug` reaching the launch request."""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from polytrain.cli import build_parser
from polytrain.errors import SpecError, TrainingFailure
from polytrain.launchers import add_launch_arguments, exit_board, request_from_args
from polytrain.launchers.exit_board import BOARD_VARIABLE, DeathWatch, RankRecord, read_board


def env_for(board, **extra):
    return {BOARD_VARIABLE: str(board), **extra}


def test_start_then_end_records_with_reason(tmp_path):
    env = env_for(tmp_path, OMPI_COMM_WORLD_RANK="2")
    exit_board.record_start(env)
    started = read_board(tmp_path)[2]
    assert (started.host, started.pid, started.ended) == (socket.gethostname(), os.getpid(), False)
    exit_board.record_end(2, SpecError("loop.epochs: must be >= 1"), env)
    ended = read_board(tmp_path)[2]
    assert ended.ended and (ended.code, ended.reason, ended.peer_lost) == (2, "loop.epochs: must be >= 1", False)
    assert ended.start == started.start
    assert [p.name for p in tmp_path.iterdir()] == ["rank-2.json"]  # no temporary file left


def test_a_failure_that_only_lost_a_peer_is_marked_so(tmp_path):
    env = env_for(tmp_path, RANK="0")
    try:
        try:
            raise RuntimeError("[gloo] Connection reset by peer")
        except RuntimeError as exc:
            raise TrainingFailure("rank 0: a collective failed during backward of step 7") from exc
    except TrainingFailure as exc:
        exit_board.record_end(1, exc, env)
    assert read_board(tmp_path)[0].peer_lost
    exit_board.record_end(1, ValueError("first line\nsecond line"), env)
    assert (read_board(tmp_path)[0].reason, read_board(tmp_path)[0].peer_lost) == ("ValueError: first line", False)


def test_nothing_is_written_without_a_board_a_rank_or_the_directory(tmp_path):
    exit_board.record_start({"RANK": "0"})
    exit_board.record_start(env_for(tmp_path))  # no rank variable
    exit_board.record_start(env_for(tmp_path / "on-another-host", RANK="1"))
    assert list(tmp_path.iterdir()) == []


def test_malformed_records_are_skipped(tmp_path):
    (tmp_path / "rank-0.json").write_text("{not json")
    (tmp_path / "rank-1.json").write_text(json.dumps({"rank": 1}))
    (tmp_path / "rank-2.json").write_text(json.dumps({"rank": 2, "host": "h", "pid": 5, "start": 1.0}))
    assert read_board(tmp_path) == {2: RankRecord(2, "h", 5, 1.0)}


def test_the_board_is_private_and_removed_afterwards():
    with exit_board.board() as path:
        assert path.is_dir() and (path.stat().st_mode & 0o777) == 0o700
    assert not path.exists()


def test_the_death_watch_notes_a_silent_worker_that_is_gone(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True, timeout=60)
    for rank, pid in ((0, os.getpid()), (1, int(gone.stdout))):
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps(
            {"rank": rank, "host": socket.gethostname(), "pid": pid, "start": 1.0}))
    watch = DeathWatch(tmp_path)
    watch.look()
    assert list(watch.deaths) == [int(gone.stdout)]
    assert list(watch.deaths_by_rank(read_board(tmp_path))) == [1]


def _board_entry(board, rank, pid):
    (board / f"rank-{rank}.json").write_text(json.dumps(
        {"rank": rank, "host": socket.gethostname(), "pid": pid, "start": 1.0}))


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])


@pytest.mark.timeout(60)
def test_the_death_watch_reads_the_signal_of_an_unreaped_worker(tmp_path):
    child = _sleeper()
    try:
        _board_entry(tmp_path, 3, child.pid)
        watch = DeathWatch(tmp_path)
        watch.look()
        assert watch.deaths == {}
        child.send_signal(signal.SIGTERM)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has died; we leave it unreaped
        watch.look()
        assert list(watch.deaths) == [child.pid]
        assert watch.signals_by_rank(read_board(tmp_path)) == {3: signal.SIGTERM}
    finally:
        child.kill()
        child.wait(timeout=30)


@pytest.mark.timeout(60)
def test_the_death_watch_wakes_when_a_worker_dies_not_at_its_next_poll(tmp_path):
    """With a poll interval far longer than the test, only the pidfd wake-up can note the deaths, in order."""
    first, second = _sleeper(), _sleeper()
    try:
        _board_entry(tmp_path, 0, first.pid)
        _board_entry(tmp_path, 1, second.pid)
        with DeathWatch(tmp_path, interval=3600) as watch:
            while len(watch._fds) < 2:  # the watch has looked once and waits on both
                time.sleep(0.01)
            for child in (second, first):
                child.kill()
                child.wait(timeout=30)
                while child.pid not in watch.deaths:
                    time.sleep(0.01)
        deaths = watch.deaths_by_rank(read_board(tmp_path))
        assert deaths[1] < deaths[0]
    finally:
        for child in (first, second):
            child.kill()
            child.wait(timeout=30)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,code,reason", [
    (["info", "--json"], 0, None),
    (["train", "no-such-spec.yaml"], 2, "no-such-spec.yaml"),
])
@pytest.mark.slow
def test_the_cli_records_how_a_rank_ended(tmp_path, argv, code, reason):
    env = {**os.environ, BOARD_VARIABLE: str(tmp_path), "SLURM_PROCID": "5"}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, "-m", "polytrain.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == code, done.stderr
    record = read_board(tmp_path)[5]
    assert record.ended and record.code == code
    assert (record.reason is None) if reason is None else (reason in record.reason)


def test_debug_flag_of_launch_and_of_polytrain():
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    assert request_from_args(parser.parse_args(["--debug", "-np", "2", "t.py"])).debug
    assert not request_from_args(parser.parse_args(["-np", "2", "t.py"])).debug
    cli = build_parser()
    assert request_from_args(cli.parse_args(["--debug", "launch", "-np", "2", "t.py"])).debug
    assert request_from_args(cli.parse_args(["launch", "--debug", "-np", "2", "t.py"])).debug
    assert not request_from_args(cli.parse_args(["launch", "-np", "2", "t.py"])).debug
    # after the target, --debug is the program's
    assert request_from_args(cli.parse_args(["launch", "-np", "2", "t.py", "--debug"])).program[-1] == "--debug"
