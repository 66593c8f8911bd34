"""``polytrain info``: what is installed, which launchers are on PATH, which backends can run."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

from polytrain import registry

PACKAGES = ("torch", "tensorflow", "keras", "deepspeed", "horovod", "mpi4py", "numpy", "safetensors")
LAUNCHERS = ("torchrun", "mpirun", "horovodrun", "srun", "deepspeed", "jsrun")


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


def collect() -> dict[str, Any]:
    backends = []
    for entry in registry.BACKENDS:
        reason = entry.unusable_reason()
        backends.append({"backend": entry.name, "framework": entry.framework, "usable": reason is None,
                         "why_not": reason})
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "launchers": {name: find_binary(name) for name in LAUNCHERS},
        "backends": backends,
    }


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)


def to_table(report: dict[str, Any]) -> str:
    lines = [f"python      {report['python']}  ({report['platform']})", "", "packages:"]
    lines += [f"  {name:<12} {ver or 'not installed'}" for name, ver in report["packages"].items()]
    lines += ["", "launchers:"]
    lines += [f"  {name:<12} {path or 'not on PATH'}" for name, path in report["launchers"].items()]
    lines += ["", "backends:", f"  {'backend':<16} {'framework':<11} usable"]
    for row in report["backends"]:
        usable = "yes" if row["usable"] else f"no: {row['why_not']}"
        lines.append(f"  {row['backend']:<16} {row['framework']:<11} {usable}")
    return "\n".join(lines)
