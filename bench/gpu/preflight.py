"""Whether the GPU check can run here, and if not, the one line that says why (exit code 2).

``python -m bench.gpu.preflight [--device cuda|cpu]`` is what ``scripts/gpu_check.sh`` asks first,
before it installs anything: it imports nothing of polytrain's, only torch (and looks the other
packages up without importing them). `versions` gathers what the results file records.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

#: import name → distribution name: what polytrain and the check import on every run
REQUIRED = {"torch": "torch", "numpy": "numpy", "yaml": "pyyaml", "safetensors": "safetensors",
            "sklearn": "scikit-learn"}
EXIT_UNAVAILABLE = 2


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_packages(find: Callable[[str], bool] = installed) -> list[str]:
    """Distribution names of the required packages that are not there."""
    return [dist for module, dist in REQUIRED.items() if not find(module)]


def torch_reason(torch: Any, device: str) -> str | None:
    """Why ``torch`` cannot run the check on ``device`` (None when it can)."""
    if device == "cpu":
        return None
    version = getattr(torch, "__version__", "?")
    if getattr(torch.version, "cuda", None) is None:
        return (f"torch {version} is a build without CUDA, so there is no GPU to check here "
                "(run on a machine with an NVIDIA GPU, or pass --device cpu for the dry run)")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
        return f"no CUDA device visible to torch {version} (CUDA {torch.version.cuda}{shown})"
    return None


def why_not(device: str, find: Callable[[str], bool] = installed,
            import_torch: Callable[[], Any] | None = None) -> str | None:
    """The one-line reason the check cannot run on ``device`` here, or None."""
    missing = missing_packages(find)
    if "torch" in missing:
        return f"torch is not installed for {sys.executable} (the check needs PyTorch with CUDA)"
    if missing:
        return (f"missing Python package(s): {', '.join(missing)} for {sys.executable} "
                "(on the GPU machine: carry them, see scripts/gpu_prepare.sh)")
    try:
        torch = import_torch() if import_torch is not None else __import__("torch")
    except Exception as exc:  # noqa: BLE001 - a broken install says why in its message
        text = " ".join(str(exc).split())[:160]
        return f"torch cannot be imported: {type(exc).__name__}: {text}"
    return torch_reason(torch, device)


def polytrain_reason() -> str | None:
    """Why polytrain (with its PyTorch adapters) cannot be imported, or None."""
    if installed("polytrain") and installed("polytrain.adapters.torch"):
        return None
    return (f"polytrain is not importable by {sys.executable}: run bash scripts/gpu_check.sh "
            "(it installs the working tree), or pip install -e .")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def versions(device: str, argv: Sequence[str] = ()) -> dict[str, str]:
    """What the results were measured on: device, driver, library versions, date and command."""
    import torch

    info: dict[str, str] = {}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        memory, sms = props.total_memory / 2**30, props.multi_processor_count
        capability = f"{props.major}.{props.minor}"
        info["device"] = f"{props.name}, {memory:.0f} GiB, {sms} SMs, compute capability {capability}"
        info["driver"] = _driver() or "unknown"
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else "none"
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        info["CUDA"] = f"{torch.version.cuda} (cuDNN {torch.backends.cudnn.version()}, NCCL {nccl})"
    else:
        cpu = platform.processor() or platform.machine()
        info["device"] = f"CPU ({cpu}, {os.cpu_count()} cores): dry run"
    info["python"] = platform.python_version()
    names = ("torch", "polytrain", "lightning", "pytorch-lightning", "accelerate", "deepspeed", "numpy")
    libraries = [f"{dist} {v}" for dist in names if (v := _version(dist))]
    info["versions"] = ", ".join(libraries)
    info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    info["command"] = " ".join(["bash scripts/gpu_check.sh", *argv])
    return info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args, _ = parser.parse_known_args(argv)
    reason = why_not(args.device)
    if reason:
        print(f"gpu_check: {reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
