"""bench/horovod_suite.py runs a horovod checkout's test_torch.py on the shim, under mpirun, and tallies it.

A stand-in checkout (a test_torch.py written here, importing ``horovod.torch`` as Horovod's
does) shows that the import is rewritten, real Horovod is hidden from the ranks, one pytest
session runs per rank, and a test counts as failed when it fails on any rank.
"""

import importlib.util
import json
import sys

import pytest
from procs import REPO

pytestmark = pytest.mark.multiproc

STAND_IN = '''\
import importlib

import pytest
import torch

import horovod.torch as hvd


def test_runs_on_the_shim():
    hvd.init()
    assert hvd.IMPL == "polytrain"
    assert float(hvd.allreduce(torch.ones(1), op=hvd.Sum)) == hvd.size() == 2


def test_real_horovod_is_hidden():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("horovod")


def test_fails_on_rank_1_only():
    assert hvd.rank() == 0, "not rank 0"


def test_skipped_everywhere():
    pytest.skip("nothing to do")
'''


def load_runner():
    spec = importlib.util.spec_from_file_location("horovod_suite", REPO / "bench" / "horovod_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_runner_tallies_a_checkout_against_the_shim(tmp_path, capsys):
    checkout = tmp_path / "horovod"
    (checkout / "test" / "parallel").mkdir(parents=True)
    (checkout / "test" / "parallel" / "test_torch.py").write_text(STAND_IN)
    tally_file = tmp_path / "tally.json"
    assert load_runner().main(["--horovod", str(checkout), "--json", str(tally_file), "--timeout", "240"]) == 0
    tally = json.loads(tally_file.read_text())
    assert tally["impls"] == {"0": "polytrain", "1": "polytrain"}
    assert tally["outcomes"] == {"test_runs_on_the_shim": "passed", "test_real_horovod_is_hidden": "passed",
                                 "test_fails_on_rank_1_only": "failed", "test_skipped_everywhere": "skipped"}
    assert tally["messages"]["test_fails_on_rank_1_only"].startswith("[rank 1, call] AssertionError: not rank 0")
    printed = capsys.readouterr().out
    assert "passed 2, failed 1, skipped 1" in printed


def test_runner_refuses_a_directory_without_the_suite(tmp_path, capsys):
    assert load_runner().main(["--horovod", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"--horovod {tmp_path}: no test/parallel/test_torch.py there" in error
