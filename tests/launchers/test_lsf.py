"""LSF batch scripts: ``polytrain launch --emit-bsub`` writes a bsub script that starts the ranks with jsrun,
and the ranks jsrun starts find their world (checked against the LSF environment detection)."""

import argparse
import sys

import pytest
from environments.launcher_dumps import load_dump

from polytrain.environments import detect
from polytrain.errors import LaunchError
from polytrain.launchers import add_launch_arguments, launch_from_args, request_from_args
from polytrain.launchers.lsf import emit_bsub, lsf_walltime

PY = sys.executable


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return parser.parse_args(list(argv))


def test_bsub_script_for_two_nodes_with_gpus(tmp_path, capsys) -> None:
    out = tmp_path / "job.bsub"
    code = launch_from_args(parse("-np", "8", "--nnodes", "2", "--gpus-per-node", "4", "--time", "1:30:00",
                                  "--partition", "batch", "--account", "ABC123", "--job-name", "lm",
                                  "-x", "NCCL_DEBUG=INFO", "--emit-bsub", str(out), "spec.yaml", "--set", "seed=1"))
    assert code == 0
    assert out.read_text() == (
        "#!/bin/bash\n"
        "#BSUB -J lm\n#BSUB -nnodes 2\n#BSUB -o lm.%J.out\n#BSUB -e lm.%J.err\n#BSUB -W 1:30\n"
        "#BSUB -q batch\n#BSUB -P ABC123\n"
        "# Written by `polytrain launch --emit-bsub`; submit with: bsub < THIS_FILE\n"
        "set -euo pipefail\n\n"
        "export NCCL_DEBUG=INFO\n"
        f"jsrun --nrs 8 --rs_per_host 4 --tasks_per_rs 1 --gpu_per_rs 1 {PY} -m polytrain.cli train spec.yaml "
        "--set seed=1\n")
    assert f"bsub < {out}" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "walltime"), [("90", "1:30"), ("02:00", "2:00"), ("00:10:01", "0:11"),
                                                ("1-00:00:00", "24:00")])
def test_walltime_is_lsf_hours_and_minutes(text: str, walltime: str) -> None:
    assert lsf_walltime(text) == walltime


@pytest.mark.parametrize(("argv", "message"), [
    (["--time", "soon"], "--time must be MM, HH:MM, HH:MM:SS or D-HH:MM:SS, got 'soon'"),
    (["--gpus-per-node", "3"], "--gpus-per-node 3 does not split evenly over 2 ranks per node"),
    (["--max-restarts", "1"], "restart"),
])
def test_bad_options_are_one_line_errors(argv: list[str], message: str) -> None:
    req = request_from_args(parse("-np", "4", "--nnodes", "2", *argv, "spec.yaml"))
    with pytest.raises(LaunchError, match=message):
        emit_bsub(req)


def test_ranks_started_by_jsrun_find_their_world() -> None:
    """What the script's jsrun gives each rank is what polytrain's LSF detection reads."""
    world = detect(load_dump("lsf_jsrun_rank7"))
    assert world.launcher == "lsf" and world.rank == 7 and world.size > 7 and world.master_addr
