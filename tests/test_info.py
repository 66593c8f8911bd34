"""`polytrain info`: versions, launchers, MPI library, Horovod build and backend usability, as JSON too."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys


def test_info_json_reports_what_is_installed() -> None:
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "info", "--json"], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["packages"]["torch"].startswith("2.13.0")
    assert report["launchers"]["mpirun"] and report["launchers"]["torchrun"]
    assert report["mpi_library"].startswith("Open MPI")
    rows = {(r["backend"], r["framework"]): r for r in report["backends"]}
    assert rows[("ddp", "torch")]["usable"] and rows[("local", "torch")]["why_not"] is None
    if getattr(importlib.util.find_spec("horovod"), "origin", None) is not None:  # not tests/horovod
        build = report["horovod_build"]
        assert build["frameworks"]["PyTorch"] and build["built"]["gloo"] and build["built"]["mpi"]
    else:
        assert report["horovod_build"] is None


def test_info_names_what_to_install_for_a_missing_backend() -> None:
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'deepspeed': raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from polytrain import info\n"
            "rows = {(r['backend'], r['framework']): r for r in info.collect()['backends']}\n"
            "print(rows[('deepspeed', 'torch')]['why_not'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "deepspeed is not installed (pip install 'polytrain[torch,deepspeed]')"


def test_info_says_when_mpi4py_cannot_load_an_mpi_library() -> None:
    """mpi4py installed but no libmpi it can load: info names why, the MPI backends are not usable, no traceback."""
    env = {**os.environ, "MPI4PY_LIBMPI": "/nonexistent/libmpi.so"}
    proc = subprocess.run([sys.executable, "-m", "polytrain.cli", "info", "--json"], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["mpi_library"] is None and "/nonexistent/libmpi.so" in report["mpi_library_error"]
    mpi_rows = [r for r in report["backends"] if r["backend"] == "mpi"]
    assert mpi_rows and all(not r["usable"] and "cannot load an MPI library" in r["why_not"] for r in mpi_rows)
    table = subprocess.run([sys.executable, "-m", "polytrain.cli", "info"], capture_output=True, text=True,
                           timeout=240, env=env)
    assert table.returncode == 0 and "Traceback" not in table.stderr
    assert "mpi library  mpi4py cannot load an MPI library" in table.stdout
