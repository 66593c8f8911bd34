"""Which flags make a job elastic, their defaults, and where the job goes: polytrain's driver or the real
horovodrun (dry runs, in-process)."""

import argparse
import sys

import pytest

from polytrain.errors import LaunchError
from polytrain.launchers import add_launch_arguments, launch_from_args
from polytrain.launchers import elastic as elastic_package
from polytrain.launchers.elastic import options_from_args, uses_driver
from polytrain.launchers.elastic.options import ElasticOptions, is_elastic


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return parser.parse_args(list(argv))


def test_elastic_as_horovod_decides(monkeypatch):
    assert is_elastic(parse("-np", "2", "--min-np", "1", "w.py"))
    assert is_elastic(parse("-np", "2", "--host-discovery-script", "d.sh", "w.py"))
    assert not is_elastic(parse("-np", "2", "--max-np", "4", "w.py"))  # --max-np alone: not elastic
    monkeypatch.setenv("HOROVOD_ELASTIC_TIMEOUT", "42")
    options = options_from_args(parse("-np", "3", "--host-discovery-script", "d.sh", "--slots", "2", "w.py"), 3)
    assert options == ElasticOptions(np=3, min_np=3, max_np=None, discovery_script="d.sh", slots_per_host=2,
                                     elastic_timeout_s=42.0)  # min-np defaults to -np, max-np to unbounded
    full = options_from_args(parse("-np", "2", "--min-num-proc", "1", "--max-num-proc", "4", "--reset-limit", "0",
                                   "--blacklist-cooldown-range", "1", "2", "--elastic-timeout", "5", "w.py"), 2)
    assert full.flags() == ["--min-np", "1", "--max-np", "4", "--reset-limit", "0", "--elastic-timeout", "5",
                            "--blacklist-cooldown-range", "1", "2"]


def test_driver_or_real_horovodrun(monkeypatch, capsys, tmp_path):
    script = tmp_path / "d.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    argv = ["--launcher", "horovodrun", "-np", "2", "--min-np", "1", "--host-discovery-script", str(script),
            "--dry-run", "w.py"]
    monkeypatch.setenv("POLYTRAIN_HOROVOD_IMPL", "shim")
    assert uses_driver() and launch_from_args(parse(*argv)) == 0
    out = capsys.readouterr().out
    assert out.startswith("# polytrain's elastic driver: -np 2, --min-np 1") and f"{sys.executable} w.py" in out
    monkeypatch.setenv("POLYTRAIN_HOROVOD_IMPL", "auto")
    monkeypatch.setattr(elastic_package, "find_binary", lambda name: f"/opt/bin/{name}")  # Horovod installed
    monkeypatch.setattr("polytrain.launchers.horovodrun.find_binary", lambda name: f"/opt/bin/{name}")
    assert not uses_driver() and launch_from_args(parse(*argv)) == 0
    out = capsys.readouterr().out
    assert f"horovodrun -np 2 --min-np 1 --host-discovery-script {script}" in out
    with pytest.raises(LaunchError, match="give --launcher horovodrun"):
        launch_from_args(parse("-np", "2", "--min-np", "1", "w.py"))


def test_log_level_reaches_the_workers():
    from polytrain.launchers import request_from_args

    req = request_from_args(parse("--launcher", "horovodrun", "-np", "2", "--log-level", "debug", "w.py"))
    assert req.env["HOROVOD_LOG_LEVEL"] == "DEBUG"
    with pytest.raises(LaunchError, match="--log-level must be one of TRACE, DEBUG"):
        request_from_args(parse("-np", "2", "--log-level", "LOUD", "w.py"))
