"""The switches the Dockerfiles hand to scripts/setup.sh exist on the other side.

The images install nothing themselves: every ``POLYTRAIN_*``/``HOROVOD_*`` variable
they set must be read by setup.sh or build_horovod.sh, and every extra they ask
for must be in setup.cfg. Otherwise a rename on one side would leave an image that
silently installs something else (verify_image.py would then fail the build, but
only on a machine with Docker; this fails here).
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = {name: REPO / "docker" / f"Dockerfile.{name}" for name in ("cpu", "cuda")}
SCRIPTS = [REPO / "scripts" / "setup.sh", REPO / "scripts" / "build_horovod.sh"]
# Read by the tools setup.sh runs (pip, Horovod's and DeepSpeed's builds), not by the scripts.
THIRD_PARTY = {"HOROVOD_CUDA_HOME", "HOROVOD_NCCL_LINK", "HOROVOD_BUILD_CUDA_CC_LIST"}


def switches(dockerfile: Path) -> set[str]:
    """Variables a Dockerfile sets in ENV or inline before scripts/setup.sh."""
    text = re.sub(r"^ARG .*$", "", dockerfile.read_text(), flags=re.M)  # build args are not switches
    names = set(re.findall(r"\b((?:POLYTRAIN|HOROVOD)_[A-Z_]+)=", text))
    return names - THIRD_PARTY


def read_by_scripts(name: str) -> bool:
    pattern = re.compile(rf"\$\{{?{name}\b")
    return any(pattern.search(path.read_text()) for path in SCRIPTS)


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_every_switch_is_read_by_the_setup_scripts(flavour: str) -> None:
    found = switches(DOCKERFILES[flavour])
    assert {"POLYTRAIN_VENV", "POLYTRAIN_EXTRAS", "POLYTRAIN_HOROVOD"} <= found
    unread = sorted(name for name in found if not read_by_scripts(name))
    assert unread == [], f"Dockerfile.{flavour} sets switches that scripts/setup.sh and build_horovod.sh ignore"


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_every_extra_the_image_asks_for_is_in_setup_cfg(flavour: str) -> None:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    known = set(config["options.extras_require"])
    asked = re.search(r"^ARG POLYTRAIN_EXTRAS=(\S+)$", DOCKERFILES[flavour].read_text(), flags=re.M)
    assert asked is not None
    extras = set(asked.group(1).split(","))
    assert {"torch", "mpi", "deepspeed"} <= extras
    assert sorted(extras - known) == [], f"Dockerfile.{flavour} asks for extras setup.cfg does not define"


def install_inputs() -> tuple[set[str], set[str]]:
    """(the repository files the install reads: those setup.sh names, what setuptools builds from and the module
    setup.cfg reads the version from; the package folders, which the editable install only maps)."""
    named = set(re.findall(r'\$repo/([\w./-]+)', SCRIPTS[0].read_text())) - {".venv"}  # made, not read
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    folders = {line.partition("=")[2].strip() for line in config["options"]["package_dir"].strip().splitlines()}
    readme = config["metadata"]["long_description"].removeprefix("file:").strip()
    version = config["metadata"]["version"].removeprefix("attr:").strip().rpartition(".")[0].replace(".", "/") + ".py"
    return named | {readme, "MANIFEST.in", "setup.py", "pyproject.toml", version}, folders


def builder_gaps(text: str) -> tuple[list[str], list[str]]:
    """(files the install reads that the builder does not COPY before setup.sh, package folders it neither copies
    nor makes as an empty package there)."""
    before_setup = text[:text.index("    scripts/setup.sh")]
    copied = set()
    for line in re.findall(r"^COPY (?!--from)(.+)$", before_setup, flags=re.M):
        copied |= {word.rstrip("/") for word in line.split()[:-1] if not word.startswith("--")}
    runs = " ".join(re.findall(r"^RUN (.+(?:\n .+)*)", before_setup, flags=re.M))
    made = set(re.findall(r"([\w./-]+)/__init__\.py", runs))
    files, folders = install_inputs()

    def covered(path: str) -> bool:
        return any(path == c or path.startswith(c + "/") for c in copied)

    return (sorted(path for path in files if not covered(path)),
            sorted(folder for folder in folders if not covered(folder) and folder not in made))


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_the_builder_has_every_file_the_install_reads(flavour: str) -> None:
    """A file setup.sh or setuptools reads that the builder does not COPY fails only at docker build. The package
    folders need only exist (copied, or made as empty packages by a RUN before setup.sh): polytrain is an
    editable install, which maps them and reads no code in them."""
    files, folders = install_inputs()
    assert {"constraints.txt", "setup.py", "scripts/setup.sh", "polytrain/version.py"} <= files
    assert {"polytrain", "adapters", "launchers"} <= folders
    assert builder_gaps(DOCKERFILES[flavour].read_text()) == ([], [])


def test_a_builder_missing_a_file_or_a_package_folder_is_caught() -> None:
    text = DOCKERFILES["cpu"].read_text()
    assert builder_gaps(text.replace(" launchers/__init__.py", "")) == ([], ["launchers"])
    assert builder_gaps(text.replace("COPY polytrain/version.py polytrain/\n", "")) == (["polytrain/version.py"], [])
