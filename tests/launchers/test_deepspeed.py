import sys

import pytest

from polytrain.errors import LaunchError
from polytrain.launchers import LaunchRequest, build_command, deepspeed, describe

PY = sys.executable
SPEC = (PY, "-m", "polytrain.cli", "train", "spec.yaml")


def req(**kw):
    kw.setdefault("launcher", "deepspeed")
    kw.setdefault("nproc", 2)
    kw.setdefault("program", SPEC)
    kw.setdefault("master_port", 29555)
    return LaunchRequest(**kw)


def test_single_node_spec():
    assert build_command(req()) == [
        "deepspeed", "--num_gpus", "2", "--num_nodes", "1", "--master_port", "29555",
        "--no_local_rank", "--module", "polytrain.cli", "train", "spec.yaml",
    ]


def test_single_node_script_and_local_host_list():
    cmd = build_command(req(program=(PY, "train.py", "--x"), hosts=[("localhost", 2)]))
    assert cmd == [
        "deepspeed", "--num_gpus", "2", "--num_nodes", "1", "--master_port", "29555",
        "--no_local_rank", "train.py", "--x",
    ]


def test_multi_node_with_hostfile():
    cmd = build_command(req(nproc=8, hosts=[("n1", 4), ("n2", 4)], hostfile="/job/hosts", master_port=None,
                            extra_args=("--launcher", "openmpi")))
    assert cmd == [
        "deepspeed", "--num_gpus", "4", "--num_nodes", "2", "--hostfile", "/job/hosts",
        "--master_addr", "n1", "--master_port", "29500", "--no_local_rank",
        "--launcher", "openmpi", "--module", "polytrain.cli", "train", "spec.yaml",
    ]


def test_multi_node_from_H_describes_the_hostfile_it_will_write():
    r = req(nproc=4, hosts=[("n1", 2), ("n2", 2)], master_addr="10.0.0.1")
    cmd = build_command(r)
    assert cmd[5:11] == ["--hostfile", deepspeed.HOSTFILE_PLACEHOLDER, "--master_addr", "10.0.0.1", "--master_port", "29555"]
    text = describe(r)
    assert text.splitlines()[:3] == ["# <temporary hostfile>:", "#   n1 slots=2", "#   n2 slots=2"]


def test_one_remote_host_forces_multi_node_mode():
    assert "--force_multi" in build_command(req(hosts=[("remote-1", 2)], hostfile="h"))


def test_restarts_refused():
    with pytest.raises(LaunchError, match="not deepspeed"):
        build_command(req(max_restarts=2))
