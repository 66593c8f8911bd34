import io
import shutil
import sys

import pytest

from polytrain.errors import LaunchError
from polytrain.launchers import LaunchRequest, build_command, mpirun

PY = sys.executable
PROGRAM = (PY, "train.py")

OPENMPI5 = "mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
OPENMPI4 = "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
SPECTRUM = "mpirun (IBM Spectrum MPI) 10.4.0.0\n"
MPICH = (  # `mpirun --version` of the PyPI mpich 5.0.2 wheel
    "HYDRA build details:\n    Version:                                 5.0.2\n"
    "    Release Date:                            Fri Sep 25 20:45:26 UTC 2026\n"
    "    CC:                              cc\n"
    "    Configure options:                       --with-device=ch4:ucx,ofi --with-pm=hydra:gforker\n"
)
INTEL = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)\n"
MVAPICH = "HYDRA build details:\n    Version: 3.3.7\n    MVAPICH2 ...\n"


@pytest.mark.parametrize(
    "text, flavour",
    [(OPENMPI5, "openmpi"), (OPENMPI4, "openmpi"), (SPECTRUM, "openmpi"), (MPICH, "hydra"),
     (INTEL, "hydra"), (MVAPICH, "hydra"), ("some other mpirun 1.0", None), ("", None)],
)
def test_detect_flavour(text, flavour):
    assert mpirun.detect_flavour(text) == flavour


def req(**kw):
    kw.setdefault("launcher", "mpirun")
    kw.setdefault("nproc", 2)
    kw.setdefault("program", PROGRAM)
    kw.setdefault("master_port", 29555)
    kw.setdefault("mpi_flavour", "openmpi")
    kw.setdefault("as_root", False)
    return LaunchRequest(**kw)


def test_openmpi_single_host_not_root():
    assert mpirun.LAUNCHER.build_command(req(), cpu_count=2) == [
        "mpirun", "-np", "2", "--bind-to", "none", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", PY, "train.py",
    ]
    assert mpirun.LAUNCHER.launcher_env(req()) == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}


def test_openmpi_as_root_oversubscribed_with_env_and_extra_args():
    cmd = mpirun.LAUNCHER.build_command(
        req(nproc=3, as_root=True, env={"GLOO_SOCKET_IFNAME": "lo"}, extra_args=("--mca", "btl", "self,tcp")),
        cpu_count=2,
    )
    assert cmd == [
        "mpirun", "-np", "3", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
        "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "GLOO_SOCKET_IFNAME",
        "--mca", "btl", "self,tcp", PY, "train.py",
    ]


def test_no_oversubscribe_when_cores_suffice():
    assert "--oversubscribe" not in mpirun.LAUNCHER.build_command(req(nproc=4), cpu_count=4)
    assert "--oversubscribe" in mpirun.LAUNCHER.build_command(req(nproc=5), cpu_count=4)


def test_openmpi_multi_host_with_H():
    cmd = mpirun.LAUNCHER.build_command(req(nproc=4, hosts=[("n1", 2), ("n2", 2)], master_port=None), cpu_count=1)
    assert cmd == [
        "mpirun", "-np", "4", "-H", "n1:2,n2:2", "--map-by", "slot", "--bind-to", "none",
        "-x", "MASTER_ADDR", "-x", "MASTER_PORT", PY, "train.py",
    ]


def test_openmpi_hostfile_is_passed_as_a_file():
    cmd = build_command(
        req(nproc=4, hosts=[("n1", 2), ("n2", 2)], hostfile="/etc/hosts.mpi", as_root=True, master_addr="10.1.1.1")
    )
    assert cmd[:8] == ["mpirun", "-np", "4", "--hostfile", "/etc/hosts.mpi", "--map-by", "slot", "--allow-run-as-root"]
    assert "-H" not in cmd and "--oversubscribe" not in cmd
    assert cmd[cmd.index("MASTER_ADDR") - 1] == "-x"
    assert mpirun.LAUNCHER.launcher_env(req(master_addr="10.1.1.1", hosts=[("n1", 2)]))["MASTER_ADDR"] == "10.1.1.1"


def test_hydra_flavour():
    cmd = build_command(req(mpi_flavour="hydra", nproc=4, hosts=[("n1", 2), ("n2", 2)], env={"A": "1"}, as_root=True))
    assert cmd == [
        "mpiexec", "-n", "4", "-hosts", "n1:2,n2:2",
        "-genvlist", "MASTER_ADDR,MASTER_PORT,A", PY, "train.py",
    ]
    # Hydra by its own name where installed (a venv's Open MPI has an `mpiexec` too)
    hydra = "mpiexec.hydra" if shutil.which("mpiexec.hydra") else "mpiexec"
    assert mpirun.LAUNCHER.binary_name(req(mpi_flavour="hydra")) == hydra


def test_flavour_is_detected_from_the_installed_mpirun():
    path = mpirun.find_binary("mpirun")
    if path is None:
        pytest.skip("no mpirun here")
    assert mpirun.installed_flavour(path) in ("openmpi", "hydra")


@pytest.mark.parametrize("version, flavour", [(OPENMPI5, "openmpi"), (MPICH, "hydra"), (INTEL, "hydra")])
def test_flavour_comes_from_running_the_mpirun_found(tmp_path, monkeypatch, version, flavour):
    """An mpirun binary that prints ``version``: the launcher runs it and builds that flavour's command."""
    fake = tmp_path / "mpirun"
    (tmp_path / "version.txt").write_text(version)
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'version.txt'}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(mpirun, "find_binary", lambda name: str(fake))
    assert mpirun.LAUNCHER.flavour(req(mpi_flavour=None)) == flavour
    assert mpirun.LAUNCHER.binary_name(req(mpi_flavour=None)) == {"openmpi": "mpirun", "hydra": "mpiexec.hydra"}[flavour]
    assert mpirun.LAUNCHER.flavour(req(mpi_flavour="openmpi")) == "openmpi"  # a forced flavour runs nothing


def test_an_mpirun_of_unknown_flavour_is_an_error_and_none_means_openmpi(tmp_path, monkeypatch):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'some other mpirun 1.0'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(mpirun, "find_binary", lambda name: str(fake))
    with pytest.raises(LaunchError, match=f"cannot tell which MPI {fake} belongs to.*--mpi-flavour openmpi or hydra"):
        mpirun.LAUNCHER.flavour(req(mpi_flavour=None))
    monkeypatch.setattr(mpirun, "find_binary", lambda name: None)
    assert mpirun.LAUNCHER.flavour(req(mpi_flavour=None)) == "openmpi"


def test_more_processes_than_slots_is_an_error():
    with pytest.raises(LaunchError, match="-np 5 is more than the 4 slots"):
        build_command(req(nproc=5, hosts=[("n1", 2), ("n2", 2)]))


def test_restarts_are_refused():
    with pytest.raises(LaunchError, match="--max-restarts is supported by the torchrun and local launchers, not mpirun"):
        build_command(req(max_restarts=1))


def cpuinfo(*cpus: tuple[str, str] | None) -> str:
    """/proc/cpuinfo text: one block per logical CPU, with (physical id, core id) or neither (some VMs)."""
    blocks = []
    for n, ids in enumerate(cpus):
        lines = [f"processor\t: {n}", "model name\t: test cpu"]
        if ids is not None:
            lines += [f"physical id\t: {ids[0]}", f"core id\t\t: {ids[1]}"]
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks)


@pytest.mark.parametrize("text, cores", [
    # 2 sockets x 2 cores x 2 hyper-threads: 8 logical CPUs, 4 physical cores
    (cpuinfo(*[(s, c) for s in "01" for c in "01" for _ in range(2)]), 4),
    (cpuinfo(("0", "0"), ("0", "1"), ("0", "2")), 3),  # one socket, three cores, no hyper-threads
    (cpuinfo(("0", "0"), ("1", "0")), 2),  # the same core id on two sockets is two cores
])
def test_physical_cores_counts_distinct_socket_core_pairs(monkeypatch, text, cores):
    monkeypatch.setattr(mpirun, "open", lambda *a, **k: io.StringIO(text.rstrip("\n")), raising=False)
    monkeypatch.setattr(mpirun.os, "cpu_count", lambda: 99)
    assert mpirun.physical_cores() == cores


def test_physical_cores_falls_back_to_the_cpu_count(monkeypatch):
    monkeypatch.setattr(mpirun.os, "cpu_count", lambda: 6)
    monkeypatch.setattr(mpirun, "open", lambda *a, **k: io.StringIO(cpuinfo(None, None)), raising=False)
    assert mpirun.physical_cores() == 6  # no core ids in /proc/cpuinfo

    def unreadable(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(mpirun, "open", unreadable, raising=False)
    assert mpirun.physical_cores() == 6
    monkeypatch.setattr(mpirun.os, "cpu_count", lambda: None)
    assert mpirun.physical_cores() == 1  # os.cpu_count() may not know either
