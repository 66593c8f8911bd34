"""docker/verify_image.py, the builder's check of what setup.sh installed, run against this venv.

The venv is a real setup.sh environment (torch 2.13.0 CPU build, DeepSpeed, maybe
TensorFlow and Horovod), so the checks see real metadata, a real torch import and,
when Horovod is installed, a real ``horovodrun --check-build``. Only the DeepSpeed
op record is a written dump (the venv's DeepSpeed has no ahead-of-time ops).
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from pathlib import Path

import pytest
from procs import REPO, run

VERIFY = REPO / "docker" / "verify_image.py"


def verify(*args: str, pythonpath: Path | None = None) -> tuple[int, list[str]]:
    """Run the checker; return its exit status and its stderr lines (one per failed check)."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    result = run([sys.executable, str(VERIFY), *args], env=env, timeout=300)
    if result.returncode == 0:
        assert result.stdout.strip() == "verify_image: ok"
    return result.returncode, result.stderr.strip().splitlines()


def version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_matching_versions_and_a_cpu_torch_pass() -> None:
    torch = version("torch")
    assert torch is not None and torch.split("+")[0] == "2.13.0"
    assert verify("--expect", "torch==2.13.0", "--expect", "numpy==" + version("numpy"), "--torch-cuda", "none") == (0, [])


def test_each_mismatch_is_one_line_naming_the_package() -> None:
    status, lines = verify("--expect", "torch==2.12.0", "--expect", "surely-not-installed-dist==1.0",
                           "--expect", "torch", "--forbid", "numpy", "--torch-cuda", "13")
    assert status == 1
    assert lines == [
        f"verify_image: torch: expected 2.12.0, found {version('torch')}",
        "verify_image: surely-not-installed-dist: expected 1.0, not installed",
        "verify_image: --expect 'torch': use NAME==VERSION",
        f"verify_image: numpy: must not be installed, found {version('numpy')}",
        "verify_image: torch: expected a CUDA 13.x build, found CUDA none",
    ]


def test_deepspeed_pin_matches_the_installed_release() -> None:
    if version("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed (setup.sh with the deepspeed extra installs it)")
    assert verify("--expect", "deepspeed==0.19.8") == (0, [])


def fake_deepspeed(root: Path, ops: dict[str, bool]) -> Path:
    package = root / "deepspeed"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('verify_image must not import deepspeed')\n")
    (package / "git_version_info_installed.py").write_text(
        f"version='0.19.8'\ninstalled_ops={ops!r}\naccelerator_name='cpu'\n")
    return root


def test_deepspeed_ops_are_read_from_the_install_record(tmp_path: Path) -> None:
    root = fake_deepspeed(tmp_path, {"deepspeed_shm_comm": True, "cpu_adam": False})
    assert verify("--deepspeed-ops", "deepspeed_shm_comm", pythonpath=root) == (0, [])
    status, lines = verify("--deepspeed-ops", "deepspeed_shm_comm,cpu_adam,fused_adam", pythonpath=root)
    assert (status, lines) == (1, [
        "verify_image: deepspeed: ops not compiled ahead of time: cpu_adam, fused_adam "
        "(they would need a compiler at run time)"])


def test_horovod_build_report_is_checked() -> None:
    if version("horovod") is None:
        pytest.skip("Horovod is not installed (scripts/build_horovod.sh builds it)")
    # one `horovodrun --check-build` (~20 s: it imports the frameworks): the version and PyTorch, MPI and Gloo
    # pass (no line of theirs), NCCL is missing on this CPU build (its one line)
    status, lines = verify("--expect", "horovod==0.28.1", "--horovod-build", "PyTorch,MPI,Gloo,NCCL")
    assert status == 1 and len(lines) == 1, lines
    assert lines[0].startswith("verify_image: horovod: built without NCCL (has: ")
    assert "PyTorch" in lines[0] and "Gloo" in lines[0] and "MPI" in lines[0]
