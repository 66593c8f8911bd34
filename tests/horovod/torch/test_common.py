"""Pure parts of the Horovod API: settings, topology, implementation choice, bucketing, records."""

import pytest
import torch
from environments.launcher_dumps import load_dump

from polytrain.errors import BackendUnavailableError, UserError
from polytrain.horovod import common
from polytrain.horovod.common import (
    HorovodEnvError,
    HorovodSettings,
    split_rows,
    topology_from_records,
    use_real_horovod,
)
from polytrain.horovod.torch import buckets, stall
from polytrain.horovod.torch.basics import select_backend
from polytrain.horovod.torch.collectives import resolve_op, scale_
from polytrain.horovod.torch.compression import Compression

HOROVOD_IMPORTS = common._import_error("horovod.torch") is None


def test_reduce_ops_have_horovods_values():
    assert (common.Average, common.Sum, common.Adasum, common.Min, common.Max, common.Product) == (0, 1, 2, 3, 4, 5)


def test_settings_defaults_are_horovod_0_28_1s():
    s = HorovodSettings.from_env({})
    assert s.fusion_threshold == 128 * 1024 * 1024 and s.cycle_time_ms == 1.0
    assert s.stall_check and s.stall_check_seconds == 60 and s.stall_shutdown_seconds == 0
    assert s.shutdown_after is None and s.timeline is None and s.metadata_check


def test_settings_from_variables():
    s = HorovodSettings.from_env({
        "HOROVOD_FUSION_THRESHOLD": "67108864", "HOROVOD_CYCLE_TIME": "3.5", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20", "HOROVOD_TIMELINE": "/tmp/t.json",
        "HOROVOD_STALL_CHECK_DISABLE": "1", "POLYTRAIN_HOROVOD_METADATA_CHECK": "off"})
    assert (s.fusion_threshold, s.cycle_time_ms, s.stall_check_seconds) == (64 * 1024 * 1024, 3.5, 5.0)
    assert s.shutdown_after == 20 and s.timeline == "/tmp/t.json" and not s.stall_check and not s.metadata_check
    # Horovod ignores a shutdown time shorter than the warning time
    assert HorovodSettings.from_env({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "10"}).shutdown_after is None


@pytest.mark.parametrize(("name", "value"), [
    ("HOROVOD_FUSION_THRESHOLD", "64MB"), ("HOROVOD_FUSION_THRESHOLD", "1.5"), ("HOROVOD_CYCLE_TIME", "-1"),
    ("HOROVOD_STALL_CHECK_DISABLE", "maybe"), ("POLYTRAIN_HOROVOD_IMPL", "mpi"),
])
def test_bad_values_name_the_variable_in_one_line(name, value):
    with pytest.raises(HorovodEnvError) as err:
        HorovodSettings.from_env({name: value}) if name != "POLYTRAIN_HOROVOD_IMPL" else common.implementation(
            {name: value})
    assert isinstance(err.value, UserError)
    assert name in str(err.value) and "\n" not in str(err.value)


def test_topology_from_records_homogeneous_and_not():
    two_by_two = [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    t = topology_from_records(two_by_two, 3)
    assert (t.local_rank, t.local_size, t.cross_rank, t.cross_size, t.is_homogeneous) == (1, 2, 1, 2, True)
    uneven = [(0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 0, 1)]
    assert topology_from_records(uneven, 2).cross_size == 1  # local rank 2 exists on one node only
    assert topology_from_records(uneven, 3).cross_rank == 1
    assert not topology_from_records(uneven, 0).is_homogeneous


def test_stall_message_names_ranks_and_tensors():
    text = common.stall_message({1: ["grad.w", "grad.b"], 3: ["loss"]}, 60, shutdown=True)
    assert "more than 60 seconds" in text and "Missing ranks:\n1!: [grad.b, grad.w]\n3!: [loss]" in text
    assert text.endswith("Will shutdown.")


def test_implementation_choice():
    assert use_real_horovod("torch", {"POLYTRAIN_HOROVOD_IMPL": "shim"}) is False
    with pytest.raises(BackendUnavailableError, match="POLYTRAIN_HOROVOD_IMPL=horovod but horovod.no_such"):
        use_real_horovod("no_such", {"POLYTRAIN_HOROVOD_IMPL": "horovod"})
    assert use_real_horovod("no_such", {}) is False
    # under torchrun the real Horovod would silently run n jobs of size 1: the shim is chosen
    assert use_real_horovod("torch", load_dump("torchrun_rank1")) is False
    assert use_real_horovod("torch", load_dump("openmpi5_rank1")) is HOROVOD_IMPORTS


def test_backend_selection():
    assert select_backend(cuda_available=False, nccl_available=True) == "gloo"
    assert select_backend(cuda_available=True, nccl_available=False) == "gloo"
    assert select_backend(cuda_available=True, nccl_available=True) == "cpu:gloo,cuda:nccl"


def test_reducescatter_split_gives_first_ranks_the_extra_rows():
    assert split_rows(7, 3) == [3, 2, 2]
    assert split_rows(8, 3) == [3, 3, 2]
    assert split_rows(2, 4) == [1, 1, 0, 0]


def test_resolve_op():
    assert resolve_op(None, None) == common.Average
    with pytest.deprecated_call():
        assert resolve_op(None, False) == common.Sum
    with pytest.raises(ValueError, match="Adasum"):
        resolve_op(common.Adasum, None)
    with pytest.raises(ValueError, match="supersedes"):
        resolve_op(common.Sum, True)


def test_scale_truncates_integers_like_horovod():
    assert scale_(torch.tensor([7, -7]), 0.5).tolist() == [3, -3]
    assert scale_(torch.tensor([3.0]), 0.5).tolist() == [1.5]


def test_fp16_compression_round_trip():
    x = torch.tensor([1.0, 2.5], dtype=torch.float64)
    sent, ctx = Compression.fp16.compress(x)
    assert sent.dtype == torch.float16 and Compression.fp16.decompress(sent, ctx).dtype == torch.float64
    ints = torch.tensor([1, 2])
    assert Compression.fp16.compress(ints)[0] is ints


def test_buckets_fill_in_reverse_order_up_to_the_cap():
    params = [torch.zeros(256 * 1024), torch.zeros(10), torch.zeros(300 * 1024), torch.zeros(5, dtype=torch.float64)]
    names = ["a", "b", "c", "d"]
    plan = buckets.plan_buckets(params, names, cap_bytes=2 * 1024 * 1024)
    assert [b.names for b in plan] == [["d"], ["c", "b"], ["a"]]  # first float32 bucket capped at 1 MiB
    assert plan[1].offsets == [0, 300 * 1024] and plan[1].numel == 300 * 1024 + 10
    assert buckets.layout_id(plan) == buckets.layout_id(buckets.plan_buckets(params, names, 2 * 1024 * 1024))
    one_each = buckets.plan_buckets(params, names, cap_bytes=1)
    assert len(one_each) == 4


def test_explicit_groups():
    params = [torch.zeros(2) for _ in range(5)]
    assert buckets.split_groups(params, 2) == [[0, 1, 2], [3, 4]]
    assert buckets.split_groups(params, [[params[3], params[1]]]) == [[3, 1], [0], [2], [4]]
    with pytest.raises(ValueError, match="only appear once"):
        buckets.split_groups(params, [[params[0]], [params[0]]])


def test_records_describe_the_call():
    record = stall.make_record(stall.BROADCAST, "w", [torch.zeros(2, 3, dtype=torch.float64)], extra=1)
    assert stall.describe(record.tolist(), "w") == "broadcast('w': float64[2, 3], root_rank=1)"
    a = stall.make_record(stall.ALLGATHER, "x", [torch.zeros(4, 3)], uneven=True)
    b = stall.make_record(stall.ALLGATHER, "x", [torch.zeros(1, 3)], uneven=True)
    assert int(a[stall.SHAPE]) == int(b[stall.SHAPE]) and int(a[stall.DIM0]) == 4


def test_ops_before_init_raise_horovods_error():
    import polytrain.horovod.torch.basics as basics

    with pytest.raises(ValueError, match=r"Horovod has not been initialized; use hvd.init\(\)."):
        basics.size()


def test_cpu_operations_choose_gloo_without_an_mpi_launcher_or_when_asked():
    from polytrain.horovod.torch.mpi import open_engine

    assert open_engine(load_dump("torchrun_rank1"), 2) is None  # torchrun: gloo (no MPI started)
    assert open_engine(load_dump("horovodrun_gloo_rank1"), 2) is None
    assert open_engine({**load_dump("openmpi5_rank1"), "HOROVOD_CPU_OPERATIONS": "gloo"}, 2) is None
    assert open_engine(load_dump("openmpi5_rank1"), 1) is None  # one process: nothing to move
    with pytest.raises(ValueError, match="HOROVOD_CPU_OPERATIONS='ccl'.*'mpi' or 'gloo'"):
        open_engine({**load_dump("openmpi5_rank1"), "HOROVOD_CPU_OPERATIONS": "ccl"}, 2)


def test_the_mpi_engine_carries_only_cpu_tensors_mpi_reduces_natively():
    from polytrain.horovod.torch.mpi import MpiEngine

    engine = MpiEngine.__new__(MpiEngine)  # no communicator needed to ask what it carries
    assert engine.carries(torch.ones(3), torch.ones(2, dtype=torch.int64), torch.ones(1, dtype=torch.uint8))
    for tensor in (torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.bfloat16),
                   torch.ones(3, dtype=torch.bool), torch.ones(4, 4).t()):
        assert not engine.carries(tensor)


def test_real_and_shim_export_the_same_names_the_package_does():
    import polytrain.horovod.torch as hvd
    from polytrain.horovod.torch import _shim

    assert set(_shim.__all__) == set(hvd.__all__)
    assert all(hasattr(_shim, name) for name in _shim.__all__)
    if HOROVOD_IMPORTS:
        from polytrain.horovod.torch import _real

        assert set(_real.__all__) == set(hvd.__all__)
        assert all(hasattr(_real, name) for name in _real.__all__)
