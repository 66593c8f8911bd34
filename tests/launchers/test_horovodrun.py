import sys

import pytest

from polytrain.errors import LaunchError
from polytrain.launchers import HorovodOptions, LaunchRequest, build_command, horovodrun, mpirun
from polytrain.launchers.horovod_worker import slot_environment

PY = sys.executable


def req(**kw):
    kw.setdefault("launcher", "horovodrun")
    kw.setdefault("nproc", 2)
    kw.setdefault("program", (PY, "train.py"))
    return LaunchRequest(**kw)


def test_command_with_every_flag():
    options = HorovodOptions(
        controller="gloo", network_interfaces=("eth0", "eth1"), start_timeout=60,
        fusion_threshold_mb=32, cycle_time_ms=2.5, timeline_filename="/tmp/tl.json", verbose=True,
    )
    cmd = build_command(req(nproc=4, hosts=[("n1", 2), ("n2", 2)], horovod=options))
    assert cmd == [
        "horovodrun", "-np", "4", "-H", "n1:2,n2:2", "--gloo", "--network-interfaces", "eth0,eth1",
        "--start-timeout", "60", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
        "--timeline-filename", "/tmp/tl.json", "--verbose", PY, "train.py",
    ]


def test_minimal_command_and_hostfile_and_mpi():
    assert build_command(req()) == ["horovodrun", "-np", "2", PY, "train.py"]
    cmd = build_command(req(nproc=4, hosts=[("n1", 4)], hostfile="hosts.txt", horovod=HorovodOptions(controller="mpi")))
    assert cmd == ["horovodrun", "-np", "4", "--hostfile", "hosts.txt", "--mpi", PY, "train.py"]


def test_slot_plan_matches_horovod_assignment():
    plan = horovodrun.slot_plan([("a", 2), ("b", 1), ("c", 2)], 4)
    assert [(s["HOROVOD_HOSTNAME"], s["HOROVOD_RANK"], s["HOROVOD_LOCAL_RANK"]) for s in plan] == [
        ("a", "0", "0"), ("a", "1", "1"), ("b", "2", "0"), ("c", "3", "0"),
    ]
    assert {s["HOROVOD_SIZE"] for s in plan} == {"4"}
    # local sizes count only the slots actually used; c gets 1 of its 2
    assert [s["HOROVOD_LOCAL_SIZE"] for s in plan] == ["2", "2", "1", "1"]
    # local rank 0 lives on a, b, c (cross size 3); local rank 1 only on a (cross size 1)
    assert [(s["HOROVOD_CROSS_RANK"], s["HOROVOD_CROSS_SIZE"]) for s in plan] == [
        ("0", "3"), ("0", "1"), ("1", "3"), ("2", "3"),
    ]


def test_fallback_environment_of_each_local_worker():
    options = HorovodOptions(fusion_threshold_mb=64, cycle_time_ms=5.0, timeline_filename="tl.json")
    envs = horovodrun.fallback_environments(req(env={"EXTRA": "x"}, horovod=options), port=31234)
    common = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "31234",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
        "HOROVOD_FUSION_THRESHOLD": str(64 * 1024 * 1024),
        "HOROVOD_CYCLE_TIME": "5.0",
        "HOROVOD_TIMELINE": "tl.json",
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "31234",
        "EXTRA": "x",
    }
    assert envs == [
        {**common, "HOROVOD_HOSTNAME": "localhost", "HOROVOD_RANK": str(r), "HOROVOD_SIZE": "2",
         "HOROVOD_LOCAL_RANK": str(r), "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0",
         "HOROVOD_CROSS_SIZE": "1"}
        for r in range(2)
    ]


def test_fallback_across_hosts_goes_through_mpirun_and_the_worker_shim():
    r = req(nproc=3, hosts=[("n1", 2), ("n2", 2)], mpi_flavour="openmpi", as_root=False,
            horovod=HorovodOptions(network_interfaces=("ib0",)))
    m = horovodrun.mpirun_fallback_request(r)
    assert m.launcher == "mpirun" and m.master_addr == "n1" and m.master_port == 29500
    assert m.program == (PY, "-m", "polytrain.launchers.horovod_worker", PY, "train.py")
    assert m.env["POLYTRAIN_HOROVOD_HOSTS"] == "n1:2,n2:2" and m.env["POLYTRAIN_HOROVOD_SIZE"] == "3"
    assert m.env["HOROVOD_GLOO_IFACE"] == "ib0" and m.env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "n1"
    cmd = build_command(m)
    assert cmd[:6] == ["mpirun", "-np", "3", "-H", "n1:2,n2:2", "--map-by"]
    assert "HOROVOD_CONTROLLER" in cmd and "MASTER_PORT" in cmd
    assert mpirun.LAUNCHER.launcher_env(m)["HOROVOD_CONTROLLER"] == "gloo" and m.env["MASTER_PORT"] == "29500"
    # what the shim adds on each rank, from the MPI rank mpirun gives it
    for mpi_rank, expected in [("0", ("n1", "0", "0")), ("2", ("n2", "2", "0"))]:
        slot = slot_environment({**m.env, "OMPI_COMM_WORLD_RANK": mpi_rank})
        assert (slot["HOROVOD_HOSTNAME"], slot["HOROVOD_RANK"], slot["HOROVOD_LOCAL_RANK"]) == expected
    assert slot_environment({**m.env, "PMI_RANK": "1"})["HOROVOD_LOCAL_RANK"] == "1"


def test_fallback_with_mpi_controller_leaves_ranks_to_mpi():
    r = req(horovod=HorovodOptions(controller="mpi", cycle_time_ms=1.0), master_port=4000)
    m = horovodrun.mpirun_fallback_request(r)
    assert m.program == (PY, "train.py")
    assert m.env == {
        "HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi", "HOROVOD_CYCLE_TIME": "1.0",
        "PYTHONUNBUFFERED": "1",
    }
    assert (m.master_addr, m.master_port) == ("127.0.0.1", 4000)


def test_worker_shim_errors():
    with pytest.raises(LaunchError, match="OMPI_COMM_WORLD_RANK"):
        slot_environment({})
    with pytest.raises(LaunchError, match="POLYTRAIN_HOROVOD_HOSTS"):
        slot_environment({"PMI_RANK": "0"})
    env = {"PMI_RANK": "4", "POLYTRAIN_HOROVOD_HOSTS": "a:2", "POLYTRAIN_HOROVOD_SIZE": "2"}
    with pytest.raises(LaunchError, match="PMI_RANK=4 is outside the 2 slots"):
        slot_environment(env)


def test_bad_controller():
    with pytest.raises(LaunchError, match="controller must be gloo or mpi"):
        HorovodOptions(controller="nccl")
