"""Open MPI's /dev/shm segment files: a singleton polytrain process leaves none, and the orphans a killed
job leaves are removed while files still in use are kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from polytrain.comm.mpi_singleton import keep_singletons_off_shared_memory
from polytrain.launchers import shm_leftovers


def test_only_a_process_no_launcher_started_is_kept_off_shared_memory() -> None:
    env: dict[str, str] = {}
    assert keep_singletons_off_shared_memory(env) and env == {"OMPI_MCA_btl": "^sm"}
    for launched in ({"OMPI_COMM_WORLD_SIZE": "2"}, {"PMIX_RANK": "0"}, {"PMI_RANK": "1"}, {"OMPI_MCA_btl": "self,tcp"}):
        env = dict(launched)
        assert not keep_singletons_off_shared_memory(env) and env == launched


@pytest.mark.timeout(60)
def test_new_files_nothing_uses_are_removed_the_rest_kept(tmp_path: Path) -> None:
    old = tmp_path / "sm_segment.h.0.1.0"
    old.write_bytes(b"x")
    before = shm_leftovers.present(where=tmp_path)
    held, orphan, other = (tmp_path / name for name in ("sm_segment.h.0.2.0", "vader_segment.h.0.3.0", "unrelated"))
    for path in (held, orphan, other):
        path.write_bytes(b"\0" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys\n"
                               f"f = open({str(held)!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
                               "print('mapped', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "mapped"
        assert shm_leftovers.remove_orphans(before, where=tmp_path) == [orphan.name]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([old.name, held.name, other.name])
    finally:
        holder.communicate("", timeout=30)
    assert shm_leftovers.remove_orphans(before, where=tmp_path) == [held.name]  # its holder is gone


SINGLETON = "from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); print(MPI.COMM_WORLD.Get_size())"


def _singleton_leaves(code: str) -> set[str]:
    """Run ``code`` as an MPI singleton with a /dev/shm of its own (a private mount namespace, so that the MPI
    jobs of tests running beside this one cannot add their segments); the segment files it left there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    script = 'mount -t tmpfs polytrain-test /dev/shm && "$1" -c "$2" && echo "---" && ls -A /dev/shm'
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                           sys.executable, code], env=env, capture_output=True, text=True, timeout=100)
    out, _, listing = proc.stdout.partition("---\n")
    assert proc.returncode == 0 and out.strip() == "1", proc.stderr
    return {name for name in listing.split() if name.startswith(shm_leftovers.PREFIXES)}


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="a private /dev/shm needs root (unshare --mount)")
@pytest.mark.slow
def test_a_singleton_polytrain_process_leaves_no_segment() -> None:
    """Open MPI 5 leaves a singleton's 16 MiB segment behind; polytrain's MPI paths turn that transport off."""
    pytest.importorskip("mpi4py")
    if not _singleton_leaves(SINGLETON):
        pytest.skip("this MPI leaves no segment from a singleton: nothing to prevent")
    assert _singleton_leaves("import polytrain.comm.mpi_transport; " + SINGLETON) == set()
