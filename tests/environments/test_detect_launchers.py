"""Every launcher dump becomes the World it describes, through ``polytrain.environments.detect``."""

from __future__ import annotations

import os

import pytest
from environments.launcher_dumps import all_dump_names, load_dump

from polytrain.environments import PRECEDENCE, by_launcher, detect, detect_world, environment_for
from polytrain.world import World

# name: (rank, size, local_rank, local_size, node_rank, num_nodes, master_addr, master_port, launcher)
EXPECTED = {
    "deepspeed_rank1": (1, 2, 1, 2, 0, 1, "127.0.0.1", 29532, "deepspeed"),
    "env_init_rank1": (1, 2, 1, 2, 0, 1, "127.0.0.1", 29500, "env"),
    "horovodrun_gloo_rank1": (1, 2, 1, 2, 0, 1, "127.0.0.1", None, "horovodrun-gloo"),
    "horovodrun_mpi_mpich_rank1": (1, 2, 1, 2, 0, 1, "127.0.0.1", None, "horovodrun-mpi"),
    "horovodrun_mpi_openmpi5_rank1": (1, 2, 1, 2, 0, 1, "127.0.0.1", None, "horovodrun-mpi"),
    "intelmpi_rank2": (2, 4, 0, 2, 1, 2, None, None, "intelmpi"),
    "lsf_jsrun_rank7": (7, 12, 1, 6, 1, 2, "a01n01", 10000 + 1234567 % 20000, "lsf"),
    "mpich402_hydra_rank3": (3, 4, 1, 2, 1, 2, None, None, "mpich"),  # real, from tests/cluster
    "mpich5_rank1": (1, 2, 1, 2, 0, 1, "127.0.0.1", None, "mpich"),
    "mvapich2_rank1": (1, 4, 1, 2, 0, 2, None, None, "mvapich"),
    "openmpi4_in_slurm_rank3": (3, 4, 1, 2, 1, 2, None, None, "openmpi"),
    "openmpi4_uneven_rank4": (4, 5, 0, 1, 2, 3, None, None, "openmpi"),
    "openmpi5_rank0": (0, 2, 0, 2, 0, 1, "127.0.0.1", None, "openmpi"),
    "openmpi5_rank1": (1, 2, 1, 2, 0, 1, "127.0.0.1", None, "openmpi"),
    "polytrain_local_rank1": (1, 2, 1, 2, 0, 1, "127.0.0.1", 29533, "polytrain-local"),
    "ray_rank1": (1, 2, 1, 2, 0, 1, "127.0.0.1", 33865, "ray"),  # real, a Ray Train worker's child
    "slurm_batch_shell": (0, 1, 0, 1, 0, 1, "127.0.0.1", None, "single"),
    "slurm2205_sbatch_srun_rank3": (3, 4, 1, 2, 1, 2, "h1", 10006, "slurm"),  # real, from tests/cluster
    "slurm2205_srun_uneven_rank2": (2, 3, 0, 1, 1, 2, "h1", 10007, "slurm"),  # real, from tests/cluster
    "slurm_srun_rank3": (3, 4, 1, 2, 1, 2, "node07", 14242, "slurm"),
    "slurm_srun_uneven_rank4": (4, 5, 0, 1, 2, 3, "gpu1", 10977, "slurm"),
    "srun_mpi_pmi2_rank1": (1, 2, 1, 2, 0, 1, "node07", 14243, "slurm"),
    "torchrun_in_slurm_rank3": (3, 4, 1, 2, 1, 2, "node07", 41873, "torchrun"),
    "torchrun_rank1": (1, 2, 1, 2, 0, 1, "127.0.0.1", 29531, "torchrun"),
}


def test_every_dump_has_an_expectation() -> None:
    assert sorted(EXPECTED) == all_dump_names()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dump_gives_world(name: str) -> None:
    assert detect(load_dump(name)) == World(*EXPECTED[name])


def test_empty_environment_is_single_process() -> None:
    assert detect({}) == World(launcher="single")
    assert detect({"PATH": "/usr/bin", "HOME": "/root"}).launcher == "single"


def test_detect_world_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("OMPI_", "PMI", "SLURM_", "HOROVOD_", "TORCHELASTIC_", "JSM_", "MV2_", "POLYTRAIN_")) \
                or key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "CROSS_RANK"):
            monkeypatch.delenv(key)
    assert detect_world().launcher == "single"
    for key, value in load_dump("torchrun_rank1").items():
        monkeypatch.setenv(key, value)
    assert detect_world() == World(*EXPECTED["torchrun_rank1"])
    assert detect_world({}) == World()  # an explicit mapping wins over os.environ


def test_precedence_order_is_explicit() -> None:
    assert [cls.launcher for cls in PRECEDENCE] == [
        "polytrain-elastic", "polytrain-local", "ray", "torchrun", "deepspeed", "horovodrun-gloo", "horovodrun-mpi", "lsf",
        "openmpi", "mvapich", "intelmpi", "mpich", "slurm", "env", "single"]
    assert all(by_launcher(cls.launcher) is cls for cls in PRECEDENCE)
    assert by_launcher("nope") is None


def _position(launcher: str) -> int:
    return [cls.launcher for cls in PRECEDENCE].index(launcher)


@pytest.mark.parametrize(("before", "after"), [
    ("torchrun", "slurm"), ("polytrain-local", "slurm"), ("deepspeed", "slurm"), ("ray", "torchrun"), ("ray", "slurm"),
    ("horovodrun-gloo", "openmpi"), ("horovodrun-mpi", "openmpi"), ("horovodrun-mpi", "mpich"),
    ("horovodrun-mpi", "mvapich"), ("openmpi", "slurm"), ("mpich", "slurm"), ("intelmpi", "mpich"),
    ("mvapich", "mpich"), ("lsf", "openmpi"), ("slurm", "env"), ("env", "single"),
])
def test_precedence_pairs(before: str, after: str) -> None:
    assert _position(before) < _position(after)


STEP = load_dump("slurm_srun_rank3")


@pytest.mark.parametrize(("name", "launcher"), [
    ("torchrun_rank1", "torchrun"),
    ("polytrain_local_rank1", "polytrain-local"),
    ("ray_rank1", "ray"),
    ("deepspeed_rank1", "deepspeed"),
    ("horovodrun_gloo_rank1", "horovodrun-gloo"),
    ("openmpi5_rank1", "openmpi"),
    ("mpich5_rank1", "mpich"),
])
def test_launchers_inside_an_srun_step_win_over_slurm(name: str, launcher: str) -> None:
    env = {**STEP, **load_dump(name)}
    world = detect(env)
    assert world.launcher == launcher
    assert (world.rank, world.size) == (1, 2)  # the inner launcher's ranks, not SLURM_PROCID=3 of 4


def test_torchrun_inside_slurm_keeps_torchrun_topology() -> None:
    world = detect(load_dump("torchrun_in_slurm_rank3"))
    assert environment_for(load_dump("torchrun_in_slurm_rank3")).launcher == "torchrun"
    assert (world.rank, world.node_rank, world.master_addr) == (3, 1, "node07")


def test_mpirun_inside_slurm_is_mpi_not_the_orted_step() -> None:
    env = load_dump("openmpi4_in_slurm_rank3")
    assert environment_for(env).launcher == "openmpi"
    # without the Open MPI variables the same process would be the only task of the daemons' srun step
    bare = {k: v for k, v in env.items() if k.startswith("SLURM")}
    assert detect(bare) == World(0, 1, 0, 1, 0, 1, "node08", 14242, "slurm")


def test_horovodrun_mpi_versus_bare_openmpi() -> None:
    plain = load_dump("openmpi5_rank1")
    assert detect(plain).launcher == "openmpi"
    assert detect(load_dump("horovodrun_mpi_openmpi5_rank1")).launcher == "horovodrun-mpi"
    # a horovodrun tuning flag alone marks it too
    assert detect({**plain, "HOROVOD_CYCLE_TIME": "5.0"}).launcher == "horovodrun-mpi"
    # one of the mca flags alone does not
    assert detect({**plain, "OMPI_MCA_pml": "ob1"}).launcher == "openmpi"
    # the same world either way, only the name differs
    horovod = detect({**plain, "HOROVOD_CYCLE_TIME": "5.0"})
    assert horovod == World(*EXPECTED["openmpi5_rank1"][:-1], launcher="horovodrun-mpi")


def test_horovod_knob_without_mpi_is_not_a_world() -> None:
    assert detect({"HOROVOD_FUSION_THRESHOLD": "0"}).launcher == "single"


def test_jsrun_with_spectrum_mpi_variables_is_lsf() -> None:
    env = load_dump("lsf_jsrun_rank7")
    assert "OMPI_COMM_WORLD_RANK" in env
    assert detect(env).launcher == "lsf"
    assert detect({**env, "HOROVOD_CONTROLLER": "mpi"}) == World(*EXPECTED["lsf_jsrun_rank7"][:-1],
                                                                 launcher="horovodrun-mpi")


def test_srun_pmi2_is_slurm_but_hydra_inside_slurm_is_mpich() -> None:
    assert detect(load_dump("srun_mpi_pmi2_rank1")).launcher == "slurm"
    assert detect({**STEP, **load_dump("mpich5_rank1")}).launcher == "mpich"


def test_mpich_without_local_ids_is_one_node() -> None:
    world = detect({"PMI_RANK": "2", "PMI_SIZE": "3"})
    assert world == World(2, 3, 2, 3, 0, 1, "127.0.0.1", None, "mpich")


@pytest.mark.parametrize("step_id", ["4294967294", "4294967295", "4294967290", "batch", ""])
def test_slurm_pseudo_steps_are_not_rank_worlds(step_id: str) -> None:
    env = {**load_dump("slurm_batch_shell"), "SLURM_STEP_ID": step_id}
    assert detect(env).launcher == "single"


def test_env_init_inside_slurm_step_is_slurm() -> None:
    env = {**STEP, "RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "node07"}
    assert detect(env).launcher == "slurm"


def test_exported_master_overrides_derived_values() -> None:
    world = detect({**STEP, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "23456"})
    assert (world.master_addr, world.master_port) == ("10.0.0.9", 23456)
    world = detect(load_dump("openmpi5_rank1", MASTER_ADDR="node1", MASTER_PORT="29999"))
    assert (world.launcher, world.master_addr, world.master_port) == ("openmpi", "node1", 29999)
    world = detect(load_dump("horovodrun_gloo_rank1", MASTER_PORT="29998"))
    assert (world.master_addr, world.master_port) == ("127.0.0.1", 29998)


def test_polytrain_local_needs_the_marker_value() -> None:
    env = load_dump("polytrain_local_rank1", POLYTRAIN_LAUNCHER="mpirun")
    assert detect(env).launcher == "env"
    env = {**load_dump("torchrun_rank1"), "POLYTRAIN_LAUNCHER": "local"}
    assert detect(env).launcher == "polytrain-local"


def test_polytrain_local_launcher_variables_round_trip() -> None:
    from polytrain.launchers.base import LaunchRequest
    from polytrain.launchers.local import worker_environments

    req = LaunchRequest(launcher="local", nproc=3, program=["train.py"])
    found = [detect(env) for env in worker_environments(req, port=29555)]
    assert found == [World(r, 3, r, 3, 0, 1, "127.0.0.1", 29555, "polytrain-local") for r in range(3)]


def test_torchrun_recognised_without_torchelastic_run_id() -> None:
    env = {k: v for k, v in load_dump("torchrun_rank1").items() if not k.startswith("TORCHELASTIC")}
    assert detect(env).launcher == "torchrun"


def test_env_init_variants() -> None:
    assert detect({"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "h"}) == World(1, 3, 1, 3, 0, 1, "h", None, "env")
    world = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    assert (world.node_rank, world.num_nodes) == (1, 2)
    world = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h"})
    assert (world.local_rank, world.local_size, world.num_nodes) == (1, 4, 1)


def test_slurm_fallbacks() -> None:
    env = {k: v for k, v in STEP.items() if "TASKS_PER_NODE" not in k}
    assert detect(env).local_size == 2  # 4 tasks evenly over 2 nodes
    env = {**env, "SLURM_NTASKS_PER_NODE": "2"}
    assert detect(env).local_size == 2
    env = {k: v for k, v in STEP.items() if "NODELIST" not in k}
    assert detect(env).master_addr is None
    assert detect({**STEP, "SLURM_JOB_ID": "1234_7"}).master_port == 10000 + 1234
    assert detect({**STEP, "SLURM_STEP_ID": "2", "SLURM_STEPID": "2"}).launcher == "slurm"


def test_lsf_hosts_fallbacks() -> None:
    env = load_dump("lsf_jsrun_rank7", LSB_MCPU_HOSTS=None, LSB_HOSTS="batch3 a01n01 a01n01 a01n02 a01n02")
    assert detect(env).master_addr == "a01n01"
    env = load_dump("lsf_jsrun_rank7", LSB_MCPU_HOSTS="hostA 4", LSB_JOBID=None)
    assert (detect(env).master_addr, detect(env).master_port) == ("hostA", None)
    uneven = load_dump("lsf_jsrun_rank7", JSM_NAMESPACE_SIZE="10", JSM_NAMESPACE_LOCAL_SIZE="4",
                       JSM_NAMESPACE_RANK="9", JSM_NAMESPACE_LOCAL_RANK="1",
                       LSB_MCPU_HOSTS="batch3 1 a 42 b 42 c 42")
    world = detect(uneven)
    assert (world.num_nodes, world.node_rank) == (3, 2)
