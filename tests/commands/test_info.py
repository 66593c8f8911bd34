"""`polytrain info`: versions, launchers, MPI library, Horovod build and backend usability, as JSON too."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from polytrain import registry


@pytest.mark.slow
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
    # the data extras with their versions, and every data.name (all readable here)
    assert report["data_packages"]["pyarrow"] == importlib.metadata.version("pyarrow")
    assert report["data_packages"]["Pillow"] == importlib.metadata.version("Pillow")
    assert [r["name"] for r in report["data_sources"]] == list(registry.source_names())
    assert all(r["usable"] and r["why_not"] is None for r in report["data_sources"])
    if getattr(importlib.util.find_spec("horovod"), "origin", None) is not None:  # not tests/horovod
        build = report["horovod_build"]
        assert build["frameworks"]["PyTorch"] and build["built"]["gloo"] and build["built"]["mpi"]
    else:
        assert report["horovod_build"] is None


@pytest.mark.slow
def test_info_names_what_to_install_for_a_missing_backend() -> None:
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'deepspeed': raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from polytrain.commands import info\n"
            "rows = {(r['backend'], r['framework']): r for r in info.collect()['backends']}\n"
            "print(rows[('deepspeed', 'torch')]['why_not'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "deepspeed is not installed (pip install 'polytrain[torch,deepspeed]')"


@pytest.mark.slow
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


def test_info_says_which_data_sources_need_the_data_extras() -> None:
    """Issue 36 item 5: without pyarrow and Pillow, info names the data.name values that cannot be read here and
    what to install (import blocked in a child process; the installed versions are still reported)."""
    code = ("import json, sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('pyarrow', 'PIL'): raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from polytrain.commands import info\n"
            "report = {'data_packages': {'pyarrow': None, 'Pillow': None}, 'data_sources': info.data_sources()}\n"
            "print(json.dumps(report['data_sources']))\n"
            "print('\\n'.join(info.data_table(report)))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, *table = proc.stdout.splitlines()
    rows = {r["name"]: r for r in json.loads(first)}
    hint = "(pip install 'polytrain[data]')"
    assert rows["parquet"] == {"name": "parquet", "usable": False, "why_not": f"pyarrow is not installed {hint}"}
    assert rows["images"]["why_not"] == f"Pillow is not installed {hint}"
    assert {name for name, row in rows.items() if row["usable"]} == set(registry.source_names()) - {"parquet", "images"}
    assert table[:3] == ["data extras (pip install 'polytrain[data]'):", "  pyarrow      not installed",
                         "  Pillow       not installed"]
    assert f"  parquet          no: pyarrow is not installed {hint}" in table and "  csv              yes" in table


@pytest.mark.slow
def test_info_says_whether_the_ray_cluster_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: the cluster ``--ray-address auto`` would use (RAY_ADDRESS here), and whether its head's port takes a
    connection: a real listener on loopback, then the same port closed."""
    import socket

    from polytrain.commands import info as info

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert info.ray_cluster() == {"address": address, "reachable": True}
    assert info.ray_cluster() == {"address": address, "reachable": False}
    assert f"ray cluster  {address} (does not answer)" in info.to_table(info.collect())
