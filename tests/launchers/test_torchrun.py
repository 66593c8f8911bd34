import sys

import pytest

from polytrain.errors import LaunchError
from polytrain.launchers import LaunchRequest, build_command, torchrun

PY = sys.executable
SPEC = (PY, "-m", "polytrain.cli", "train", "spec.yaml")


def req(**kw):
    kw.setdefault("launcher", "torchrun")
    kw.setdefault("nproc", 2)
    kw.setdefault("program", (PY, "train.py", "--lr", "0.1"))
    kw.setdefault("master_port", 29555)
    return LaunchRequest(**kw)


def test_single_node_script_pins_loopback_rendezvous():
    assert build_command(req()) == [
        "torchrun", "--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:29555", "--local_addr=127.0.0.1", "--max_restarts=0",
        "train.py", "--lr", "0.1",
    ]


def test_single_node_spec_runs_as_module_with_restarts_and_extra_args():
    cmd = build_command(req(program=SPEC, max_restarts=3, extra_args=("--monitor-interval=1",)))
    assert cmd == [
        "torchrun", "--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:29555", "--local_addr=127.0.0.1", "--max_restarts=3",
        "--monitor-interval=1", "-m", "polytrain.cli", "train", "spec.yaml",
    ]


def test_non_python_program_uses_no_python():
    cmd = build_command(req(program=("/usr/bin/env", "true")))
    assert cmd[-3:] == ["--no_python", "/usr/bin/env", "true"]


def test_builder_is_pure_and_the_port_is_chosen_once_before_it(capsys, monkeypatch):
    """A single-host job without --master-port gets one free port, picked before any command is built:
    the builder returns the same command every time, and --dry-run prints the port run() would use."""
    from polytrain import launchers
    from polytrain.launchers import base, dispatch

    bare = req(master_port=None)
    assert build_command(bare) == build_command(bare)  # no free_port() inside the builder
    chosen = dispatch.with_master_port(bare)
    assert chosen.master_port is not None and 1024 <= chosen.master_port < 65536
    assert f"--rdzv_endpoint=127.0.0.1:{chosen.master_port}" in build_command(chosen)
    assert dispatch.with_master_port(chosen) == chosen  # a given port is kept
    assert dispatch.with_master_port(req(master_port=None, hosts=[("n1", 1), ("n2", 1)])).master_port is None

    monkeypatch.setattr(base, "port_to_hold", lambda host="", count=1: 40123)
    launchers.run(bare, dry_run=True)
    assert "--rdzv_endpoint=127.0.0.1:40123" in capsys.readouterr().out
    started = []
    monkeypatch.setattr(torchrun.TorchrunLauncher, "run", lambda self, r: started.append(r) or 0)
    assert launchers.run(bare) == 0
    assert "--rdzv_endpoint=127.0.0.1:40123" in build_command(started[0])


def test_multi_node_from_hosts():
    cmd = build_command(req(nproc=8, hosts=[("n1", 4), ("n2", 4)], master_port=None, program=SPEC))
    assert cmd == [
        "torchrun", "--nnodes=2", "--nproc_per_node=4", "--rdzv_backend=c10d",
        "--rdzv_endpoint=n1:29400", "--rdzv_id=polytrain", "--max_restarts=0",
        "-m", "polytrain.cli", "train", "spec.yaml",
    ]


def test_multi_node_from_nnodes_and_master_addr():
    cmd = build_command(req(nproc=4, nnodes=2, master_addr="10.0.0.5", master_port=6000))
    assert cmd[1:6] == [
        "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.5:6000", "--rdzv_id=polytrain",
    ]


def test_multi_node_without_address_is_an_error():
    with pytest.raises(LaunchError, match="--master-addr"):
        build_command(req(nproc=4, nnodes=2))


def test_uneven_split_is_an_error():
    with pytest.raises(LaunchError, match="-np 3 does not divide evenly over 2 nodes"):
        build_command(req(nproc=3, hosts=[("n1", 2), ("n2", 2)]))


def test_run_refuses_multi_node_without_hosts():
    with pytest.raises(LaunchError, match="torchrun on 2 nodes without a host list: .* -H/--hostfile"):
        torchrun.LAUNCHER.run(req(nproc=4, nnodes=2, master_addr="10.0.0.5"))


def test_multi_host_dry_run_prints_every_host_over_ssh():
    """With hosts, each host gets its own torchrun over ssh: static rendezvous at the first host, node ranks
    in host order, the working directory and the forwarded variables on the remote command line."""
    from polytrain.launchers import ssh_fanout

    r = req(nproc=4, hosts=[("n1", 2), ("n2", 2)], master_port=None, program=SPEC, env={"A": "1 2"})
    items = ssh_fanout.torchrun_commands(r, environ={"GLOO_X": "y", "HOME": "/root"})
    assert [(i.host, i.node_rank, i.ranks) for i in items] == [("n1", 0, (0, 1)), ("n2", 1, (2, 3))]
    assert items[1].env == {"GLOO_X": "y", "A": "1 2"}
    assert items[1].command[1:8] == ("--nnodes=2", "--nproc_per_node=2", "--node_rank=1", "--master_addr=n1",
                                     "--master_port=29400", "--max_restarts=0", "-m")
    # no value on the ssh command line (any user of either host reads it in /proc): the variables go on stdin
    assert ssh_fanout.ssh_command(items[1], cwd="/w d") == [
        "ssh", "-o", "BatchMode=yes", "n2",
        f"cd '/w d' && exec {PY} -m polytrain.launchers.ssh_guard --env-on-stdin -- {items[1].command[0]} "
        "--nnodes=2 --nproc_per_node=2 --node_rank=1 --master_addr=n1 --master_port=29400 --max_restarts=0 "
        "-m polytrain.cli train spec.yaml",
    ]
    assert ssh_fanout.env_payload(items[1].env) == b'{"GLOO_X":"y","A":"1 2"}\n'
    text = torchrun.LAUNCHER.describe(r)
    assert "# n1: node 0 of 2" in text and "# n2: node 1 of 2" in text and text.count("ssh -o BatchMode=yes") == 2
    assert "#   sent on the connection's stdin: " in text and "1 2" not in text


def test_only_tensorflows_own_tf_variables_are_forwarded_to_the_hosts():
    """Terraform's TF_VAR_*/TF_TOKEN_* (tokens) stay here; TF_CONFIG names one task, so it is not copied to
    every host; TensorFlow's logging, oneDNN, thread, GPU, XLA and Keras variables go."""
    from polytrain.launchers import ssh_fanout

    environ = {"TF_VAR_db_password": "p", "TF_TOKEN_app_terraform_io": "t", "TF_CLI_ARGS": "-no-color",
               "TF_CONFIG": "{}", "TF_CPP_MIN_LOG_LEVEL": "1", "TF_ENABLE_ONEDNN_OPTS": "0",
               "TF_NUM_INTRAOP_THREADS": "2", "TF_FORCE_GPU_ALLOW_GROWTH": "true", "TF_GPU_ALLOCATOR": "cuda_malloc_async",
               "TF_XLA_FLAGS": "--tf_xla_auto_jit=2", "TF_USE_LEGACY_KERAS": "1", "TF_DETERMINISTIC_OPS": "1",
               "PYTHONHOME": "/x", "PYTHONPATH": "/p", "HOME": "/root"}
    r = req(nproc=2, hosts=[("n1", 1), ("n2", 1)], program=SPEC, env={"TF_CONFIG": "asked for"})
    assert ssh_fanout.forwarded_env(r, environ) == {
        "TF_CPP_MIN_LOG_LEVEL": "1", "TF_ENABLE_ONEDNN_OPTS": "0", "TF_NUM_INTRAOP_THREADS": "2",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true", "TF_GPU_ALLOCATOR": "cuda_malloc_async",
        "TF_XLA_FLAGS": "--tf_xla_auto_jit=2", "TF_USE_LEGACY_KERAS": "1", "TF_DETERMINISTIC_OPS": "1",
        "PYTHONPATH": "/p", "TF_CONFIG": "asked for",  # -x still forwards any variable
    }


def test_the_fanout_and_its_guard_agree_on_the_hostfile_placeholder():
    from polytrain.launchers import ssh_fanout, ssh_guard

    assert ssh_fanout.HOSTFILE_ARG == ssh_guard.HOSTFILE_ARG


def test_a_host_lost_over_ssh_names_the_ranks_that_went_with_it(capsys):
    """Its ranks recorded no end (a killed container: its board entries, if any, are on its own disk): the
    report names them, not a rank of another host that this launch stopped."""
    from polytrain.launchers import exit_board, ssh_fanout

    items = ssh_fanout.torchrun_commands(req(nproc=4, hosts=[("n1", 2), ("n2", 2)], program=SPEC), environ={})
    stopped = {r: exit_board.RankRecord(rank=r, host="n1", pid=10 + r, start=1.0) for r in (0, 1)}
    dropped = "epoch 1/15 ...\nConnection to n2 closed by remote host.\n"
    assert ssh_fanout._lost_with_host(items[1], stopped, dropped)
    assert capsys.readouterr().err.startswith("polytrain launch: ranks 2, 3 on host n2 ended with the host")
    ended = {r: exit_board.RankRecord(rank=r, host="n2", pid=r, start=1.0, end=2.0, code=1) for r in (2, 3)}
    assert not ssh_fanout._lost_with_host(items[1], {**stopped, **ended}, dropped)
    # ssh never got through: the host's ranks never started, and nothing is said of them
    never = "ssh: Could not resolve hostname n2: Temporary failure in name resolution\n"
    assert not ssh_fanout._lost_with_host(items[1], stopped, never) and capsys.readouterr().err == ""
