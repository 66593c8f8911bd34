"""scripts/patch_horovod.py on the real Horovod 0.28.1 sdist: the CPU patches alone by default, the GPU patches
(NCCL build) only with --gpu and under a level of their own, so that the CPU wheel's cache key never moves with
them; applying twice is harmless."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "patch_horovod.py"
SDIST = Path.home() / ".cache" / "polytrain" / "sdist" / "horovod-0.28.1.tar.gz"

sys.path.insert(0, str(REPO / "scripts"))
import patch_horovod  # noqa: E402


def patch(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_gpu_patches_have_their_own_level_beside_the_cpu_one() -> None:
    assert patch("--level").strip() == str(patch_horovod.PATCH_LEVEL)
    assert patch("--level", "--gpu").strip() == f"{patch_horovod.PATCH_LEVEL}g{patch_horovod.GPU_PATCH_LEVEL}"


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    if not SDIST.exists():
        pytest.skip(f"no Horovod sdist at {SDIST} (scripts/build_horovod.sh downloads it)")
    with tarfile.open(SDIST) as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path / "horovod-0.28.1"


@pytest.mark.slow
def test_cpu_patches_leave_the_tensorflow_gpu_code_as_it_was(sources: Path) -> None:
    ops = sources / "horovod" / "tensorflow" / "mpi_ops.cc"
    before = ops.read_text()
    patch(str(sources))
    assert ops.read_text() == before
    assert "nvidia/nccl/lib" not in (sources / "CMakeLists.txt").read_text()


@pytest.mark.slow
def test_gpu_patches_define_the_stream_handle_and_find_nccl_and_apply_once(sources: Path) -> None:
    first = patch(str(sources), "--gpu")
    assert first.count(": patched") == len(patch_horovod.PATCHES) + len(patch_horovod.GPU_PATCHES)
    ops = (sources / "horovod" / "tensorflow" / "mpi_ops.cc").read_text()
    assert "GpuStreamHandle AsGpuStreamValue(Stream* stream);" not in ops  # TF >= 2.17 defines no such symbol
    assert "stream->platform_specific_handle().stream" in ops
    assert ops.index("platform_specific_handle") < ops.index("stream_executor::gpu::AsGpuStreamValue(device")
    assert '"\\$ORIGIN/../../nvidia/nccl/lib"' in (sources / "CMakeLists.txt").read_text()
    xla = (sources / "horovod" / "tensorflow" / "xla_mpi_ops.cc").read_text()
    assert xla.count("#if TENSORFLOW_VERSION < 2017000000") == 1 and xla.rstrip().endswith("< 2017000000")
    again = patch(str(sources), "--gpu")
    assert ": patched" not in again and again.count("already patched") == first.count(": patched")
