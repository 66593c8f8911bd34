import sys

from polytrain.launchers import LaunchRequest
from polytrain.launchers.local import worker_environments
from polytrain.launchers.processes import exit_code

PY = sys.executable


def test_worker_environments_are_torchrun_style():
    req = LaunchRequest(launcher="local", nproc=3, program=(PY, "t.py"), env={"GLOO_SOCKET_IFNAME": "lo", "RANK": "9"})
    envs = worker_environments(req, port=23456, restart_count=1)
    assert envs == [
        {
            "GLOO_SOCKET_IFNAME": "lo",
            "RANK": str(rank),  # the launcher's rank wins over a stray RANK in env
            "WORLD_SIZE": "3",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "23456",
            "POLYTRAIN_LAUNCHER": "local",
            "POLYTRAIN_RESTART_COUNT": "1",
        }
        for rank in range(3)
    ]


def test_master_addr_can_be_overridden():
    req = LaunchRequest(launcher="local", nproc=1, program=(PY,), master_addr="localhost")
    assert worker_environments(req, 1)[0]["MASTER_ADDR"] == "localhost"


def test_exit_code_of_a_signalled_process_is_128_plus_signal():
    assert exit_code(0) == 0 and exit_code(3) == 3 and exit_code(-15) == 143 and exit_code(-9) == 137
