"""Malformed or self-contradicting launcher variables fail detection with one clear line."""

from __future__ import annotations

import pytest
from environments.launcher_dumps import load_dump

from polytrain.environments import detect
from polytrain.errors import EnvironmentDetectionError, UserError

BAD = {
    "rank not below size": (load_dump("torchrun_rank1", RANK="2"), "RANK=2 contradicts WORLD_SIZE=2"),
    "negative rank": (load_dump("torchrun_rank1", RANK="-1"), "RANK=-1 is below 0"),
    "non-numeric size": (load_dump("torchrun_rank1", WORLD_SIZE="two"), "WORLD_SIZE='two' is not an integer"),
    "size zero": (load_dump("env_init_rank1", RANK="0", WORLD_SIZE="0"), "WORLD_SIZE=0 is below 1"),
    "local rank not below local size": (load_dump("torchrun_rank1", LOCAL_RANK="2", RANK="2", WORLD_SIZE="4"),
                                        "LOCAL_RANK=2 contradicts LOCAL_WORLD_SIZE=2"),
    "local size above size": (load_dump("torchrun_rank1", LOCAL_WORLD_SIZE="3"),
                              "LOCAL_WORLD_SIZE=3 contradicts WORLD_SIZE=2"),
    "node rank not below nodes": (load_dump("torchrun_rank1", GROUP_RANK="1"),
                                  "GROUP_RANK=1 contradicts GROUP_WORLD_SIZE=1"),
    "port too high": (load_dump("torchrun_rank1", MASTER_PORT="70000"), "MASTER_PORT=70000 is out of range"),
    "port zero": (load_dump("deepspeed_rank1", MASTER_PORT="0"), "MASTER_PORT=0 is below 1"),
    "port not a number": (load_dump("env_init_rank1", MASTER_PORT="http"), "MASTER_PORT='http' is not an integer"),
    "empty master": (load_dump("torchrun_rank1", MASTER_ADDR=" "), "MASTER_ADDR=' ' is not a host"),
    "torchrun without port": (load_dump("torchrun_rank1", MASTER_PORT=None), "MASTER_PORT is not set"),
    "deepspeed without master": (load_dump("deepspeed_rank1", MASTER_ADDR=None), "MASTER_ADDR is not set"),
    "deepspeed node index": (load_dump("deepspeed_rank1", CROSS_RANK="1"), "CROSS_RANK=1 contradicts CROSS_SIZE=1"),
    "openmpi rank": (load_dump("openmpi5_rank1", OMPI_COMM_WORLD_RANK="2"),
                     "OMPI_COMM_WORLD_RANK=2 contradicts OMPI_COMM_WORLD_SIZE=2"),
    "openmpi missing local size": (load_dump("openmpi5_rank1", OMPI_COMM_WORLD_LOCAL_SIZE=None),
                                   "OMPI_COMM_WORLD_LOCAL_SIZE is not set"),
    "openmpi more nodes than ranks": (load_dump("openmpi4_uneven_rank4", OMPI_MCA_orte_num_nodes="6"),
                                      "OMPI_MCA_orte_num_nodes=6 is more nodes than OMPI_COMM_WORLD_SIZE=5"),
    "mpich local id": (load_dump("mpich5_rank1", MPI_LOCALRANKID="2", PMI_RANK="3", PMI_SIZE="4"),
                       "MPI_LOCALRANKID=2 contradicts MPI_LOCALNRANKS=2"),
    "mvapich local size": (load_dump("mvapich2_rank1", MV2_COMM_WORLD_LOCAL_SIZE="0"),
                           "MV2_COMM_WORLD_LOCAL_SIZE=0 is below 1"),
    "slurm node id": (load_dump("slurm_srun_rank3", SLURM_NODEID="2"), "SLURM_NODEID=2 contradicts SLURM_STEP_NUM_NODES=2"),
    "slurm task counts": (load_dump("slurm_srun_rank3", SLURM_STEP_TASKS_PER_NODE="2(x3)"),
                          "SLURM_STEP_TASKS_PER_NODE='2(x3)' describes 6 tasks on 3 nodes"),
    "slurm nodelist": (load_dump("slurm_srun_rank3", SLURM_STEP_NODELIST="node[07-"),
                       "SLURM_STEP_NODELIST='node[07-' has unbalanced brackets"),
    "slurm local id": (load_dump("slurm_srun_uneven_rank4", SLURM_LOCALID="1", SLURM_PROCID="4"),
                       "SLURM_LOCALID=1 contradicts tasks on this node=1"),
    "slurm job id": (load_dump("slurm_srun_rank3", SLURM_JOB_ID="abc"), "SLURM_JOB_ID='abc' is not a job id"),
    "lsf hosts": (load_dump("lsf_jsrun_rank7", LSB_MCPU_HOSTS="batch3 1 a01n01"), "LSB_MCPU_HOSTS='batch3 1 a01n01'"),
    "horovod node index": (load_dump("horovodrun_gloo_rank1", HOROVOD_CROSS_RANK="1"),
                           "HOROVOD_CROSS_RANK=1 contradicts HOROVOD_CROSS_SIZE=1"),
    "horovod missing local": (load_dump("horovodrun_gloo_rank1", HOROVOD_LOCAL_SIZE=None),
                              "HOROVOD_LOCAL_SIZE is not set"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_dump_raises_one_line_naming_the_variable(case: str) -> None:
    env, expected = BAD[case]
    with pytest.raises(EnvironmentDetectionError) as info:
        detect(env)
    message = str(info.value)
    assert message.startswith(expected), message
    assert "\n" not in message
    assert any(word in message for word in ("must", "expected", "allowed")), message
    assert isinstance(info.value, UserError) and info.value.exit_code == 2


def test_every_bad_case_is_distinct() -> None:
    messages = {expected for _, expected in BAD.values()}
    assert len(messages) == len(BAD) >= 8
