"""The CPU image built with podman and run for real (docker/image_check.py, issue 34): polytrain info, the digits
job under torchrun, mpirun and horovodrun (real Horovod in the image), TensorFlow under mpirun and horovodrun, a
Horovod script through the shim, a torch model evaluated in TensorFlow; then a build cut short leaves nothing.

Skipped, with the reason, only where podman or mmdebstrap cannot run (not root, not installed). The base image
tar, the layers and the Horovod wheel are cached under ~/.cache/polytrain: a rebuild after a source change is a
few minutes, after a change to tests or examples seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import REPO, run

sys.path.insert(0, str(REPO / "docker"))
import image_check  # noqa: E402

REASON = image_check.usable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"podman cannot run here: {REASON}")


def left_behind(podman: image_check.Podman) -> list[str]:
    """Containers (ours by label, and any a build left as working containers) still in the check's storage."""
    ours = podman("ps", "-aq", "--filter", "label=polytrain-image-check").stdout.split()
    return ours + podman("ps", "-aq", "--external").stdout.split()


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(3000)  # a rebuild after a change to polytrain/ reinstalls the venv: minutes
def test_the_cpu_image_builds_and_runs_every_job(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    proc = run([sys.executable, str(REPO / "docker" / "image_check.py"), "--results", str(results)], timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:]
    found = json.loads(results.read_text())
    for name in image_check.checks():
        assert found[name]["ok"], (name, found[name])
    assert "accuracy 0.9" in found["torchrun"]["what"] and "equal" in found["mixed"]["what"]
    # the final stage has no toolchain: the builder's compilers and headers would add ~0.4 GB
    assert 2e9 < found["size_bytes"] < 4.5e9
    assert left_behind(image_check.Podman(image_check.CACHE)) == []


@pytest.mark.timeout(420)  # a build that never reaches its RUN step fails here instead of hanging
def test_a_build_cut_short_leaves_no_process_or_container(tmp_path: Path) -> None:
    podman = image_check.Podman(image_check.CACHE)
    base = image_check.base_image(podman, image_check.CACHE)
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM {base}\nRUN echo building-{os.getpid()} && exec sleep 600\n")
    log = tmp_path / "build.log"
    driver = (f"import signal, sys; sys.path.insert(0, {str(REPO / 'docker')!r}); import image_check as c; "
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); p = c.Podman(c.CACHE); "
              f"c.build(p, {str(dockerfile)!r}, 'localhost/polytrain-cut-short', ['--no-cache'], "
              f"__import__('pathlib').Path({str(log)!r}))")
    proc = subprocess.Popen([sys.executable, "-c", driver], start_new_session=True)
    try:
        while f"building-{os.getpid()}" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None, "the build ended before its RUN step"
            time.sleep(0.2)
        builders = subprocess.run(["pgrep", "-f", "polytrain-cut-short"], capture_output=True, text=True).stdout
        assert builders.split(), "no build process found"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert subprocess.run(["pgrep", "-f", "polytrain-cut-short"], capture_output=True).returncode == 1
    assert subprocess.run(["pgrep", "-f", f"building-{os.getpid()}"], capture_output=True).returncode == 1
    assert left_behind(podman) == []


def test_an_index_with_credentials_never_becomes_a_build_arg() -> None:
    """Build args are on podman's command line and in the image's history."""
    assert image_check.index_arg(None) == []
    assert image_check.index_arg("file:///opt/pypi/simple https://pypi.example/simple") == [
        "--build-arg", "TORCH_INDEX_URL=file:///opt/pypi/simple https://pypi.example/simple"]
    assert image_check.index_arg("https://me:s3cret@pypi.example/simple") == ["--build-arg", "TORCH_INDEX_URL="]


def test_the_cuda_image_is_built_on_the_local_base_with_the_toolkit_from_pypi_and_the_archs_asked_for() -> None:
    args = image_check.cuda_args("localhost/polytrain-base:bookworm", "8.0,9.0")
    pairs = dict(a.split("=", 1) for a in args[1::2])
    assert args[::2] == ["--build-arg"] * len(pairs)
    assert pairs == {"CUDA_BUILDER_IMAGE": "localhost/polytrain-base:bookworm",
                     "CUDA_RUNTIME_IMAGE": "localhost/polytrain-base:bookworm", "CUDA_TOOLKIT": "pypi",
                     "HOROVOD_CUDA_CC_LIST": "80,90", "TORCH_CUDA_ARCH_LIST": "8.0;9.0"}
    with pytest.raises(image_check.CheckFailed, match="--cuda-archs: expected compute capabilities"):
        image_check.cuda_args("localhost/polytrain-base:bookworm", "sm_90")


def test_the_cuda_build_sees_no_find_links_folder(tmp_path: Path) -> None:
    """A find-links folder may hold torch's CPU wheel, which pip would take for torch==X: the CUDA image leaves
    it out of the pip configuration it mounts."""
    image_check.pip_settings(tmp_path, leave_out=("find-links",))
    assert "find-links" not in (tmp_path / "pip.conf").read_text()
    image_check.pip_settings(tmp_path)
    expected = "find-links" in subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                                               text=True).stdout
    assert ("find-links" in (tmp_path / "pip.conf").read_text()) == expected
