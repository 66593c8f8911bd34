import argparse
import stat
import sys

import pytest

from polytrain.errors import LaunchError
from polytrain.launchers import add_launch_arguments, launch_from_args, request_from_args

PY = sys.executable


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return parser.parse_args(list(argv))


def request(*argv):
    return request_from_args(parse(*argv))


def test_spec_target_runs_through_polytrain_train():
    r = request("-np", "2", "spec.yaml")
    assert r.launcher == "local" and r.nproc == 2
    assert r.program == (PY, "-m", "polytrain.cli", "train", "spec.yaml")
    for suffix in (".yml", ".toml", ".json"):
        assert request("-np", "1", f"s{suffix}").program[-1] == f"s{suffix}"


def test_script_args_and_extra_launcher_args_split_at_double_dash():
    r = request("--launcher", "mpirun", "-np", "2", "train.py", "--lr", "0.1", "--", "--mca", "btl", "tcp")
    assert r.program == (PY, "train.py", "--lr", "0.1")
    assert r.extra_args == ("--mca", "btl", "tcp")
    r = request("-np", "2", "spec.yaml", "--", "-x", "A")
    assert r.program == (PY, "-m", "polytrain.cli", "train", "spec.yaml") and r.extra_args == ("-x", "A")
    assert request("-np", "2", "--", "train.py", "a").program == (PY, "train.py", "a")


def test_horovodrun_flags_and_hosts():
    r = request(
        "--launcher", "horovodrun", "-np", "4", "-H", "a:2,b:2", "--gloo", "--network-interfaces", "eth0,eth1",
        "--start-timeout", "30", "--fusion-threshold-mb", "0", "--cycle-time-ms", "0.5",
        "--timeline-filename", "t.json", "--verbose", "train.py",
    )
    assert r.hosts == (("a", 2), ("b", 2)) and r.hostfile is None
    h = r.horovod
    assert (h.controller, h.network_interfaces, h.start_timeout) == ("gloo", ("eth0", "eth1"), 30)
    assert (h.fusion_threshold_mb, h.cycle_time_ms, h.timeline_filename, h.verbose) == (0, 0.5, "t.json", True)


def test_hostfile_gives_hosts_path_and_default_np(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slots=3\n")
    r = request("--launcher", "mpirun", "--hostfile", str(path), "train.py")
    assert r.hosts == (("a", 2), ("b", 3)) and r.nproc == 5 and r.hostfile == str(path.resolve())


def test_env_restarts_master_and_slurm_options(monkeypatch):
    monkeypatch.setenv("FROM_HERE", "yes")
    r = request(
        "-np", "2", "-x", "A=1", "-x", "FROM_HERE", "--max-restarts", "2", "--master-addr", "10.0.0.1",
        "--master-port", "7000", "--nnodes", "1", "--partition", "cpu", "--time", "10", "--job-name", "j",
        "--gpus-per-node", "1", "--account", "acc", "--mpi-flavour", "hydra", "spec.toml",
    )
    assert r.env == {"A": "1", "FROM_HERE": "yes"}
    assert (r.max_restarts, r.master_addr, r.master_port, r.nnodes, r.mpi_flavour) == (2, "10.0.0.1", 7000, 1, "hydra")
    assert (r.slurm.partition, r.slurm.time, r.slurm.job_name, r.slurm.gpus_per_node, r.slurm.account) == (
        "cpu", "10", "j", 1, "acc",
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--launcher", "ssh", "-np", "2", "t.py"], "--launcher must be one of torchrun, mpirun, horovodrun, srun, deepspeed, local, ray; got 'ssh'"),
        (["-np", "0", "t.py"], "-np must be an integer >= 1, got '0'"),
        (["-np", "two", "t.py"], "-np must be an integer >= 1, got 'two'"),
        (["-np", "1.5", "t.py"], "-np must be an integer >= 1, got '1.5'"),
        (["t.py"], "-np N is required"),
        (["-np", "2"], "needs a spec"),
        (["-np", "2", "train.sh"], "launch target 'train.sh' must be a training spec"),
        (["-np", "2", "-H", "a:1", "--hostfile", "h", "t.py"], "either -H/--hosts or --hostfile"),
        (["-np", "2", "--max-restarts", "-1", "t.py"], "--max-restarts must be an integer >= 0"),
        (["-np", "2", "--master-port", "99999", "t.py"], "--master-port must be in 1..65535"),
        (["-np", "2", "--mpi-flavour", "lam", "t.py"], "--mpi-flavour must be openmpi or hydra"),
        (["-np", "2", "--cycle-time-ms", "fast", "t.py"], "--cycle-time-ms must be a number >= 0"),
        (["-np", "2", "-x", "NOT_SET_ANYWHERE_42", "t.py"], "-x NOT_SET_ANYWHERE_42: NOT_SET_ANYWHERE_42 is not set"),
        (["-np", "2", "-x", "1BAD=x", "t.py"], "'1BAD' is not a valid environment variable name"),
        (["-np", "2", "-H", "a:2,", "t.py"], "-H 'a:2,': empty host entry"),
        (["-np", "2", "--hostfile", "/nonexistent/hosts", "t.py"], "--hostfile /nonexistent/hosts: cannot read it"),
        (["-np", "4", "--nnodes", "3", "-H", "a:2,b:2", "t.py"], "--nnodes 3 contradicts the 2 hosts"),
    ],
)
def test_bad_flags_are_one_line_launch_errors(argv, message):
    with pytest.raises(LaunchError) as info:
        request(*argv)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_launch_from_args_emits_sbatch(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    code = launch_from_args(parse("--launcher", "srun", "-np", "4", "--nnodes", "2", "--emit-sbatch", str(out), "spec.yaml"))
    assert code == 0
    text = out.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=2" in text
    assert text.rstrip().endswith(f"{PY} -m polytrain.cli train spec.yaml")
    assert f"sbatch {out}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--requeue", "--signal=USR1@60"])
def test_requeue_and_signal_go_with_emit_sbatch_only(flag):
    with pytest.raises(LaunchError, match=f"^{flag.split('=')[0]} goes with --emit-sbatch FILE"):
        launch_from_args(parse("--launcher", "torchrun", "-np", "2", flag, "spec.yaml"))


@pytest.mark.parametrize("flag", ["--emit-sbatch", "--emit-bsub"])
@pytest.mark.parametrize("existing", [False, True])
def test_emitted_batch_scripts_are_readable_by_their_owner_only(tmp_path, monkeypatch, flag, existing):
    """The script holds the -x values (here one taken from this environment): mode 0600, also over a
    world-readable file that was there before."""
    monkeypatch.setenv("POLYTRAIN_TEST_SECRET", "s3cr3t-token")
    out = tmp_path / "job.script"
    if existing:
        out.write_text("old\n")
        out.chmod(0o644)
    assert launch_from_args(parse("-np", "2", "-x", "POLYTRAIN_TEST_SECRET", flag, str(out), "spec.yaml")) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert "export POLYTRAIN_TEST_SECRET=s3cr3t-token\n" in out.read_text()


def test_launch_from_args_dry_run_prints_and_starts_nothing(capsys):
    code = launch_from_args(parse("--dry-run", "--launcher", "mpirun", "--mpi-flavour", "openmpi", "-np", "2",
                                  "--master-port", "29999", "t.py"))
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 ")  # the values: in mpirun's environment
    assert "-np 2" in out and "-x MASTER_PORT " in out and out.rstrip().endswith(f"{PY} t.py")


@pytest.mark.parametrize("launcher", [["--launcher", "local"], ["--launcher", "torchrun"],
                                      ["--launcher", "mpirun", "--mpi-flavour", "openmpi"],
                                      ["--launcher", "mpirun", "--mpi-flavour", "hydra"]])
def test_a_dry_run_shows_a_forwarded_variable_by_name_only(launcher, capsys, monkeypatch):
    """``-x NAME`` keeps NAME's value (a token) off every command line, the dry run's printed one too (issue 48
    item 8): the line names it and passes the pasting shell's value on; ``-x NAME=VALUE`` (a value the user typed
    on the command line already) is printed as it was given."""
    monkeypatch.setenv("POLYTRAIN_TEST_SECRET", "s3cr3t-token")
    code = launch_from_args(parse("--dry-run", *launcher, "-np", "2", "--master-port", "29999",
                                  "-x", "POLYTRAIN_TEST_SECRET", "-x", "PLAIN=shown", "t.py"))
    out = capsys.readouterr().out
    assert code == 0 and "s3cr3t-token" not in out, out
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    assert lines and all('POLYTRAIN_TEST_SECRET="$POLYTRAIN_TEST_SECRET" ' in line and "PLAIN=shown " in line
                         for line in lines), out
    assert len(lines) == (2 if launcher[1] == "local" else 1)  # local: one line per worker
