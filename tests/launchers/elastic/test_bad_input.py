"""Bad input to an elastic horovodrun job, through the real CLI: one line naming the flag or file and what is
allowed, exit code 2, no traceback, nothing left running (issue 50 item 6)."""

import os
import sys

import pytest
from procs import loopback_env, run

LAUNCH = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "horovodrun"]


def _script(tmp_path, name, body, mode=0o755):
    path = tmp_path / name
    path.write_text(body)
    os.chmod(path, mode)
    return str(path)


def _fails(tmp_path, flags, expected, **env):
    program = _script(tmp_path, "w.py", "raise SystemExit('a worker must not start')\n")
    result = run([*LAUNCH, *flags, program], timeout=60,
                 env=loopback_env(POLYTRAIN_HOROVOD_IMPL="shim", **env))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.left_behind == []


@pytest.mark.parametrize(("flags", "expected"), [
    (["-np", "2", "--min-np", "3", "--max-np", "2"], "--min-np 3 is more than --max-np 2"),
    (["-np", "5", "--min-np", "2", "--max-np", "4"], "-np 5 must be within --min-np 2 .. --max-np 4"),
    (["-np", "1", "--min-np", "2"], "-np 1 must be within --min-np 2 .. --max-np any"),
    (["-np", "2", "--min-np", "2", "--slots-per-host", "two"], "--slots-per-host must be a whole number >= 1, got 'two'"),
    (["-np", "2", "--min-np", "2", "--blacklist-cooldown-range", "10", "5"],
     "--blacklist-cooldown-range 10 5: MIN is more than MAX"),
    (["-np", "2", "--min-np", "x"], "--min-np must be a whole number >= 1, got 'x'"),
    (["-np", "2", "--min-np", "2", "--elastic-timeout", "0"], "--elastic-timeout must be a number of seconds > 0"),
])
def test_bad_flags(tmp_path, flags, expected):
    _fails(tmp_path, flags, expected)


DISCOVER = ["-np", "2", "--min-np", "1", "--host-discovery-script"]


def test_discovery_script_missing_or_not_executable(tmp_path):
    _fails(tmp_path, [*DISCOVER, str(tmp_path / "nope.sh")], f"--host-discovery-script {tmp_path / 'nope.sh'}: no such file")
    plain = _script(tmp_path, "plain.sh", "#!/bin/sh\necho localhost:2\n", mode=0o644)
    _fails(tmp_path, [*DISCOVER, plain], f"--host-discovery-script {plain}: not an executable file")


def test_discovery_script_failing_slow_or_malformed(tmp_path):
    failing = _script(tmp_path, "fail.sh", "#!/bin/sh\necho cannot list the pool >&2\nexit 4\n")
    _fails(tmp_path, [*DISCOVER, failing], f"{failing} failed with exit code 4: cannot list the pool")
    slow = _script(tmp_path, "slow.sh", "#!/bin/sh\nsleep 60\necho localhost:2\n")
    _fails(tmp_path, [*DISCOVER, slow], f"{slow} ran longer than 1 s", POLYTRAIN_ELASTIC_DISCOVERY_TIMEOUT="1")
    malformed = _script(tmp_path, "bad.sh", "#!/bin/sh\necho localhost:2\necho 'node-3 slots=2'\n")
    _fails(tmp_path, [*DISCOVER, malformed], f"{malformed} printed a malformed line 'node-3 slots=2'")
    _fails(tmp_path, ["-H", "localhost:2", *DISCOVER, malformed],
           "give either --host-discovery-script or -H/--hostfile, not both")
