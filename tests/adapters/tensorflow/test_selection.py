"""Pure choices of the TensorFlow backends: collectives, device, the TF_CONFIG cluster, ``backend: auto``."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorflow")

from polytrain import registry, validation  # noqa: E402
from polytrain.adapters.tensorflow.backend import choose_device  # noqa: E402
from polytrain.adapters.tensorflow.multiworker import (  # noqa: E402
    choose_collective,
    gather_hosts,
    tf_config,
    tf_config_from_env,
    worker_addresses,
)
from polytrain.errors import BackendUnavailableError, EnvironmentDetectionError, SpecError  # noqa: E402
from polytrain.horovod.common import _import_error  # noqa: E402
from polytrain.spec import tables as spec_mod  # noqa: E402
from polytrain.world import World  # noqa: E402


def test_ring_on_cpu_nccl_on_gpu() -> None:
    assert choose_collective(0) == "RING"
    assert choose_collective(1) == "NCCL"
    assert choose_collective(8) == "NCCL"


def test_device_one_gpu_per_local_rank() -> None:
    assert choose_device(0, 3) == (None, "/CPU:0")
    assert choose_device(4, 3) == (3, "/GPU:0")
    assert choose_device(2, 3) == (1, "/GPU:0")


def test_single_node_workers_share_the_master_address() -> None:
    world = World(rank=1, size=2, local_rank=1, local_size=2, master_addr="127.0.0.1", master_port=29500)
    hosts = gather_hosts(world)
    assert hosts == ["127.0.0.1", "127.0.0.1"]
    assert tf_config(world, hosts) == {"cluster": {"worker": ["127.0.0.1:29501", "127.0.0.1:29502"]},
                                       "task": {"type": "worker", "index": 1}}


def test_ports_count_per_host_across_nodes() -> None:
    world = World(rank=2, size=4, local_rank=0, local_size=2, node_rank=1, num_nodes=2, master_addr="a",
                  master_port=4000)
    assert worker_addresses(world, ["a", "a", "b", "b"]) == ["a:4001", "a:4002", "b:4001", "b:4002"]


def test_several_nodes_without_mpi_ask_for_tf_config() -> None:
    world = World(rank=0, size=4, local_size=2, num_nodes=2, master_addr="a", master_port=4000, launcher="torchrun")
    with pytest.raises(BackendUnavailableError, match="export TF_CONFIG"):
        gather_hosts(world)


def test_users_tf_config_is_checked_against_the_world() -> None:
    world = World(rank=1, size=2, master_port=1, launcher="torchrun")
    good = {"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 1}}
    assert tf_config_from_env({}, world) is None
    assert tf_config_from_env({"TF_CONFIG": json.dumps(good)}, world) == good
    wrong_index = {**good, "task": {"type": "worker", "index": 0}}
    with pytest.raises(EnvironmentDetectionError, match="TF_CONFIG disagrees .* rank 1 of 2"):
        tf_config_from_env({"TF_CONFIG": json.dumps(wrong_index)}, world)
    with pytest.raises(EnvironmentDetectionError, match="^TF_CONFIG is not"):
        tf_config_from_env({"TF_CONFIG": "{not json"}, world)


HOROVOD_TF = _import_error("horovod.tensorflow") is None


def tf_spec(**raw: object) -> spec_mod.TrainSpec:
    return validation.from_dict({"framework": "tensorflow", **raw})


@pytest.mark.parametrize(("launcher", "size", "expected"), [
    ("single", 1, "local"),
    ("openmpi", 2, "mpi"),
    ("mpich", 2, "mpi"),
    ("slurm", 4, "mpi"),
    ("horovodrun-mpi", 2, "horovod" if HOROVOD_TF else "mpi"),
    ("polytrain-local", 2, "tf-multiworker"),
    ("torchrun", 2, "tf-multiworker"),
    ("horovodrun-gloo", 2, "horovod" if HOROVOD_TF else "tf-multiworker"),
])
def test_auto_backend_for_tensorflow(launcher: str, size: int, expected: str) -> None:
    world = World(rank=0, size=size, local_size=size, master_port=1, launcher=launcher)
    assert registry.resolve_backend_name(tf_spec(), world) == expected


def test_tensorflow_backends_are_registered_and_torch_only_ones_refused() -> None:
    assert set(registry.backends_for("tensorflow")) >= {"local", "tf-multiworker", "mpi", "horovod"}
    assert "mpi" in registry.backends_for("torch")
    with pytest.raises(SpecError, match="backend: 'ddp' is not available for framework 'tensorflow'"):
        tf_spec(backend="ddp")
    with pytest.raises(SpecError, match="precision: 'fp16' is not supported on backend 'mpi'"):
        tf_spec(backend="mpi", precision="fp16")


@pytest.mark.parametrize("launcher", ["torchrun", "polytrain-local", "slurm"])
def test_horovod_backend_names_the_launcher_it_cannot_run_under(launcher: str) -> None:
    from polytrain.adapters.tensorflow.horovod import horovod_unusable_reason

    reason = horovod_unusable_reason(launcher)
    assert reason is not None and f"not {launcher}" in reason and "'mpi'" in reason
