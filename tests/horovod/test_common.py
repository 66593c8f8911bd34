"""The neutral core both frameworks alias: the op/average rule, real-vs-shim name resolution, live state."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from polytrain.errors import UserError
from polytrain.horovod import common
from polytrain.horovod.common import (
    Basics,
    HorovodArgumentError,
    HorovodUnsupportedError,
    Topology,
    resolve_names,
)


def test_names_resolve_by_presence_not_truth():
    # torch/__init__.py used to take `getattr(horovod.torch, n, None) or getattr(mpi_ops, n)`: a falsy value
    # (Average == 0) fell through to the second module
    first, second = object(), object()
    real = types.SimpleNamespace(Average=0, Sum=1, allreduce=first)
    real_ops = types.SimpleNamespace(Average="mpi_ops.Average", allreduce=second, is_homogeneous=second)
    average, total, allreduce, is_homogeneous = resolve_names((real, real_ops), "Average", "Sum", "allreduce",
                                                              "is_homogeneous")
    assert average == 0 and total == 1 and allreduce is first and is_homogeneous is second


def test_a_name_no_horovod_has_fails_only_when_used():
    (missing,) = resolve_names((types.SimpleNamespace(),), "grouped_reducescatter")
    with pytest.raises(HorovodUnsupportedError, match="this Horovod has no grouped_reducescatter"):
        missing([])


def test_op_average_rule_is_horovods_in_both_frameworks():
    assert common.resolve_average(None, None) == common.Average
    assert common.resolve_average(common.Max, None) == common.Max
    with pytest.deprecated_call():
        assert common.resolve_average(None, True) == common.Average
    with pytest.deprecated_call():
        assert common.resolve_average(None, False) == common.Sum
    with pytest.raises(HorovodArgumentError, match="The op parameter supersedes average") as err:
        common.resolve_average(common.Sum, True)
    assert isinstance(err.value, ValueError) and isinstance(err.value, UserError)


def test_basics_before_init_after_init_and_after_shutdown():
    basics: Basics[types.SimpleNamespace] = Basics()
    with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use hvd.init\(\).$"):
        basics.rank()
    assert not basics.is_initialized()
    topology = Topology(rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2, is_homogeneous=True)
    basics.current = types.SimpleNamespace(topology=topology)
    assert (basics.rank(), basics.size(), basics.local_rank(), basics.local_size()) == (3, 4, 1, 2)
    assert (basics.cross_rank(), basics.cross_size(), basics.is_homogeneous()) == (1, 2, True)
    basics.current = None
    with pytest.raises(ValueError, match="not been initialized"):
        basics.size()


def test_a_namespace_package_is_not_horovod(tmp_path, monkeypatch):
    (tmp_path / "not_horovod_pkg" / "torch").mkdir(parents=True)  # like tests/horovod without Horovod installed
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        error = common._import_error("not_horovod_pkg.torch")
    finally:
        for name in ("not_horovod_pkg", "not_horovod_pkg.torch"):
            sys.modules.pop(name, None)
    assert error is not None and "namespace package" in error and str(Path(tmp_path)) in error
