"""``polytrain launch --elastic`` and a spec's ``elastic`` table, through the real CLI (issue 51.1, 51.7): the
local and horovodrun launchers start polytrain's elastic driver (a dry run shows it, the spec's min_np/max_np as
the flags' defaults); any other launcher, and bad numbers, are one line naming the flag or field, exit 2."""

from __future__ import annotations

import sys

import pytest
import yaml
from procs import loopback_env, run

LAUNCH = [sys.executable, "-m", "polytrain.cli", "launch"]


def _spec(tmp_path, **elastic):
    path = tmp_path / "spec.yaml"
    body = {"model": {"name": "mlp"}, "data": {"name": "digits"}, "loop": {"epochs": 1}}
    if elastic:
        body["elastic"] = elastic
    path.write_text(yaml.safe_dump(body))
    return str(path)


def _launch(args):
    return run([*LAUNCH, *args], timeout=120, env=loopback_env(POLYTRAIN_HOROVOD_IMPL="shim"))


@pytest.mark.parametrize("launcher", ["local", "horovodrun"])
def test_the_elastic_driver_runs_the_job(tmp_path, launcher):
    result = _launch(["--launcher", launcher, "--elastic", "-np", "3", "--dry-run", _spec(tmp_path, min_np=2, max_np=4)])
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("# polytrain's elastic driver: -np 3, --min-np 2, --max-np 4"), result.stdout
    flags = _launch(["--launcher", launcher, "--elastic", "-np", "3", "--min-np", "3", "--max-np", "3", "--dry-run",
                     _spec(tmp_path, min_np=2, max_np=4)])
    assert "-np 3, --min-np 3, --max-np 3" in flags.stdout.splitlines()[0]  # the flags win over the table


def test_a_spec_with_an_elastic_table_is_elastic_without_the_flag(tmp_path):
    result = _launch(["--launcher", "local", "-np", "2", "--dry-run", _spec(tmp_path, min_np=1)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# polytrain's elastic driver: -np 2, --min-np 1, --max-np every slot")


@pytest.mark.parametrize(("args", "expected"), [
    (["--launcher", "torchrun", "--elastic", "-np", "2", "x.py"],
     "--elastic: an elastic job runs under --launcher local or horovodrun (polytrain's elastic driver), not torchrun"),
    (["--launcher", "srun", "--elastic", "-np", "2", "x.py"], "--elastic: an elastic job runs under --launcher local"),
    (["--launcher", "local", "--elastic", "-np", "2", "--min-np", "3", "--max-np", "2", "x.py"],
     "--min-np 3 is more than --max-np 2"),
    (["--launcher", "local", "--elastic", "-np", "2", "--min-np", "0", "x.py"],
     "--min-np must be a whole number >= 1, got '0'"),
    (["--launcher", "local", "-np", "2", "--min-np", "2", "x.py"],
     "--min-np/--host-discovery-script make an elastic job: add --elastic"),
])
def test_bad_flags_are_one_line(args, expected):
    result = _launch(args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.left_behind == []


@pytest.mark.parametrize(("launcher", "elastic", "expected"), [
    ("torchrun", {"min_np": 1}, "elastic (the spec's table): an elastic job runs under --launcher local or "
                                "horovodrun (polytrain's elastic driver), not torchrun"),
    ("mpirun", {"min_np": 1}, "not mpirun"),
    ("local", {"min_np": 3, "max_np": 2}, "elastic.min_np: 3 is more than elastic.max_np 2"),
    ("local", {"commit_every_n_steps": 0}, "elastic.commit_every_n_steps: 0 is out of range (must be >= 1)"),
])
def test_bad_specs_are_one_line(tmp_path, launcher, elastic, expected):
    result = _launch(["--launcher", launcher, "-np", "2", _spec(tmp_path, **elastic)])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.left_behind == []
