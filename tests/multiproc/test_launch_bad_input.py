"""Bad input is exit 2 under every launcher (issue 48, item 16).

``polytrain launch`` with a ``model.name`` that cannot be imported, on 2 ranks: each worker says so in one line and
exits 2. The local starter and mpirun pass a worker's code on; torchrun exits 1 whatever its workers' codes were,
so ``polytrain launch`` gives the code of the rank it names (`failure_report.launch_exit_code`). Before, the
torchrun launch exited 1.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from procs import loopback_env, run

from polytrain.launchers import find_binary

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

LINE = "model.name: cannot import module 'no_such_module'"


@pytest.mark.parametrize("launcher", ["local", "torchrun", "mpirun"])
def test_a_bad_model_name_exits_2_under_every_launcher(tmp_path: Path, launcher: str) -> None:
    if launcher == "mpirun" and find_binary("mpirun") is None:
        pytest.skip("mpirun is not installed")
    spec = tmp_path / "spec.yaml"
    spec.write_text("framework: torch\n")
    env = loopback_env()
    if launcher == "mpirun":
        env.pop("MASTER_ADDR")  # the ranks agree on a master themselves, as under a plain mpirun
    result = run([sys.executable, "-m", "polytrain.cli", "launch", "--launcher", launcher, "-np", "2", str(spec),
                  "--quiet", "--set", "model.name=no_such_module:make", "--set", f"output={tmp_path / 'out'}"],
                 env=env, timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(rf"^polytrain: error: {re.escape(LINE)}", result.stderr, re.MULTILINE), result.stderr[-3000:]
    if launcher == "torchrun":  # the launch names the rank, and what torchrun itself said
        assert re.search(rf"^polytrain launch: rank \d on host \S+ exited with code 2 \({re.escape(LINE)}.*\); "
                         r"torchrun exited with code 1$", result.stderr, re.MULTILINE), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.left_behind == []
